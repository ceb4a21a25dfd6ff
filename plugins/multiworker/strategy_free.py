"""Strategy-free multiworker training over the TCP ring (issue 22): the default on CPU workers
(``KERASDIST_STRATEGY_FREE``: auto, the default; on; off keeps MultiWorkerMirroredStrategy's step).

Each worker compiles and fits under TensorFlow's default strategy (one replica, plain Keras ``fit``);
the MultiWorkerMirroredStrategy joined at ``import kerasdist`` only agrees on the ring at ``compile``.
Per step ONE ring message carries every dense gradient times this worker's rows, the rows, and the
loss times the rows: the sums give the gradient of the global batch's mean loss, and the ``loss``
log is corrected to the global running mean. Sparse gradients (an Embedding's ``tf.IndexedSlices``) stay
sparse: their slice counts ride in that message, then every worker's slices are gathered in rank order
(sparse_slices.py), as one process's optimizer takes them. At the start of ``fit`` rank 0's weights and optimizer
state are broadcast over the ring; every batch is split between the workers (``batch_size`` is the
global batch, as under the strategy). Compiled metrics' states are summed over the ring in a second,
small message, only when the model has such metrics (evaluate: every metric, the loss too).
"""

import weakref

import keras

from kerasdist import KerasdistError
from kerasdist.plugin_tools import (int_pieces, keras_step_order_is_known, mean_state, note_applied, rows_of,
                                    optimizers_held_by, same_everywhere, start_first_step_check, unique_variables,
                                    unsummed_after_first_step, unsummed_updates_error)

from . import sparse_slices, step_metrics
from .options import STRATEGY_FREE_VAR

#: model -> _Exchange (what its train step's ring exchange needs)
_exchanges = weakref.WeakKeyDictionary()


def setting(environ):
    """``KERASDIST_STRATEGY_FREE``: "auto" (the default: strategy-free when the workers agree on the TCP ring and
    ``auto``'s probe keeps it), "on" (the same, probe or not) or "off" (MultiWorkerMirroredStrategy's step)."""
    value = given_setting(environ)
    if value not in ("auto", "on", "off"):
        raise KerasdistError(f"{STRATEGY_FREE_VAR}={value!r} is not valid; choose auto (the default: multiworker "
                             "trains without a tf.distribute strategy, over the TCP ring, when the ring runs and "
                             "is faster), on (over the ring whenever it runs) or off (MultiWorkerMirroredStrategy).")
    return value


def given_setting(environ):
    """``KERASDIST_STRATEGY_FREE`` as given (stripped, lower case; unset: "auto"), not yet checked."""
    return environ.get(STRATEGY_FREE_VAR, "auto").strip().lower() or "auto"


class _Exchange:
    """What one model's step exchanges over the ring: the rows of the step being traced (its ``train_step``
    records them), Keras's own step's loss (its ``compute_loss`` records it; it travels with the gradients),
    and the optimizers already summing over the ring."""

    def __init__(self, ring, own_step):
        self.ring, self.own_step = ring, own_step
        self.rows = self.loss = self.tracker_before = None
        self.optimizers = weakref.WeakSet()

    def forget_step(self):
        """After a traced step: its tensors belong to that graph (an ``apply`` outside fit must not see them)."""
        self.rows = self.loss = self.tracker_before = None


def supports(spec):
    """Whether ``spec`` can train strategy-free; the rest keeps MultiWorkerMirroredStrategy (sync_batch_norm's
    per-layer all-reduce, tf.data's file/off sharding of the global batch)."""
    return not spec.sync_batch_norm and spec.shard_policy.lower() in ("auto", "data")


