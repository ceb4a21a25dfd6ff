"""distribute="horovod": Horovod ring all-reduce for Keras 3, one process per rank.

Launch with ``horovodrun -np 2 -H localhost:2 python train.py``; the script only says
``model.compile(..., distribute="horovod")``. Horovod's own Keras layer is Keras-2 only
(``.ref()`` on variables, horovod#4290), so this plugin does the Keras 3 side itself on
``horovod.tensorflow`` ops:

- gradients: the compiled optimizer is given an ``apply`` that all-reduces gradients with
  ``hvd.grouped_allreduce`` (tensor fusion) first, with the options of Horovod's
  ``DistributedOptimizer`` (op, compression, backward_passes_per_step, sparse_as_dense,
  gradient_predivide_factor, average_aggregated_gradients);
- at the start of ``fit``: the model must be the same on every rank (checked, never a
  hang), then weights and optimizer state are broadcast from rank 0;
- epoch logs (and ``evaluate`` results) are averaged across ranks;
- ``fit``/``evaluate`` data is sharded by rank (whole batches; the user's batch size is
  per rank), with the same number of steps on every rank;
- checkpoints, TensorBoard, CSV logs and the progress bar run on rank 0 only;
- optional learning-rate scaling by the world size and Horovod's warm-up schedule.
- elastic training (``horovodrun --min-np/--max-np``): :func:`run_elastic` instead of ``fit``.

Each rank is one replica: the strategy is TensorFlow's default strategy.
"""

import dataclasses
import glob
import importlib.util
import logging
import math
import numbers
import os
import warnings
from typing import Any

import kerasdist

log = logging.getLogger("kerasdist.horovod")

HOROVOD_VERSION = "0.28.1"
BUILD_COMMAND = ("build horovod with TensorFlow + Gloo: run `make venv` (or "
                 "`bash .ci/build_horovod.sh path/to/python`) in a kerasdist checkout; a plain "
                 "`pip install horovod` does not build against TF >= 2.16 (see docs/horovod.md)")

#: Horovod settings the plugin uses on CPU clusters unless the environment (or horovodrun's
#: flags) already sets them. Measured with bench/bench_horovod.py; see docs/benchmarks.md.
#: A 5 ms cycle (Horovod: 1 ms) halves the background thread's negotiation rounds, which compete with
#: the compute threads for the cores.
CPU_DEFAULTS = {"HOROVOD_CYCLE_TIME": "5"}

_OPS = ("average", "sum", "adasum")
_COMPRESSIONS = ("none", "fp16")
_CHIEF_ONLY_CALLBACKS = ("ModelCheckpoint", "TensorBoard", "CSVLogger", "ProgbarLogger")
_LAUNCH_VARS = (  # (rank, size, local rank, local size, launcher)
    ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "horovodrun"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpirun"),
)


@dataclasses.dataclass
class Horovod(kerasdist.StrategySpec):
    """Data parallelism over the processes ``horovodrun`` starts, with Horovod's all-reduce.

    :param op: "average" (default), "sum" or "adasum" (Adasum needs Horovod built with MPI).
    :param compression: "none" or "fp16" (gradients travel as float16).
    :param backward_passes_per_step: accumulate this many local gradients before one
        all-reduce and one optimizer update.
    :param average_aggregated_gradients: divide the accumulated gradient by
        ``backward_passes_per_step`` (Horovod's default: False, i.e. the sum).
    :param sparse_as_dense: all-reduce ``IndexedSlices`` gradients as dense tensors.
    :param gradient_predivide_factor: with op="average", divide by this before the sum
        and by ``size / factor`` after it.
    :param scale_learning_rate: multiply the optimizer's learning rate by the world size.
    :param warmup_epochs: ramp the learning rate from ``lr / size`` up to ``lr`` over this
        many epochs (Horovod's ``LearningRateWarmupCallback``); 0 turns it off.
    :param shard: split ``fit``/``evaluate`` data between ranks.
    :param average_metrics: average epoch logs and ``evaluate`` results across ranks.
    """

    op: Any = "average"
    compression: Any = "none"
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    scale_learning_rate: bool = False
    warmup_epochs: float = 0.0
    shard: bool = True
    average_metrics: bool = True


# -- registration and availability ----------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("horovod", Horovod, aliases=("hvd",), check=unavailable_reason, install=BUILD_COMMAND,
             description="Horovod ring all-reduce (Gloo or MPI), one process per rank: "
                         "launch with `horovodrun -np N python train.py`.")


