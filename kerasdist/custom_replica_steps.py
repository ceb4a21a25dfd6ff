"""A model's own ``train_step`` (and ``test_step``) under a tf.distribute strategy of several replicas in one
process (mirrored, central_storage): trained and logged as one device on the global batch, whatever its loss is.

Keras divides a ``keras.losses.Loss`` by the replicas and sums the replicas' gradients; a loss that is no
``Loss`` (keras.io's VAE: ``ops.mean(...)``) was not divided, so each step was R times one device's. Here, inside
such a step, no loss is divided (each replica's loss is its own rows' mean, whatever made it), and each optimizer
the model holds weights a replica's gradients by its share of the global batch, ``n_r / N`` (1 for compiled losses
with reduction "sum"), before Keras sums them: the global batch's gradient, uneven batches included.

Inside the step a metric updated with one scalar and no sample weight (``tracker.update_state(loss)``: a mean of
batch losses) is updated with the sample weight ``n_r / N``: summed over the replicas, the global batch's value,
counted once; any other update is summed as it is. After the step ONE all-reduce carries the metrics' per-replica
states (MirroredStrategy; CentralStorageStrategy holds them summed already) and the step's scalar logs: a log equal
on every replica to a metric's result becomes that metric's result from the summed state, any other is the replicas'
values weighted by ``n_r / N``. Every replica then returns the global logs, as one device logs them (per batch, per
epoch, in ``history``).
"""

import contextlib
import threading
import weakref

import keras

from ._keras_internals.losses import unscaled_losses
from ._keras_internals.training import keras_step_order_is_known, set_batch_share_weighting
from .errors import KerasdistError
from .variables import unique_variables

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
_step = threading.local()  # the replica step being traced in this thread (MirroredStrategy: one thread a replica)
_weighting = weakref.WeakSet()  # optimizers whose apply weights the replicas


class _ReplicaStep:
    def __init__(self, rows, share, gradient_weight):
        self.rows, self.share, self.gradient_weight = rows, share, gradient_weight


def custom_steps_train_as_one_device(model, compile_kwargs, word):
    """Where ``model`` has its own ``train_step`` or ``test_step`` (Keras's own are left to
    ``replicas_train_as_one_device``), make it train and log as one device under the replicas of ``word``'s
    strategy. Call from ``kerasdist_adjust_compile``. Idempotent."""
    train = not keras_step_order_is_known(model)
    test = _own_test_step(model)
    if not train and not test:
        return
    losses = [loss for loss in keras.tree.flatten(compile_kwargs.get("loss")) if loss is not None]
    reductions = {str(getattr(loss, "reduction", "sum_over_batch_size")) for loss in losses}
    if not (reductions <= set(_MEAN_REDUCTIONS) or reductions == {"sum"}):
        raise KerasdistError(
            f"distribute={word!r}: a custom train_step with compiled losses of reductions {sorted(reductions)} cannot "
            f"weight the replicas' gradients as one device: give every loss a mean reduction "
            f"({', '.join(_MEAN_REDUCTIONS)}) or every loss 'sum'.")
    summed = reductions == {"sum"}
    if train:
        set_batch_share_weighting(model, False)  # this step weights the gradients itself
    for name, own in (("train_step", train), ("test_step", test)):
        step = getattr(model, name)
        if own and not getattr(step, "_kerasdist_replica_step", False):
            object.__setattr__(model, name, _replica_step(model, step, summed, training=name == "train_step"))


