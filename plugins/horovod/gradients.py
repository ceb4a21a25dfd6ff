"""Gradients: Horovod's DistributedOptimizer for Keras 3, on ``horovod.tensorflow`` ops."""

import weakref

import kerasdist
from kerasdist.plugin_tools import process_state

from .options import compression_name, is_compressor, op_name


class GradientReducer:
    """What Horovod's DistributedOptimizer does to gradients, on ``horovod.tensorflow`` ops."""

    def __init__(self, hvd, spec, name):
        self.hvd, self.name = hvd, name
        self.op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[op_name(spec.op)]
        self.compression = (spec.compression if is_compressor(spec.compression) else
                            {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[
                                compression_name(spec.compression)])
        self.passes = spec.backward_passes_per_step
        self.average_aggregated = spec.average_aggregated_gradients
        self.sparse_as_dense = spec.sparse_as_dense
        self.predivide = float(spec.gradient_predivide_factor)
        self.accumulators, self.counter = None, None
        self.rows = None  # this rank's rows in the step being traced (set by count_rows)
        self.weighs_loss = spec.sync_batch_norm  # weight the loss by the rows, not the gradients (see weighted_loss)
        self.loss_weighted = False  # the step being traced weighted its loss (weighted_loss)

    def _weights_rows(self):
        return (self.op == self.hvd.Average and self.passes == 1 and self.rows is not None
                and self.compression is self.hvd.Compression.none)

    def weighted_loss(self, loss):
        """With synchronized batch statistics a rank's loss depends on every rank's rows, and the statistics'
        all-reduce sums the ranks' gradients back through them: weighting each rank's gradient by its rows after
        the backward pass would weigh those cross-rank parts by the wrong rank's rows (an uneven last batch: 3.6e-3
        off one process). The loss is weighted instead, by rows x ranks / the global batch's rows, before the
        backward pass (Keras's train step calls ``optimizer.scale_loss``)."""
        import tensorflow as tf

        if not self.weighs_loss or self.loss_weighted or not self._weights_rows() or self.hvd.size() == 1:
            return loss
        rows = tf.cast(self.rows, tf.float32)
        total = self.hvd.allreduce(rows, op=self.hvd.Sum, name=f"{self.name}_loss_rows")
        self.loss_weighted = True
        return loss * tf.cast(tf.math.divide_no_nan(rows * self.hvd.size(), total), loss.dtype)

    def allreduce(self, grads):
        """All-reduce a list of gradients (None kept); identity on a single process."""
        import tensorflow as tf

        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if self.hvd.size() == 1:
            return list(grads)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        prescale, postscale = (1.0 / self.predivide, self.predivide) if self.op == self.hvd.Average else (1.0, 1.0)
        result = list(grads)
        # Ranks' parts of a batch may differ in size (a small last batch): weight each by its rows. Not
        # with fp16 compression (rows x gradient could overflow float16) nor accumulation/sum/adasum.
        weighted = self._weights_rows() and bool(dense) and not self.loss_weighted
        self.loss_weighted = False
        if weighted:
            rows = tf.cast(self.rows, grads[dense[0]].dtype)
            grads = [_times(g, rows) for g in grads]
            dense_grads = [grads[i] for i in dense] + [tf.reshape(rows, [1])]
        else:
            dense_grads = [grads[i] for i in dense]
        if dense:
            reduced = self.hvd.grouped_allreduce(dense_grads, op=self.op, compression=self.compression,
                                                 prescale_factor=prescale, postscale_factor=postscale,
                                                 name=self.name)
            if weighted:  # mean of rows x gradient over mean of rows: the gradient of the global mean
                mean_rows = reduced.pop()[0]
                reduced = [tf.math.divide_no_nan(r, tf.cast(mean_rows, r.dtype)) for r in reduced]
            for i, r in zip(dense, reduced):
                result[i] = r
        if sparse and (self.op == self.hvd.Adasum or self.predivide != 1.0):
            raise kerasdist.KerasdistError(
                "horovod: sparse gradients (tf.IndexedSlices, e.g. from an Embedding layer) cannot be "
                "all-reduced with op='adasum' or gradient_predivide_factor != 1; pass sparse_as_dense=True.")
        for n, i in enumerate(sparse):
            reduced = self.hvd.allreduce(grads[i], op=self.op, name=f"{self.name}_sparse_{n}")
            result[i] = _times(reduced, 1.0 / mean_rows) if weighted else reduced
        return result

    def count_rows(self, model):
        """Record each traced step's number of rows on this rank (through ``model.compute_loss``)."""
        if model in _row_counters:
            _row_counters[model].reducer = self
            return
        import tensorflow as tf

        import keras

        holder = type("Rows", (), {"reducer": self})()
        original = model.compute_loss

        def compute_loss(*args, **kwargs):
            y_pred = kwargs.get("y_pred", args[2] if len(args) > 2 else None)
            leaf = next((t for t in keras.tree.flatten(y_pred) if t is not None), None)
            holder.reducer.rows = tf.shape(leaf)[0] if leaf is not None else None
            holder.reducer.loss_weighted = False
            return original(*args, **kwargs)

        object.__setattr__(model, "compute_loss", compute_loss)
        _row_counters[model] = holder
        _count_rows_of_own_steps(model, holder)

    def apply(self, optimizer, apply_gradients, grads, variables):
        """All-reduce (every ``passes``-th call, of the local sum) and apply."""
        if self.passes == 1:
            return apply_gradients(self.allreduce(grads), variables)
        return self._accumulate_then_apply(optimizer, apply_gradients, grads, variables)

    def _accumulate_then_apply(self, optimizer, apply_gradients, grads, variables):
        import tensorflow as tf

        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and self.sparse_as_dense else g
                 for g in grads]
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            raise kerasdist.KerasdistError(
                "horovod: backward_passes_per_step > 1 cannot accumulate sparse gradients "
                "(tf.IndexedSlices); pass sparse_as_dense=True.")
        if variables is not None and not optimizer.built:
            with tf.init_scope():
                optimizer.build(list(variables))
        if self.accumulators is None:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="kerasdist_passes")
                self.accumulators = [None if g is None else
                                     tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                                 name="kerasdist_accumulated_gradient") for g in grads]
        for accumulator, g in zip(self.accumulators, grads):
            if g is not None:
                accumulator.assign_add(g)
        self.counter.assign_add(1)

        def reduce_and_apply():
            summed = [None if a is None else a.read_value() for a in self.accumulators]
            reduced = self.allreduce(summed)
            if self.average_aggregated:
                reduced = [None if r is None else r / self.passes for r in reduced]
            apply_gradients(reduced, variables)
            for accumulator in self.accumulators:
                if accumulator is not None:
                    accumulator.assign(tf.zeros_like(accumulator))
            self.counter.assign(0)
            return tf.constant(True)

        def count_step_only():
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(self.counter >= self.passes, reduce_and_apply, count_step_only)