def unavailable_reason():
    """Why horovod cannot run here, or None; never imports horovod or TensorFlow."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return f"needs horovod {HOROVOD_VERSION} (not installed): {BUILD_COMMAND}"
    for location in spec.submodule_search_locations:
        if glob.glob(os.path.join(location, "tensorflow", "mpi_lib*.so")):
            return None
    return (f"horovod is installed ({spec.submodule_search_locations[0]}) but was built without "
            f"TensorFlow (no horovod/tensorflow/mpi_lib*.so): {BUILD_COMMAND}")


def _import_horovod():
    reason = unavailable_reason()
    if reason:
        raise kerasdist.PluginUnavailableError(f"distribute='horovod' cannot run here: {reason}.")
    try:
        import horovod.tensorflow as hvd
    except Exception as exc:  # an op library built against another TensorFlow fails here
        raise kerasdist.PluginUnavailableError(
            f"distribute='horovod': horovod.tensorflow failed to load ({type(exc).__name__}: {exc}); "
            f"it was probably built against another TensorFlow: {BUILD_COMMAND}.") from exc
    return hvd


# -- cluster: detection, process start, strategy ---------------------------------

@kerasdist.hookimpl(tryfirst=True)
def kerasdist_detect_cluster(environ):
    for rank_var, size_var, local_rank_var, local_size_var, launcher in _LAUNCH_VARS:
        if rank_var not in environ:
            continue
        if launcher != "horovodrun" and ("TF_CONFIG" in environ or importlib.util.find_spec("horovod") is None):
            return None  # an MPI launch, but not a Horovod one
        rank, size = _int_var(environ, rank_var), _int_var(environ, size_var, default=1)
        if not 0 <= rank < size:
            raise kerasdist.ClusterConfigError(
                f"{rank_var}={rank} is not a rank of {size_var}={size}: the launcher's environment "
                "is inconsistent; start the job with `horovodrun -np N python script.py`.")
        extra = {"size": size, "launcher": launcher,
                 "local_rank": _int_var(environ, local_rank_var, default=0),
                 "local_size": _int_var(environ, local_size_var, default=1)}
        return kerasdist.ClusterInfo(task_type="worker", task_index=rank,
                                     cluster={"worker": [f"horovod-rank-{i}" for i in range(size)]},
                                     source="horovod", extra=extra)
    return None


def _int_var(environ, name, default=None):
    value = environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise kerasdist.ClusterConfigError(
            f"{name}={value!r} is not a whole number; it is set by horovodrun/mpirun: do not set it by hand.")


@kerasdist.hookimpl
def kerasdist_auto_strategy(cluster):
    return "horovod" if cluster.source == "horovod" else None


@kerasdist.hookimpl
def kerasdist_process_start(cluster, environ):
    """Under horovodrun: Horovod's CPU defaults, one GPU per local rank, ``hvd.init()``."""
    if cluster.source != "horovod":
        return
    for name, value in CPU_DEFAULTS.items():
        environ.setdefault(name, value)
    if unavailable_reason():
        return  # compile(distribute="horovod") raises with the reason and the fix
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[cluster.extra.get("local_rank", 0) % len(gpus)], "GPU")
    _import_horovod().init()


@kerasdist.hookimpl
def kerasdist_create_strategy(spec, cluster):
    if not isinstance(spec, Horovod):
        return None
    import tensorflow as tf

    check_options(spec)
    hvd = _import_horovod()
    if cluster.source != "horovod":
        warnings.warn("distribute='horovod' in a process not started by horovodrun: training on this "
                      "one process. Launch it with `horovodrun -np N -H localhost:N python script.py` "
                      "to train on N processes.", stacklevel=2)
    hvd.init()  # a no-op when process start already did it
    check_runtime(spec, hvd)
    if tf.distribute.has_strategy():
        raise kerasdist.StrategyConflictError(
            "compile(distribute='horovod') was called inside a tf.distribute strategy scope; call it "
            "outside any `with strategy.scope():` block (Horovod runs one replica per process).")
    return tf.distribute.get_strategy()