#: model -> True when its compiled losses sum over rows (reduction "sum"): gradients are summed, not averaged
_summed_losses = weakref.WeakKeyDictionary()
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def adjust_compile(compile_kwargs, model):
    """``jit_compile`` off ("auto"; True was refused: the ring is called from the step), and how the workers'
    gradients combine: a mean over rows (Keras's default reduction) or, for losses with reduction "sum", a sum."""
    compile_kwargs["jit_compile"] = False
    losses = [loss for loss in keras.tree.flatten(compile_kwargs.get("loss")) if loss is not None]
    reductions = {getattr(loss, "reduction", "sum_over_batch_size") for loss in losses}
    if reductions <= set(_MEAN_REDUCTIONS) or reductions == {"sum"}:
        _summed_losses[model] = reductions == {"sum"}
        return
    raise KerasdistError(
        f"distribute='multiworker' (strategy-free) cannot combine the workers' gradients for losses with reductions "
        f"{sorted(map(str, reductions))}: give every loss a mean reduction ({', '.join(_MEAN_REDUCTIONS)}) or "
        "every loss 'sum', or set KERASDIST_STRATEGY_FREE=off (MultiWorkerMirroredStrategy's step).")


def install(model, ring):
    """Make ``model``'s steps and every optimizer it holds (``model.optimizer``, and others a custom
    ``train_step`` applies, a GAN's) sum over ``ring``. Idempotent per model; a recompiled model's new
    optimizer is wrapped at its first ``fit``."""
    exchange = _exchanges.get(model)
    if exchange is None:
        exchange = _exchanges[model] = _Exchange(ring, keras_step_order_is_known(model))  # before wrapping
        if exchange.own_step:
            _wrap_compute_loss(model, exchange)
        _wrap_steps(model, exchange)
    exchange.ring = ring
    for optimizer in optimizers_held_by(model):  # the outermost: a LossScaleOptimizer sums before its inf check
        if optimizer not in exchange.optimizers:
            exchange.optimizers.add(optimizer)
            _wrap_apply(model, optimizer, exchange)


def _wrap_compute_loss(model, exchange):
    keras_compute_loss = model.compute_loss

    def compute_loss(*args, **kwargs):
        loss = keras_compute_loss(*args, **kwargs)
        exchange.loss = keras.ops.cast(loss, "float32")
        return loss

    object.__setattr__(model, "compute_loss", compute_loss)


def _wrap_apply(model, optimizer, exchange):
    keras_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        import tensorflow as tf

        note_applied(model, model.trainable_variables if trainable_variables is None else trainable_variables)
        grads = list(grads)
        rows = exchange.rows if exchange.rows is not None else tf.constant(1.0)  # outside fit: a plain mean
        summed = _summed_losses.get(model, False)
        weight = tf.constant(1.0) if summed else rows  # a mean loss's gradient counts as many times as its rows
        loss, exchange.loss = (exchange.loss, None) if optimizer is model.optimizer else (None, exchange.loss)
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        has_rows = rows > 0  # an empty share (a batch smaller than the workers) adds nothing, NaN included

        def weighted(value):
            return tf.where(has_rows, value * tf.cast(weight, value.dtype), tf.zeros_like(value))

        totals = [rows] if loss is None else [rows, weighted(loss)]
        counts = [sparse_slices.slice_counts(grads, sparse, exchange.ring, has_rows)] if sparse else []
        sums = exchange.ring.sum_tensors([weighted(grads[i]) for i in dense] + counts + [tf.stack(totals)])
        total_rows = sums[-1][0]
        divisor = tf.constant(1.0) if summed else total_rows

        def averaged(total):
            return tf.math.divide_no_nan(total, tf.cast(divisor, total.dtype))

        for i, total in zip(dense, sums):
            grads[i] = averaged(total)
        if sparse:  # kept sparse: every worker's slices, as one process's optimizer takes them
            own = [tf.IndexedSlices(grads[i].values * tf.cast(weight, grads[i].values.dtype), grads[i].indices,
                                    grads[i].dense_shape) for i in sparse]
            for i, every in zip(sparse, sparse_slices.gather_slices(own, sums[-2], exchange.ring, has_rows)):
                grads[i] = tf.IndexedSlices(averaged(every.values), every.indices, every.dense_shape)
        if loss is not None and exchange.tracker_before is not None:  # Keras's own step: the global batch's loss
            total, count, total_before, count_before = exchange.tracker_before
            loss_sum = sums[-1][1] * (total_rows if summed else 1.0)  # the tracker weighs each loss by its rows
            total.assign(total_before + keras.ops.cast(loss_sum, total.dtype))
            count.assign(count_before + keras.ops.cast(total_rows, count.dtype))
        return keras_apply(grads, trainable_variables)

    object.__setattr__(optimizer, "apply", apply)