#: model -> the holder its ``compute_loss`` wrapper records rows into (the latest reducer)
_row_counters = weakref.WeakKeyDictionary()


def _count_rows_of_own_steps(model, holder):
    """A model's own ``train_step`` (keras.io's VAE: an ``ops.mean`` loss, no ``compute_loss``): its rows are the
    batch's, and a metric it (or its own ``test_step``) updates with one scalar (a mean of batch losses) weighs this
    rank's share of the global batch (one all-reduce of the rows), so an uneven last batch trains and logs as one
    process."""
    import keras

    from kerasdist.plugin_tools import keras_step_order_is_known, rows_of, weighted_scalar_updates

    def weighted(keras_step, training):
        def step(data):
            import horovod.tensorflow as hvd
            import tensorflow as tf

            rows = rows_of(data)
            if training:
                holder.reducer.rows = rows
            total = hvd.allreduce(rows, op=hvd.Sum, name=f"kerasdist_own_step_rows_{int(training)}")
            with weighted_scalar_updates(model, rows, tf.math.divide_no_nan(rows, total)):
                return keras_step(data)

        return step

    if not keras_step_order_is_known(model):
        object.__setattr__(model, "train_step", weighted(model.train_step, True))
    if type(model).test_step is not keras.Model.test_step and "test_step" not in vars(model):
        object.__setattr__(model, "test_step", weighted(model.test_step, False))