def check_options(spec):
    """Reject bad option values before anything starts."""
    if _op_name(spec.op) not in _OPS:
        raise kerasdist.KerasdistError(f"horovod: op={spec.op!r} is not valid; choose one of {', '.join(_OPS)}.")
    if not (_compression_name(spec.compression) in _COMPRESSIONS or _is_compressor(spec.compression)):
        raise kerasdist.KerasdistError(
            f"horovod: compression={spec.compression!r} is not valid; choose 'none' or 'fp16' "
            "(or a horovod.tensorflow.Compression class).")
    passes = spec.backward_passes_per_step
    if not isinstance(passes, numbers.Integral) or isinstance(passes, bool) or passes < 1:
        raise kerasdist.KerasdistError(
            f"horovod: backward_passes_per_step={passes!r} is not valid; give a whole number >= 1.")
    factor = spec.gradient_predivide_factor
    if not isinstance(factor, numbers.Real) or factor <= 0:
        raise kerasdist.KerasdistError(
            f"horovod: gradient_predivide_factor={factor!r} is not valid; give a number > 0.")
    if factor != 1.0 and _op_name(spec.op) != "average":
        raise kerasdist.KerasdistError(
            f"horovod: gradient_predivide_factor={factor!r} needs op='average' (got op={spec.op!r}); "
            "use op='average' or leave gradient_predivide_factor at 1.0.")
    if _op_name(spec.op) == "adasum" and spec.average_aggregated_gradients:
        raise kerasdist.KerasdistError(
            "horovod: op='adasum' does not support average_aggregated_gradients=True; set it to False.")
    if not isinstance(spec.warmup_epochs, numbers.Real) or spec.warmup_epochs < 0:
        raise kerasdist.KerasdistError(
            f"horovod: warmup_epochs={spec.warmup_epochs!r} is not valid; give a number >= 0 (0: no warm-up).")


def check_runtime(spec, hvd):
    """Reject settings this Horovod build or world cannot run, before any collective starts."""
    if _op_name(spec.op) != "adasum" or hvd.size() == 1:
        return
    if not hvd.mpi_enabled():
        built = "built without MPI" if not hvd.mpi_built() else "running with the Gloo controller"
        raise kerasdist.KerasdistError(
            f"horovod: op='adasum' needs Horovod's MPI controller (its CPU Adasum is MPI-only), but this "
            f"Horovod is {built}. Use op='average', or install MPI, rebuild horovod "
            "(bash .ci/build_horovod.sh) and launch with `horovodrun --mpi`.")
    size = hvd.size()
    if size & (size - 1):
        raise kerasdist.KerasdistError(
            f"horovod: op='adasum' needs a power-of-2 number of processes, got {size}; use op='average' "
            "or launch 2, 4, 8, ... processes.")


def _op_name(op):
    if isinstance(op, str):
        return op.strip().lower()
    names = {}
    try:
        from horovod.tensorflow import Adasum, Average, Sum

        names = {Average: "average", Sum: "sum", Adasum: "adasum"}
    except Exception:
        pass
    return names.get(op, repr(op))


def _compression_name(compression):
    return compression.strip().lower() if isinstance(compression, str) else None


def _is_compressor(compression):
    return hasattr(compression, "compress") and hasattr(compression, "decompress")


# -- gradients: the all-reduce inside the optimizer --------------------------------

