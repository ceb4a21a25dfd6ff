"""Strategy-free multiworker training over the TCP ring (issue 22): the default on CPU workers
(``KERASDIST_STRATEGY_FREE``: auto, the default; on; off keeps MultiWorkerMirroredStrategy's step).

Each worker compiles and fits under TensorFlow's default strategy (one replica, plain Keras ``fit``);
the MultiWorkerMirroredStrategy joined at ``import kerasdist`` only agrees on the ring at ``compile``.
Per step ONE ring message carries every dense gradient times this worker's rows, the rows, and the
loss times the rows: the sums give the gradient of the global batch's mean loss, and the ``loss``
log is corrected to the global running mean. At the start of ``fit`` rank 0's weights and optimizer
state are broadcast over the ring; every batch is split between the workers (``batch_size`` is the
global batch, as under the strategy). Compiled metrics' states are summed over the ring in a second,
small message, only when the model has such metrics (evaluate: every metric, the loss too).
"""

import weakref

import keras

from kerasdist import KerasdistError
from kerasdist.plugin_tools import arrays_as_dataset, is_dataset, split_batches

from .options import STRATEGY_FREE_VAR

#: model -> _Exchange (what its train step's ring exchange needs)
_exchanges = weakref.WeakKeyDictionary()


def setting(environ):
    """``KERASDIST_STRATEGY_FREE``: "auto" (the default: strategy-free when the workers agree on the TCP ring and
    ``auto``'s probe keeps it), "on" (the same, probe or not) or "off" (MultiWorkerMirroredStrategy's step)."""
    value = environ.get(STRATEGY_FREE_VAR, "auto").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise KerasdistError(f"{STRATEGY_FREE_VAR}={value!r} is not valid; choose auto (the default: multiworker "
                             "trains without a tf.distribute strategy, over the TCP ring, when the ring runs and "
                             "is faster), on (over the ring whenever it runs) or off (MultiWorkerMirroredStrategy).")
    return value


class _Exchange:
    """The rows and loss of the step being traced, recorded by ``compute_loss``, used by ``apply``."""

    def __init__(self, ring):
        self.ring, self.rows, self.loss = ring, None, None


def supports(spec):
    """Whether ``spec`` can train strategy-free; the rest keeps MultiWorkerMirroredStrategy (sync_batch_norm's
    per-layer all-reduce, tf.data's file/off sharding of the global batch)."""
    return not spec.sync_batch_norm and spec.shard_policy.lower() in ("auto", "data")


def check_compile(compile_kwargs):
    compile_kwargs["jit_compile"] = False  # "auto" (True was refused): the ring is called from the step


def install(model, ring):
    """Make ``model``'s optimizer sum gradients, rows and loss over ``ring`` (idempotent per model)."""
    exchange = _exchanges.get(model)
    if exchange is not None:
        exchange.ring = ring
        return
    exchange = _exchanges[model] = _Exchange(ring)
    keras_compute_loss = model.compute_loss

    def compute_loss(*args, **kwargs):
        import tensorflow as tf

        y_pred = kwargs.get("y_pred", args[2] if len(args) > 2 else None)
        loss = keras_compute_loss(*args, **kwargs)
        leaf = next(t for t in keras.tree.flatten(y_pred) if t is not None)
        exchange.rows = tf.cast(tf.shape(leaf)[0], tf.float32)
        exchange.loss = tf.cast(loss, tf.float32)
        return loss

    object.__setattr__(model, "compute_loss", compute_loss)
    _wrap_apply(model, exchange)
    _wrap_steps(model, exchange)


def _wrap_apply(model, exchange):
    optimizer = model.optimizer  # the outermost (a LossScaleOptimizer sums before its inf/NaN check)
    keras_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        import tensorflow as tf

        grads = list(grads)
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        rows, loss = exchange.rows, exchange.loss
        dense = [i for i, g in enumerate(grads) if g is not None]
        payload = [grads[i] * tf.cast(rows, grads[i].dtype) for i in dense] + [tf.stack([rows, loss * rows])]
        sums = exchange.ring.sum_tensors(payload)
        total_rows, loss_sum = sums[-1][0], sums[-1][1]
        for i, total in zip(dense, sums[:-1]):
            grads[i] = tf.math.divide_no_nan(total, tf.cast(total_rows, total.dtype))
        _make_loss_log_global(model, loss * rows, rows, loss_sum, total_rows)
        return keras_apply(grads, trainable_variables)

    object.__setattr__(optimizer, "apply", apply)