def _times(gradient, factor):
    """``gradient`` (dense, ``IndexedSlices`` or None) times a scalar."""
    import tensorflow as tf

    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(factor, gradient.values.dtype), gradient.indices,
                                gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


class _AllreduceOptimizerMixin:
    """Put first in a Keras optimizer's class: ``apply`` all-reduces the gradients first."""

    def apply(self, grads, trainable_variables=None):
        reducer = self.__dict__.get("_kerasdist_horovod")
        if reducer is None or self.__dict__.get(_REDUCED_BY_WRAPPER):
            return super().apply(grads, trainable_variables)
        return reducer.apply(self, super().apply, list(grads), trainable_variables)

    def scale_loss(self, loss):
        reducer = self.__dict__.get("_kerasdist_horovod")
        return super().scale_loss(loss if reducer is None else reducer.weighted_loss(loss))


def _distributed_classes():
    """Optimizer class -> its all-reducing subclass (a cache: after ``process_state.reset()`` a new
    subclass is made; optimizers already given the old one keep it, and it still all-reduces)."""
    return process_state.slot("horovod.distributed_classes", dict)


def distribute_optimizer(optimizer, reducer):
    """Make ``optimizer`` (same object: its state, built or not, is kept) all-reduce its gradients.

    Its class becomes a subclass with the same name and module, so a saved model reloads
    with the original optimizer class.
    """
    cls = type(optimizer)
    if not issubclass(cls, _AllreduceOptimizerMixin):
        classes = _distributed_classes()
        if cls not in classes:
            classes[cls] = type(cls.__name__, (_AllreduceOptimizerMixin, cls),
                                {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        object.__setattr__(optimizer, "__class__", classes[cls])
    object.__setattr__(optimizer, "_kerasdist_horovod", reducer)  # outside Keras/TF tracking
    optimizer.__dict__.pop(_REDUCED_BY_WRAPPER, None)
    return optimizer


_REDUCED_BY_WRAPPER = "_kerasdist_horovod_reduced_by_wrapper"


def reduce_before_loss_scaling(optimizer):
    """Under mixed_float16 ``compile`` wraps the optimizer in a ``LossScaleOptimizer``, which checks
    the gradients for inf/NaN before the wrapped optimizer's ``apply`` runs (or is skipped). All-reduce
    in the wrapper instead: every rank then checks the same sums and takes the same branch (a rank
    whose own gradients overflowed would otherwise skip the all-reduce the others wait in)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    reducer = inner.__dict__.get("_kerasdist_horovod") if inner is not None else None
    if reducer is None or optimizer.__dict__.get("_kerasdist_horovod") is reducer:
        return
    distribute_optimizer(optimizer, reducer)
    object.__setattr__(inner, _REDUCED_BY_WRAPPER, True)



def constant_learning_rate(optimizer):
    import keras

    return isinstance(optimizer.learning_rate, keras.Variable)


def scale_learning_rate(optimizer, factor):
    """Multiply a constant learning rate by ``factor`` (Horovod's ``lr * hvd.size()``)."""
    if not constant_learning_rate(optimizer):
        raise kerasdist.KerasdistError(
            "horovod: scale_learning_rate=True needs a constant (float) learning rate, but the optimizer "
            f"uses a schedule; multiply the schedule's initial learning rate by the world size ({factor}) "
            "yourself and leave scale_learning_rate=False.")
    optimizer.learning_rate = float(optimizer.learning_rate.numpy()) * factor