class GradientReducer:
    """What Horovod's DistributedOptimizer does to gradients, on ``horovod.tensorflow`` ops."""

    def __init__(self, hvd, spec, name):
        self.hvd, self.name = hvd, name
        self.op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[_op_name(spec.op)]
        self.compression = (spec.compression if _is_compressor(spec.compression) else
                            {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[
                                _compression_name(spec.compression)])
        self.passes = spec.backward_passes_per_step
        self.average_aggregated = spec.average_aggregated_gradients
        self.sparse_as_dense = spec.sparse_as_dense
        self.predivide = float(spec.gradient_predivide_factor)
        self.accumulators, self.counter = None, None

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
        if dense:
            reduced = self.hvd.grouped_allreduce([grads[i] for i in dense], op=self.op,
                                                 compression=self.compression, prescale_factor=prescale,
                                                 postscale_factor=postscale, name=self.name)
            for i, r in zip(dense, reduced):
                result[i] = r
        if sparse and (self.op == self.hvd.Adasum or self.predivide != 1.0):
            raise kerasdist.KerasdistError(
                "horovod: sparse gradients (tf.IndexedSlices, e.g. from an Embedding layer) cannot be "
                "all-reduced with op='adasum' or gradient_predivide_factor != 1; pass sparse_as_dense=True.")
        for n, i in enumerate(sparse):
            result[i] = self.hvd.allreduce(grads[i], op=self.op, name=f"{self.name}_sparse_{n}")
        return result

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


class _AllreduceOptimizerMixin:
    """Put first in a Keras optimizer's class: ``apply`` all-reduces the gradients first."""

    def apply(self, grads, trainable_variables=None):
        reducer = self.__dict__.get("_kerasdist_horovod")
        if reducer is None:
            return super().apply(grads, trainable_variables)
        return reducer.apply(self, super().apply, list(grads), trainable_variables)


_distributed_classes = {}


def distribute_optimizer(optimizer, reducer):
    """Make ``optimizer`` (same object: its state, built or not, is kept) all-reduce its gradients.

    Its class becomes a subclass with the same name and module, so a saved model reloads
    with the original optimizer class.
    """
    cls = type(optimizer)
    if not issubclass(cls, _AllreduceOptimizerMixin):
        if cls not in _distributed_classes:
            _distributed_classes[cls] = type(cls.__name__, (_AllreduceOptimizerMixin, cls),
                                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        object.__setattr__(optimizer, "__class__", _distributed_classes[cls])
    object.__setattr__(optimizer, "_kerasdist_horovod", reducer)  # outside Keras/TF tracking
    return optimizer


_optimizers_wrapped = 0


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, spec):
    global _optimizers_wrapped
    if not isinstance(spec, Horovod):
        return
    import horovod.tensorflow as hvd

    jit = compile_kwargs.get("jit_compile", "auto")
    if jit is True and hvd.size() > 1:
        raise kerasdist.KerasdistError(
            "compile(jit_compile=True, distribute='horovod'): XLA cannot compile Horovod's all-reduce "
            "(this build leaves out Horovod's XLA ops); pass jit_compile=False or 'auto'.")
    compile_kwargs["jit_compile"] = False
    optimizer = compile_kwargs["optimizer"]
    if spec.backward_passes_per_step > 1 and getattr(optimizer, "gradient_accumulation_steps", None):
        raise kerasdist.KerasdistError(
            f"horovod: backward_passes_per_step={spec.backward_passes_per_step} and the optimizer's "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} both accumulate "
            "gradients; use one of them (backward_passes_per_step also saves all-reduces).")
    _optimizers_wrapped += 1  # the same count on every rank running the same script
    previous = optimizer.__dict__.get("_kerasdist_horovod")
    reducer = GradientReducer(hvd, spec, name=f"kerasdist_gradients_{_optimizers_wrapped}")
    reducer.lr_scaled = getattr(previous, "lr_scaled", False)
    distribute_optimizer(optimizer, reducer)
    if spec.scale_learning_rate and not reducer.lr_scaled:
        scale_learning_rate(optimizer, hvd.size())
        reducer.lr_scaled = True
    reducer.warmup_target_lr = getattr(previous, "warmup_target_lr", None)
    if spec.warmup_epochs:
        if not _constant_learning_rate(optimizer):
            raise kerasdist.KerasdistError(
                f"horovod: warmup_epochs={spec.warmup_epochs} needs a constant (float) learning rate, but "
                "the optimizer uses a schedule; put the warm-up into the schedule or set warmup_epochs=0.")
        if reducer.warmup_target_lr is None:  # fixed once: a fit stopped mid-warm-up must not lower it
            reducer.warmup_target_lr = float(optimizer.learning_rate.numpy())


def _constant_learning_rate(optimizer):
    import keras

    return isinstance(optimizer.learning_rate, keras.Variable)


def scale_learning_rate(optimizer, factor):
    """Multiply a constant learning rate by ``factor`` (Horovod's ``lr * hvd.size()``)."""
    if not _constant_learning_rate(optimizer):
        raise kerasdist.KerasdistError(
            "horovod: scale_learning_rate=True needs a constant (float) learning rate, but the optimizer "
            f"uses a schedule; multiply the schedule's initial learning rate by the world size ({factor}) "
            "yourself and leave scale_learning_rate=False.")
    optimizer.learning_rate = float(optimizer.learning_rate.numpy()) * factor


# -- fit / evaluate: data, callbacks ------------------------------------------------

@kerasdist.hookimpl
def kerasdist_prepare_dataset(dataset, method, spec):
    if not isinstance(spec, Horovod) or not spec.shard or method == "predict":
        return None
    import horovod.tensorflow as hvd

    if hvd.size() == 1:
        return None
    return shard_dataset(dataset, hvd.rank(), hvd.size(), method)