def _loss_tracker_before(model):
    """Keras's ``loss`` tracker's (total, count) and their values before this step: apply sets them to those plus
    the global batch's sums, the same bits on every worker."""
    tracker = next((m for m in model.metrics if m.name == "loss"), None)
    state = mean_state(tracker) if tracker is not None else None
    if state is None:
        return None
    total, count = state
    return total, count, total.value + 0, count.value + 0


def _wrap_steps(model, exchange):
    """Metric states summed over the workers after each step (what MultiWorkerMirroredStrategy's sum-on-read
    metric variables give): each variable's change in this step, summed over the ring in one message, so step
    and epoch logs are the global batch's. Keras's own train step's ``loss`` tracker took the gradients'
    message already (a model without other metrics sends nothing more); a custom step's metrics, its loss
    tracker too, are all summed here. The train step also records its rows for the gradients' weighting."""
    for name in ("train_step", "test_step"):
        keras_step = getattr(model, name)
        skip_loss = name == "train_step" and exchange.own_step

        def step(data, keras_step=keras_step, skip_loss=skip_loss):
            exchange.rows, exchange.loss = rows_of(data), None
            exchange.tracker_before = _loss_tracker_before(model) if skip_loss else None
            try:
                return _summed_step(model, exchange, keras_step, data, skip_loss)
            finally:
                exchange.forget_step()

        object.__setattr__(model, name, step)


def _summed_step(model, exchange, keras_step, data, skip_loss):
    import tensorflow as tf

    variables = _metric_variables(model, skip_loss)
    before = [v.value + 0 for v in variables]
    kept = _kept_if_empty(model, exchange.rows)
    with step_metrics.watched_metrics(model.metrics) as watched:
        logs = keras_step(data)
    kept()
    loose = [] if exchange.own_step else _loose_logs(model, logs)
    results = {k: watched.metric_of(logs[k]) for k in loose}  # a log that is a metric's result() is its result
    loose = [k for k in loose if results[k] is None]
    if not variables and not loose:
        return logs
    rows = exchange.rows
    shared = set() if _summed_losses.get(model, False) else set(map(id, _variables_of(watched.scalar_fed)))
    weights = [tf.where(rows > 0, rows, 0.0) if id(v) in shared else None for v in variables]
    sums = exchange.ring.sum_tensors([_times(v.value - b, w) for v, b, w in zip(variables, before, weights)]
                                     + [keras.ops.cast(logs[k], "float32") for k in loose] + [tf.reshape(rows, [1])])
    total_rows = sums[-1][0]
    for v, b, w, total in zip(variables, before, weights, sums):  # a scalar's share: its rows / the global batch's
        v.assign(b + (total if w is None else tf.math.divide_no_nan(total, tf.cast(total_rows, total.dtype))))
    if exchange.own_step:
        return dict(logs, **model.get_metrics_result())
    by_name = {m.name: m for m in model.metrics}
    logs = {k: by_name[k].result() if k in by_name else results[k].result() if results.get(k) is not None else v
            for k, v in logs.items()}
    return dict(logs, **{k: total / exchange.ring.size for k, total in zip(loose, sums[len(variables):-1])})


def _times(delta, weight):
    import tensorflow as tf

    return delta if weight is None else tf.where(weight > 0, delta * tf.cast(weight, delta.dtype), tf.zeros_like(delta))


def _variables_of(metrics):
    return [v for m in metrics for v in m.variables]


def _kept_if_empty(model, rows):
    """For a worker whose share of the batch is empty: a function that puts back the model's float non-trainable
    state (BatchNormalization's moving statistics would take the empty batch's NaN moments)."""
    import tensorflow as tf

    state = [v for v in model.non_trainable_variables if keras.backend.is_float_dtype(v.dtype)]
    before = [v.value + 0 for v in state]

    def put_back():
        for v, b in zip(state, before):
            v.assign(tf.where(rows > 0, v.value, b))

    return put_back