def output_losses_weighted_by_share(model, sum_rows=None):
    """Keras's own ``train_step`` and ``test_step``: its per-output loss trackers (``out_loss``, ``aux_loss`` of a
    model compiled with a loss per output) are updated with one scalar and the batch's static size, None where a
    dataset's batch size is not static: one process then weighs every step alike, and the replicas' or processes'
    parts of a step each counted as a step (an uneven last batch logged otherwise than one process). Inside those
    steps each such update weighs this part's share of the global batch (its rows over the rows summed by
    ``sum_rows``; None: the replica context's all-reduce), as :func:`weighted_scalar_updates`. The rows are summed
    only for a model with per-output trackers. Call from ``kerasdist_adjust_compile``, after the word's own step
    wrappers. Idempotent."""
    from ._keras_internals.training import output_loss_trackers

    def weighted(keras_step):
        def step(data):
            import tensorflow as tf

            if not output_loss_trackers(model):
                return keras_step(data)
            total_of = step.sum_rows
            if total_of is None:
                context = tf.distribute.get_replica_context()
                if context is None or context.num_replicas_in_sync == 1:
                    return keras_step(data)
                total_of = lambda rows: context.all_reduce(tf.distribute.ReduceOp.SUM, rows)  # noqa: E731
            rows = rows_of(data)
            with weighted_scalar_updates(model, rows, tf.math.divide_no_nan(rows, total_of(rows))):
                return keras_step(data)

        step._kerasdist_output_losses = True  # still Keras's own step (keras_step_order_is_known, _own_test_step)
        step._kerasdist_empty_replicas = getattr(keras_step, "_kerasdist_empty_replicas", False)
        return step

    for name, keras_own in (("train_step", keras_step_order_is_known(model)), ("test_step", not _own_test_step(model))):
        step = getattr(model, name)
        if not keras_own:
            continue
        if not getattr(step, "_kerasdist_output_losses", False):
            step = weighted(step)
            object.__setattr__(model, name, step)
        step.sum_rows = sum_rows  # a model compiled again under another word: that word's sum


def _own_test_step(model):
    own = vars(model).get("test_step")
    if own is not None and not getattr(own, "_kerasdist_replica_step", False):
        return not (getattr(own, "_kerasdist_empty_replicas", False) or getattr(own, "_kerasdist_output_losses", False))
    return type(model).test_step is not keras.Model.test_step


def _replica_step(model, keras_step, summed, training):
    def step(data):
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return keras_step(data)
        if training:
            for optimizer in _optimizers(model):
                _weight_gradients(optimizer)
        rows = rows_of(data)
        share = tf.math.divide_no_nan(rows, context.all_reduce(tf.distribute.ReduceOp.SUM, rows))
        with weighted_scalar_updates(model, rows, share, summed), unscaled_losses():
            current = _step.current  # its gradient weight: what this step's optimizers apply
            logs = keras_step(data)
        return _global_logs(context, unique_variables(model.metrics), logs, current)

    step._kerasdist_replica_step = True
    return step


@contextlib.contextmanager
def weighted_scalar_updates(model, rows, share, summed=False):
    """While a step traces (this thread): each metric of ``model`` updated with one scalar and no sample weight
    (a mean of batch losses) is updated with the sample weight ``share`` (this replica's or process's rows over the
    global batch's, a tensor; ``rows`` its rows): summed over the replicas or processes, the global batch's value,
    counted once (``summed``: the losses sum over rows, and the value adds whole)."""
    import tensorflow as tf

    for metric in unique_variables(model.metrics):
        _watch(metric)
    before = getattr(_step, "current", None)
    _step.current = _ReplicaStep(rows, share, tf.cast(rows > 0, tf.float32) if summed else share)
    try:
        yield
    finally:
        _step.current = before


def _global_logs(context, metrics, logs, current):
    """The one all-reduce (see the module's docstring) and the global batch's logs, the same on every replica."""
    import tensorflow as tf

    if not isinstance(logs, dict):
        return logs
    has_rows = current.rows > 0
    local = _results(metrics, None)
    leaves = [(path, value) for path, value in _entries(logs) if _scalar_float(value)]
    candidates = [([path[-1]] if path[-1] in local else []) + [n for n in local if n != path[-1]]
                  for path, _ in leaves]
    flags = [tf.stack([tf.where(has_rows, tf.cast(tf.equal(_float(value), _float(local[n])), tf.float32), 1.0)
                       for n in names]) if names else tf.zeros([0]) for (_, value), names in zip(leaves, candidates)]
    weighted = [tf.where(has_rows, _float(value) * current.gradient_weight, 0.0) for _, value in leaves]
    # a metric's state is per replica (MirroredStrategy: summed when read) or one variable the replicas'
    # updates were summed into (CentralStorageStrategy)
    variables = unique_variables(v for m in metrics for v in m.variables
                                 if isinstance(v.value, tf.distribute.DistributedValues))
    state, votes, values = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                              [[v.value + 0 for v in variables], flags, weighted])
    results = _results(metrics, dict(zip(map(id, variables), state))) if variables else local
    replicas = float(context.num_replicas_in_sync)
    reduced = {k: dict(v) if isinstance(v, dict) else v for k, v in logs.items()}
    for (path, leaf), names, vote, value in zip(leaves, candidates, votes, values):
        if names:
            backed = tf.equal(vote, replicas)
            metric_value = tf.gather(tf.stack([_float(results[n]) for n in names]), tf.argmax(tf.cast(backed, tf.int32)))
            value = tf.where(tf.reduce_any(backed), metric_value, value)
        value = tf.cast(value, leaf.dtype) if hasattr(leaf, "dtype") else value
        if len(path) == 1:
            reduced[path[0]] = value
        else:
            reduced[path[0]][path[1]] = value
    return reduced