def shard_dataset(dataset, rank, size, what="fit"):
    """Rank ``rank``'s whole batches, the same number on every rank (a finite tail is dropped)."""
    import tensorflow as tf

    count = int(dataset.cardinality())
    if count == tf.data.UNKNOWN_CARDINALITY:
        warnings.warn(f"horovod: the {what} dataset's size is unknown, so ranks may run different numbers "
                      "of steps and stall at the end: pass steps_per_epoch= (the same on every rank) or "
                      "use a dataset of known size.", stacklevel=3)
    elif count != tf.data.INFINITE_CARDINALITY:
        usable = count // size * size
        if usable == 0:
            raise kerasdist.KerasdistError(
                f"horovod: the {what} dataset has {count} batch(es), fewer than the {size} ranks; give "
                "more data or a smaller batch size.")
        if usable < count:
            warnings.warn(f"horovod: dropping the last {count - usable} of {count} batches so that each of "
                          f"the {size} ranks runs {usable // size} steps.", stacklevel=3)
            dataset = dataset.take(usable)
    return dataset.shard(size, rank)


def shard_arrays(arrays, batch_size, rank, size, what="fit"):
    """Rank ``rank``'s whole batches of in-memory data (numpy/tensors, nested), or None if not arrays.

    Batch ``k`` of the global data goes to rank ``k % size``, so the ranks' ``k``-th steps
    together cover ``size`` consecutive batches: one step of single-process training on a
    ``size`` times larger batch.
    """
    import keras
    import numpy as np

    leaves = [a for a in keras.tree.flatten(arrays) if a is not None]
    if not leaves or not all(hasattr(a, "shape") and len(a.shape) > 0 for a in leaves):
        return None
    count = int(leaves[0].shape[0])
    batches = math.ceil(count / batch_size)
    usable = batches // size * size
    if usable == 0:
        raise kerasdist.KerasdistError(
            f"horovod: {what} got {count} samples, {batches} batch(es) of batch_size={batch_size}, fewer than "
            f"the {size} ranks; give more data or a smaller batch_size (it is per rank).")
    if usable < batches:
        warnings.warn(f"horovod: dropping {count - min(count, usable * batch_size)} of {count} {what} samples "
                      f"so that each of the {size} ranks runs {usable // size} steps.", stacklevel=3)
    starts = np.arange(rank, usable, size) * batch_size
    index = np.concatenate([np.arange(s, min(s + batch_size, count)) for s in starts])

    def take(a):
        if a is None:
            return None
        if isinstance(a, np.ndarray):
            return a[index]
        import tensorflow as tf

        return tf.gather(a, index)

    return keras.tree.map_structure(take, arrays)


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, spec):
    if not isinstance(spec, Horovod):
        return
    import horovod.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    callbacks = call_kwargs["callbacks"]
    if rank != 0:
        call_kwargs["verbose"] = 0
        callbacks[:] = [c for c in callbacks if not _chief_only(c)]
    if size == 1:
        return
    if spec.shard and method in ("fit", "evaluate"):
        _shard_call_data(call_kwargs, rank, size, method)
    if spec.average_metrics and method == "fit":
        callbacks.insert(0, MetricAverageCallback())
    if method == "fit":
        if spec.warmup_epochs and not any(isinstance(c, LearningRateWarmupCallback) for c in callbacks):
            target = getattr(model.optimizer.__dict__.get("_kerasdist_horovod"), "warmup_target_lr", None)
            callbacks.insert(1, LearningRateWarmupCallback(initial_lr=target, warmup_epochs=spec.warmup_epochs))
        callbacks.append(BroadcastStateCallback())  # last: after any callback that loads state on rank 0


@kerasdist.hookimpl
def kerasdist_run_call(method, call, call_kwargs, model, spec):
    """``evaluate``: return the results averaged across ranks (Keras hands callbacks a copy)."""
    if not isinstance(spec, Horovod) or method != "evaluate" or not spec.average_metrics:
        return None
    import horovod.tensorflow as hvd

    if hvd.size() == 1:
        return None
    from kerasdist import _keras_internals as internals

    return_dict = call_kwargs.pop("return_dict", False)
    logs = call(**call_kwargs, return_dict=True)
    average_logs(logs)
    return logs if return_dict else internals.flatten_metrics_in_order(model, logs)