def _loose_logs(model, logs):
    """A custom step's float scalar logs that no metric of the model backs (averaged over the workers, as
    MultiWorkerMirroredStrategy's reduction did, so callbacks see the same value on every worker); a non-scalar
    float log is refused."""
    if not isinstance(logs, dict):
        return []
    names = {m.name for m in model.metrics}
    floats = [k for k, v in logs.items() if k not in names and hasattr(v, "dtype")
              and keras.backend.is_float_dtype(keras.backend.standardize_dtype(v.dtype))]
    per_row = [k for k in floats if len(getattr(logs[k], "shape", ())) != 0]
    if per_row:  # each worker holds its share's rows: refused, as on torch (the same on every worker, when traced)
        raise KerasdistError(
            f"distribute='multiworker' (strategy-free): the custom step returned the non-scalar float log(s) {per_row};"
            " each worker holds only its share of the batch's rows, so they cannot be the global batch's. Return "
            "scalars (a mean: keras.ops.mean(...)) or a metric's result (update a keras.metrics.Metric with them).")
    return floats


def _metric_variables(model, skip_loss):
    return unique_variables(v for m in model.metrics if not (skip_loss and m.name == "loss") for v in m.variables)


#: models whose weights rank 0 has broadcast (a model's first evaluate/predict before any fit broadcasts too)
_broadcast = weakref.WeakSet()


class BroadcastFromRankZero(keras.callbacks.Callback):
    """At the start of ``fit`` (after any restore): rank 0's weights and optimizer state on every worker. Around a
    custom train step's first batch: every trainable variable it changed went through a summing optimizer."""

    def __init__(self, ring):
        super().__init__()
        self.ring = ring
        self.checked = False

    def on_train_begin(self, logs=None):
        broadcast_state(self.model, self.ring)
        self.began = False

    def on_epoch_begin(self, epoch, logs=None):
        if not getattr(self, "began", True):
            self.began = True
            check_same_first_epoch(epoch, self.ring)

    def on_train_batch_begin(self, batch, logs=None):
        exchange = _exchanges.get(self.model)
        self.checked = exchange is not None and not exchange.own_step and start_first_step_check(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.checked:
            self.checked = False
            unsummed = unsummed_after_first_step(self.model)
            if unsummed:  # the same on every worker: each applied its own gradients with the same optimizer
                raise unsummed_updates_error(unsummed, "multiworker")


def broadcast_before(method, model, ring, call_kwargs):
    """Every worker runs rank 0's weights: ``fit`` broadcasts them at its start (a callback, after the backup's
    restore); ``evaluate``/``predict`` before the model's first ``fit`` broadcast them now (as
    MultiWorkerMirroredStrategy's variables took rank 0's initial values)."""
    if method == "fit":
        call_kwargs["callbacks"].append(BroadcastFromRankZero(ring))
    elif model not in _broadcast:
        broadcast_state(model, ring)


def check_same_first_epoch(epoch, ring):
    """Raise on every worker when they begin ``fit`` at different epochs: each restored its own view of the backup
    (one that missed the chief's folder trains from epoch 0 while the chief resumes), and their steps would pair
    up while their epochs differ, until one stops early and the other waits for it."""
    if not same_everywhere(int_pieces(epoch), ring.sum_arrays, ring.size):
        raise KerasdistError(
            f"multiworker: the workers begin fit at different epochs (worker {ring.rank}: epoch {epoch}): they did "
            "not all restore the chief's backup. Every worker must see the chief's backup folder: on several "
            "machines give kerasdist.multiworker(backup_dir=...) on a shared file system (docs/ray.md); to start "
            "over, delete the backup folder the chief named.")


def broadcast_state(model, ring):
    import numpy as np

    _broadcast.add(model)
    variables = list(model.weights)
    optimizer = model.optimizer
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    unique = unique_variables(variables)
    by_dtype = {}
    for v in unique:
        by_dtype.setdefault(np.dtype(keras.backend.standardize_dtype(v.dtype)), []).append(v)
    for dtype, group in by_dtype.items():
        values = [np.asarray(keras.ops.convert_to_numpy(v.value), dtype) for v in group]
        wire = np.float64 if dtype.kind in "iub" or dtype.itemsize > 4 else np.float32
        sent = [(a if ring.rank == 0 else np.zeros_like(a)).astype(wire) for a in values]
        for v, total in zip(group, ring.sum_arrays(*sent)):
            v.assign(total.astype(dtype))