def _make_loss_log_global(model, local_sum, local_rows, global_sum, global_rows):
    """The ``loss`` tracker (a Mean over the epoch, weighted by rows) took this worker's loss: add the others'."""
    tracker = next((m for m in model.metrics if m.name == "loss"), None)
    if tracker is not None and hasattr(tracker, "total") and hasattr(tracker, "count"):
        tracker.total.assign_add(keras.ops.cast(global_sum - local_sum, tracker.total.dtype))
        tracker.count.assign_add(keras.ops.cast(global_rows - local_rows, tracker.count.dtype))


def _wrap_steps(model, exchange):
    """Metric states summed over the workers after each step (what MultiWorkerMirroredStrategy's sum-on-read
    metric variables give): each variable's change in this step, summed over the ring in one message per
    dtype, so step and epoch logs are the global batch's. In training the ``loss`` tracker took the
    gradients' message already; a model without other metrics sends nothing more."""
    for name, skip_loss in (("train_step", True), ("test_step", False)):
        keras_step = getattr(model, name)

        def step(data, keras_step=keras_step, skip_loss=skip_loss):
            variables = _metric_variables(model, skip_loss)
            if not variables:
                return keras_step(data)
            before = [v.value + 0 for v in variables]
            logs = keras_step(data)
            sums = exchange.ring.sum_tensors([v.value - b for v, b in zip(variables, before)])
            for v, b, total in zip(variables, before, sums):
                v.assign(b + total)
            return dict(logs, **model.get_metrics_result()) if isinstance(logs, dict) else logs

        object.__setattr__(model, name, step)


def _metric_variables(model, skip_loss):
    seen, variables = set(), []
    for metric in model.metrics:
        if skip_loss and metric.name == "loss":
            continue
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    return variables


class BroadcastFromRankZero(keras.callbacks.Callback):
    """At the start of ``fit`` (after any restore): rank 0's weights and optimizer state on every worker."""

    def __init__(self, ring):
        super().__init__()
        self.ring = ring

    def on_train_begin(self, logs=None):
        broadcast_state(self.model, self.ring)


def broadcast_state(model, ring):
    import numpy as np

    variables = list(model.weights)
    optimizer = model.optimizer
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    seen, unique = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    by_dtype = {}
    for v in unique:
        by_dtype.setdefault(np.dtype(keras.backend.standardize_dtype(v.dtype)), []).append(v)
    for dtype, group in by_dtype.items():
        values = [np.asarray(keras.ops.convert_to_numpy(v.value), dtype) for v in group]
        wire = np.float64 if dtype.kind in "iub" or dtype.itemsize > 4 else np.float32
        sent = [(a if ring.rank == 0 else np.zeros_like(a)).astype(wire) for a in values]
        for v, total in zip(group, ring.sum_arrays(*sent)):
            v.assign(total.astype(dtype))


def split_call_data(call_kwargs, rank, size, method, seed):
    """``batch_size`` is the global batch: arrays become a dataset shuffled alike on every worker, and
    each worker takes its part of every batch (datasets: ``split_dataset`` already did)."""
    x = call_kwargs.get("x")
    shuffle = seed if method == "fit" and call_kwargs.get("shuffle", True) else None
    if not is_dataset(x) and arrays_as_dataset(call_kwargs, shuffle, method):
        call_kwargs["x"] = split_batches(call_kwargs["x"], rank, size)
    validation = call_kwargs.get("validation_data") if method == "fit" else None
    if validation is not None and not is_dataset(validation):
        parts = dict(zip(("x", "y", "sample_weight"), validation))
        parts["batch_size"] = call_kwargs.get("validation_batch_size") or call_kwargs.get("batch_size")
        if arrays_as_dataset(parts, method="evaluate"):
            call_kwargs["validation_data"] = split_batches(parts["x"], rank, size)


def split_dataset(dataset, ring):
    return split_batches(dataset, ring.rank, ring.size)