def _chief_only(callback):
    return any(cls.__name__ in _CHIEF_ONLY_CALLBACKS and cls.__module__.startswith("keras")
               for cls in type(callback).__mro__)


def _shard_call_data(call_kwargs, rank, size, method):
    batch_size = call_kwargs.get("batch_size") or 32
    x = call_kwargs.get("x")
    if x is not None and not _is_dataset(x):
        data = {k: call_kwargs.get(k) for k in ("x", "y", "sample_weight")}
        sharded = shard_arrays(data, batch_size, rank, size, method)
        if sharded is None:
            warnings.warn(f"horovod: {method} input of type {type(x).__name__} is not sharded, so every rank "
                          "sees all of it: shard it by horovod.tensorflow.rank() yourself, or pass numpy "
                          "arrays or a tf.data.Dataset.", stacklevel=4)
        else:
            call_kwargs.update({k: v for k, v in sharded.items() if k in call_kwargs or v is not None})
    validation = call_kwargs.get("validation_data") if method == "fit" else None
    if validation is not None:
        if _is_dataset(validation):
            call_kwargs["validation_data"] = shard_dataset(validation, rank, size, "validation")
        else:
            sharded = shard_arrays(tuple(validation), call_kwargs.get("validation_batch_size") or batch_size,
                                   rank, size, "validation")
            if sharded is not None:
                call_kwargs["validation_data"] = sharded


def _is_dataset(value):
    import tensorflow as tf

    return isinstance(value, tf.data.Dataset)


def _callback_base():
    import keras

    return keras.callbacks.Callback


def model_signature(model):
    """Shapes and dtypes of the weights and optimizer variables, in order (names differ across ranks)."""
    optimizer = getattr(model, "optimizer", None)
    return {"weights": [(tuple(v.shape), str(v.dtype)) for v in model.weights],
            "optimizer": [(tuple(v.shape), str(v.dtype)) for v in (optimizer.variables if optimizer else [])]}


def check_same_on_all_ranks(hvd, model, steps):
    """Raise on every rank (no rank waits forever) if the model or steps per epoch differ."""
    mine = dict(model_signature(model), steps=steps)
    everyone = hvd.allgather_object(mine, name="kerasdist_model_check")
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        first = everyone[0]
        if theirs["weights"] != first["weights"] or theirs["optimizer"] != first["optimizer"]:
            raise kerasdist.KerasdistError(
                f"distribute='horovod': the model differs across ranks: rank {rank} has "
                f"{len(theirs['weights'])} weights of shapes {[s for s, _ in theirs['weights']]} and "
                f"{len(theirs['optimizer'])} optimizer variables, rank 0 has {len(first['weights'])} weights "
                f"of shapes {[s for s, _ in first['weights']]} and {len(first['optimizer'])} optimizer "
                "variables. Every rank must build the same model and optimizer before fit().")
        raise kerasdist.KerasdistError(
            f"distribute='horovod': rank {rank} would run {theirs['steps']} steps per epoch but rank 0 "
            f"runs {first['steps']}; pass the same steps_per_epoch= on every rank, or give every rank the "
            "same number of batches.")


def broadcast_state(hvd, model, root_rank=0):
    """Copy rank ``root_rank``'s weights and optimizer state (built, maybe trained) to every rank."""
    variables, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    for v in list(model.weights) + list(optimizer.variables if optimizer else []):
        if id(v) not in seen:
            seen.add(id(v))
            variables.append(v.value)
    hvd.broadcast_variables(variables, root_rank=root_rank)


class BroadcastStateCallback(_callback_base()):
    """At the start of fit: same model everywhere (checked), then rank 0's state on every rank."""

    def on_train_begin(self, logs=None):
        import horovod.tensorflow as hvd

        check_same_on_all_ranks(hvd, self.model, (self.params or {}).get("steps"))
        broadcast_state(hvd, self.model)


class MetricAverageCallback(_callback_base()):
    """Average epoch logs (validation included) across ranks, before other callbacks see them."""

    def on_epoch_end(self, epoch, logs=None):
        average_logs(logs)


def average_logs(logs):
    """Replace each number in ``logs`` by its mean over the ranks (one all-reduce)."""
    if not logs:
        return
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    keys = sorted(k for k, v in logs.items() if isinstance(v, (numbers.Number, np.number, np.ndarray))
                  and np.ndim(v) == 0)
    if not keys or hvd.size() == 1:
        return
    values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
    averaged = hvd.allreduce(values, op=hvd.Average, name="kerasdist_metric_average").numpy()
    for key, value in zip(keys, averaged):
        logs[key] = float(value)