def _entries(logs):
    """``(path, value)`` for each log, a dict's entries one level down (a compiled metrics' container's result)."""
    for key, value in logs.items():
        if isinstance(value, dict):
            yield from (((key, inner), v) for inner, v in value.items())
        else:
            yield (key,), value


def _results(metrics, summed_values):
    """Each scalar float result a log can be, by name: ``{m.name: m.result()}`` and a compiled container's
    entries, from the metrics' state as read here (``summed_values`` None) or from the replicas' summed state."""
    found = {}
    for metric in metrics:
        if summed_values is None:
            result = metric.result()
        else:
            result = metric.stateless_result([summed_values.get(id(v), v.value) for v in metric.variables])
        entries = result if isinstance(result, dict) else {metric.name: result}
        for name, value in entries.items():
            if _scalar_float(value):
                found.setdefault(name, value)
    return found


def _float(value):
    import tensorflow as tf

    return tf.cast(value, tf.float32)


def _scalar_float(value):
    dtype = getattr(value, "dtype", None)
    return (isinstance(value, float) or dtype is not None and len(getattr(value, "shape", (1,))) == 0
            and keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype)))


def _watch(metric):
    """Inside a step of :func:`_replica_step`, a metric updated with one scalar and no sample weight (a mean of
    batch losses) is updated with the weight ``n_r / N``: summed over the replicas, the global batch's value,
    counted once. With summed losses the value adds whole (``value / share`` weighted by ``share``)."""
    if "_kerasdist_replica_watched" in metric.__dict__:
        return
    update = metric.update_state

    def update_state(*args, **kwargs):
        import tensorflow as tf

        current = getattr(_step, "current", None)
        values = args[0] if args else kwargs.get("values")
        if (current is None or len(args) > 1 or kwargs.get("sample_weight") is not None
                or not set(kwargs) <= {"values", "sample_weight"} or len(getattr(values, "shape", (1,))) != 0):
            return update(*args, **kwargs)
        values = tf.convert_to_tensor(values)
        share = tf.cast(current.share, values.dtype)
        if current.gradient_weight is not current.share:  # summed losses
            values = tf.math.divide_no_nan(values, share)
        return update(tf.where(current.rows > 0, values, tf.zeros_like(values)), sample_weight=share)

    object.__setattr__(metric, "_kerasdist_replica_watched", True)
    object.__setattr__(metric, "update_state", update_state)


def _optimizers(model):
    from .variables import optimizers_held_by

    return optimizers_held_by(model)


def _weight_gradients(optimizer):
    """``optimizer.apply`` (``apply_gradients`` calls it) weights this replica's gradients by its share, inside a
    step of :func:`_replica_step`; elsewhere it is Keras's own."""
    if optimizer in _weighting:
        return
    _weighting.add(optimizer)
    keras_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        current = getattr(_step, "current", None)
        if current is not None:
            grads = [_times(g, current.gradient_weight, current.rows > 0) for g in grads]
        return keras_apply(grads, trainable_variables)

    object.__setattr__(optimizer, "apply", apply)


def _times(gradient, weight, has_rows):
    """``gradient`` times ``weight``; exact zeros for a replica given no rows (its NaN gradient adds nothing)."""
    import tensorflow as tf

    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(_times(gradient.values, weight, has_rows), gradient.indices, gradient.dense_shape)
    return tf.where(has_rows, gradient * tf.cast(weight, gradient.dtype), tf.zeros_like(gradient))


def rows_of(data):
    """The rows of a batch as a train step receives it (float32 tensor; 1 where it has no array)."""
    import tensorflow as tf

    try:
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
    except ValueError:  # a custom step's own structure
        x = data
    leaf = next((t for t in keras.tree.flatten(x) if t is not None), None)
    return tf.cast(tf.shape(leaf)[0], tf.float32) if leaf is not None else tf.constant(1.0)
