"""The horovod spec, its option checks, and whether Horovod can run here."""

import dataclasses
import glob
import importlib.util
import numbers
import os
from typing import Any

import kerasdist

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
    :param batch_size_per_worker: ``batch_size`` is each rank's batch and whole batches go to the
        ranks in turn (Horovod's semantics: global batch = batch_size x ranks). Default False:
        ``batch_size`` is the global batch, as under every other strategy.
    :param average_metrics: batch and epoch logs and ``evaluate`` results over every rank (metric states summed).
    :param sync_batch_norm: BatchNormalization statistics over the whole global batch (one Horovod
        all-reduce of each layer's sums per step); off by default: each rank normalizes alone.
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
    sync_batch_norm: bool = False
    batch_size_per_worker: bool = False



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


def import_horovod():
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



def check_options(spec):
    """Reject bad option values before anything starts."""
    if op_name(spec.op) not in _OPS:
        raise kerasdist.KerasdistError(f"horovod: op={spec.op!r} is not valid; choose one of {', '.join(_OPS)}.")
    if not (compression_name(spec.compression) in _COMPRESSIONS or is_compressor(spec.compression)):
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
    if factor != 1.0 and op_name(spec.op) != "average":
        raise kerasdist.KerasdistError(
            f"horovod: gradient_predivide_factor={factor!r} needs op='average' (got op={spec.op!r}); "
            "use op='average' or leave gradient_predivide_factor at 1.0.")
    if op_name(spec.op) == "adasum" and spec.average_aggregated_gradients:
        raise kerasdist.KerasdistError(
            "horovod: op='adasum' does not support average_aggregated_gradients=True; set it to False.")
    if spec.batch_size_per_worker and not spec.shard:
        raise kerasdist.KerasdistError(
            "horovod: batch_size_per_worker=True has no meaning with shard=False: kerasdist then leaves each "
            "rank's data and batches as you give them. Drop batch_size_per_worker, or let kerasdist split "
            "the data (shard=True).")
    if not isinstance(spec.warmup_epochs, numbers.Real) or spec.warmup_epochs < 0:
        raise kerasdist.KerasdistError(
            f"horovod: warmup_epochs={spec.warmup_epochs!r} is not valid; give a number >= 0 (0: no warm-up).")


def check_runtime(spec, hvd):
    """Reject settings this Horovod build or world cannot run, before any collective starts."""
    if op_name(spec.op) != "adasum" or hvd.size() == 1:
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


def op_name(op):
    if isinstance(op, str):
        return op.strip().lower()
    names = {}
    try:
        from horovod.tensorflow import Adasum, Average, Sum

        names = {Average: "average", Sum: "sum", Adasum: "adasum"}
    except Exception:
        pass
    return names.get(op, repr(op))


def compression_name(compression):
    return compression.strip().lower() if isinstance(compression, str) else None


def is_compressor(compression):
    return hasattr(compression, "compress") and hasattr(compression, "decompress")