class LearningRateWarmupCallback(_callback_base()):
    """Horovod's learning-rate warm-up for Keras 3: from ``initial_lr / size`` to ``initial_lr``.

    The rate at epoch ``e`` (fractional, per batch) is
    ``initial_lr / size * (e * (size - 1) / warmup_epochs + 1)``, reaching ``initial_lr`` at
    the end of ``warmup_epochs`` (``e`` counts the batch in progress as done, as Horovod's).
    Momentum correction is not done: Keras 3 optimizers fix momentum when the step is traced.

    :param initial_lr: the rate after warm-up; default: the optimizer's rate when fit starts.
    :param size: number of ranks; default: ``horovod.tensorflow.size()``.
    """

    def __init__(self, initial_lr=None, warmup_epochs=5, steps_per_epoch=None, size=None, verbose=0):
        super().__init__()
        self.initial_lr, self.warmup_epochs = initial_lr, warmup_epochs
        self.steps_per_epoch, self.size, self.verbose = steps_per_epoch, size, verbose
        self.epoch = 0

    def on_train_begin(self, logs=None):
        if self.size is None:
            import horovod.tensorflow as hvd

            self.size = hvd.size()
        if self.initial_lr is None:
            self.initial_lr = float(self.model.optimizer.learning_rate.numpy())
        self.steps_per_epoch = self.steps_per_epoch or (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise kerasdist.KerasdistError(
                "horovod: the learning-rate warm-up needs the number of steps per epoch, which is unknown "
                "for this data; pass steps_per_epoch= to fit().")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch >= self.warmup_epochs:
            return
        self.model.optimizer.learning_rate = self.rate(self.epoch + batch / self.steps_per_epoch)

    def rate(self, epoch):
        epoch += 1.0 / self.steps_per_epoch
        return self.initial_lr / self.size * (epoch * (self.size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch, logs=None):
        if epoch < self.warmup_epochs and self.verbose and logs is not None:
            print(f"Epoch {epoch + 1}: learning rate warm-up to {float(self.model.optimizer.learning_rate.numpy()):g}")


# -- elastic training (horovodrun --min-np/--max-np) ----------------------------------

def run_elastic(model, *args, state=None, **fit_kwargs):
    """``model.fit(*args, **fit_kwargs)`` under ``hvd.elastic.run``: survives workers leaving and joining.

    Launch with ``horovodrun --min-np M --max-np N --host-discovery-script S python train.py``.
    The model (compiled with ``distribute="horovod"``, built) and its optimizer state plus the epoch
    are committed at the end of every epoch. When the world changes, every worker goes back to the
    last commit (a worker that failed) or stays at it (hosts added or removed between epochs), Horovod
    re-forms the ring, rank 0's committed state is broadcast to every worker (new ones included), and
    ``fit`` continues from the committed epoch, with the data re-sharded for the new size. Returns the
    ``History`` of the last ``fit`` attempt (its epochs since the last reset).

    :param state: a :class:`KerasElasticState` (default: a new one at ``initial_epoch``); pass your own
        to sync extra values (``KerasElasticState(model, my_counter=0)``) or to register reset callbacks.
    """
    reducer = getattr(getattr(model, "optimizer", None), "__dict__", {}).get("_kerasdist_horovod")
    if reducer is None:
        raise kerasdist.KerasdistError(
            "horovod run_elastic: compile the model with distribute='horovod' first.")
    if reducer.passes > 1:
        raise kerasdist.KerasdistError(
            "horovod run_elastic: backward_passes_per_step > 1 is not supported with elastic training "
            "(partly accumulated gradients are not part of the committed state); use 1.")
    if not model.built:
        raise kerasdist.KerasdistError(
            "horovod run_elastic: the model must be built before training starts (every worker, new ones "
            "included, receives rank 0's weights before fit): give it a keras.Input or call model.build().")
    if state is None:
        state = KerasElasticState(model, epoch=fit_kwargs.get("initial_epoch", 0))
    fit_kwargs.pop("initial_epoch", None)
    user_callbacks = list(fit_kwargs.pop("callbacks", None) or [])

    def train(state):
        commit = CommitStateCallback(state)
        return model.fit(*args, initial_epoch=state.epoch, callbacks=user_callbacks + [commit], **fit_kwargs)

    return elastic_run(train)(state)


def elastic_run(func):
    """``hvd.elastic.run`` for Keras 3: also turns Horovod op errors raised inside ``fit`` (grouped
    all-reduce, object broadcast/all-gather) into ``HorovodInternalError``, so the job recovers."""
    import tensorflow as tf
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError

    hvd = _import_horovod()

    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except (tf.errors.UnknownError, tf.errors.AbortedError, tf.errors.InternalError,
                tf.errors.FailedPreconditionError) as exc:
            if "horovod" in str(exc).lower():
                lines = [line for line in str(exc).splitlines() if "orovod" in line] or [""]
                log.warning("horovod elastic: a collective failed (%s: %s); going back to the last "
                            "commit", type(exc).__name__, lines[0].strip()[:300])
                raise HorovodInternalError(exc) from exc
            raise

    def reset():
        hvd.shutdown()
        hvd.init()

    return run_fn(wrapper, reset)


_elastic_state_class = None


def KerasElasticState(model, epoch=0, **kwargs):  # noqa: N802  (makes the class on first use)
    """Horovod elastic state of a Keras 3 model: weights, optimizer variables, ``epoch`` (+ kwargs).

    ``horovod.tensorflow.elastic.TensorFlowKerasState`` is Keras-2 code (``optimizer.variables()``,
    Keras variables broadcast directly); this one works on the Keras 3 variables' backing
    ``tf.Variable``s. ``commit()`` copies them to host memory, ``restore()`` assigns them back,
    ``sync()`` broadcasts rank 0's. After a reset the train function is re-traced for the new world
    size, and a learning rate scaled by ``scale_learning_rate=True`` is re-scaled.
    Extra keyword arguments are synced too and read back as attributes (``state.my_counter``).
    """
    return elastic_state_class()(model, epoch=epoch, **kwargs)


def elastic_state_class():
    """The :func:`KerasElasticState` class (a ``horovod.common.elastic.ObjectState``)."""
    global _elastic_state_class
    if _elastic_state_class is None:
        _import_horovod()
        from horovod.common.elastic import ObjectState

        class _KerasElasticState(ObjectState):
            __doc__ = KerasElasticState.__doc__

            def __init__(self, model, epoch=0, **kwargs):
                import horovod.tensorflow as hvd

                self.model = model
                self._size = hvd.size()
                self._values = []
                super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, epoch=epoch, **kwargs)

            def _variables(self):
                optimizer = self.model.optimizer
                if not optimizer.built:
                    optimizer.build(self.model.trainable_variables)
                variables, seen = [], set()
                for v in list(self.model.weights) + list(optimizer.variables):
                    if id(v) not in seen:
                        seen.add(id(v))
                        variables.append(v.value)
                return variables

            def save(self):
                self._values = [v.numpy() for v in self._variables()]
                super().save()

            def restore(self):
                for variable, value in zip(self._variables(), self._values):
                    variable.assign(value)
                super().restore()

            def sync(self):
                import horovod.tensorflow as hvd

                hvd.broadcast_variables(self._variables(), root_rank=0)
                self._values = [v.numpy() for v in self._variables()]
                super().sync()

            def reset(self):
                import horovod.tensorflow as hvd

                size = hvd.size()
                reducer = self.model.optimizer.__dict__.get("_kerasdist_horovod")
                if reducer is not None and getattr(reducer, "lr_scaled", False) and size != self._size:
                    lr = self.model.optimizer.learning_rate
                    self.model.optimizer.learning_rate = float(lr.numpy()) * size / self._size
                self._size = size
                # The all-reduce in the train step is traced for a world size (none at all for one worker).
                self.model.make_train_function(force=True)

        _KerasElasticState.__name__ = _KerasElasticState.__qualname__ = "KerasElasticState"
        _elastic_state_class = _KerasElasticState
    return _elastic_state_class


class CommitStateCallback(_callback_base()):
    """Commit a :class:`KerasElasticState` at the end of every ``every``-th epoch (and check for host
    changes, which raises Horovod's ``HostsUpdatedInterrupt`` on every worker at the same epoch)."""

    def __init__(self, state, every=1):
        super().__init__()
        self.state, self.every = state, every

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every == 0:
            self.state.epoch = epoch + 1
            self.state.commit()
