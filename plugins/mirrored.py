"""distribute="mirrored": synchronous data parallelism over the local devices."""

import dataclasses
from typing import Optional, Sequence

import kerasdist


@dataclasses.dataclass
class Mirrored(kerasdist.StrategySpec):
    """``tf.distribute.MirroredStrategy`` over ``devices`` (default: all GPUs, else all logical CPUs).

    :param devices: device names such as ``["/gpu:0", "/gpu:1"]``.
    :param cross_device_ops: "auto", "nccl", "hierarchical_copy" or "reduce_to_one".
    :param sync_batch_norm: BatchNormalization layers use the statistics of the whole global batch
        (one all-reduce of mean and variance per layer and step), as on one device; off by default:
        each replica then normalizes with its own share of the batch.
    """

    devices: Optional[Sequence[str]] = None
    cross_device_ops: str = "auto"
    sync_batch_norm: bool = False

    def __post_init__(self):
        from kerasdist.plugin_tools import check_device_names

        check_device_names(self.devices, "mirrored: devices")

    def identity(self):
        """Equal when the devices are: ``"mirrored"`` and ``mirrored(devices=[every local device])``
        share one strategy."""
        from kerasdist.plugin_tools import canonical_devices, local_replica_devices

        devices = canonical_devices(self.devices or local_replica_devices())
        if self.devices and len(devices) != len(self.devices):  # checked here: equal specs share a cached strategy
            raise kerasdist.KerasdistError(f"mirrored: devices={list(self.devices)} names a device twice; list each "
                                           "device once.")
        return (devices, self.cross_device_ops)



_CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")


@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("mirrored", Mirrored, aliases=("mirror",),
             description="Synchronous data parallelism on this machine's GPUs or logical CPUs "
                         "(tf.distribute.MirroredStrategy).")


@kerasdist.hookimpl(trylast=True)
def kerasdist_auto_strategy(cluster):
    return "mirrored"


@kerasdist.hookimpl
def kerasdist_create_strategy(spec):
    if not isinstance(spec, Mirrored):
        return None
    import tensorflow as tf

    from kerasdist.plugin_tools import canonical_devices, check_devices_exist, local_replica_devices

    if spec.cross_device_ops not in _CROSS_DEVICE_OPS:
        raise kerasdist.KerasdistError(
            f"mirrored: cross_device_ops={spec.cross_device_ops!r} is not valid; choose one of "
            f"{', '.join(_CROSS_DEVICE_OPS)}.")
    devices = list(spec.devices) if spec.devices else local_replica_devices()
    check_devices_exist(devices, plugin="mirrored")
    if spec.cross_device_ops == "nccl" and not any("GPU" in name for name in canonical_devices(devices)):
        raise kerasdist.KerasdistError(f"mirrored: cross_device_ops='nccl' needs GPUs, but the devices are "
                                       f"{list(canonical_devices(devices))}; use 'auto' (or 'reduce_to_one').")
    ops = {
        "auto": None,
        "nccl": lambda: tf.distribute.NcclAllReduce(),
        "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(),
        "reduce_to_one": lambda: tf.distribute.ReductionToOneDevice(),
    }[spec.cross_device_ops]
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops() if ops else None)


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    """Uneven global batches and gradient accumulation train as on one device."""
    spec = _as_mirrored(spec)
    if spec is not None:
        from kerasdist.plugin_tools import custom_steps_train_as_one_device, replicas_train_as_one_device

        _no_xla_on_cpu_replicas(compile_kwargs, strategy)
        replicas_train_as_one_device(compile_kwargs, model, strategy, spec.sync_batch_norm)
        custom_steps_train_as_one_device(model, compile_kwargs, "mirrored")
        _predict_on_empty_replicas(model)
        _evaluate_on_empty_replicas(model)


def _as_mirrored(spec):
    """``spec``, or for a user's own ``tf.distribute.MirroredStrategy`` passed as ``distribute=`` the word over its
    devices: it trains as ``"mirrored"`` does (before, an uneven last batch trained 3.6e-3 off one device)."""
    import sys

    tf = sys.modules.get("tensorflow")
    if isinstance(spec, Mirrored):
        return spec
    if tf is not None and type(getattr(spec, "strategy", None)) is tf.distribute.MirroredStrategy:
        return Mirrored()
    return None


def _no_xla_on_cpu_replicas(compile_kwargs, strategy):
    """XLA compiles every replica's step for the first CPU, which cannot reach the other CPU replicas' variables
    (TensorFlow's raw "resource .../replica_1 located in device CPU:1 from device CPU:0" at the first step, stock
    MirroredStrategy too): jit_compile=True is refused here, "auto" (Keras's default) resolves to no XLA."""
    cpus = [d for d in strategy.extended.worker_devices if "CPU" in d.upper()]
    if len(cpus) < 2:
        return
    jit_compile = compile_kwargs.get("jit_compile", "auto")
    if jit_compile is True:
        raise kerasdist.KerasdistError(
            f"distribute='mirrored' on CPU replicas cannot train with jit_compile=True: TensorFlow's XLA compiles "
            f"every replica's step for the first CPU, which cannot reach the other replicas' variables ({cpus}). "
            "Pass jit_compile=False or 'auto' (Keras's default, no XLA on CPUs), or use "
            "distribute=\"central_storage\" (its variables live on one device: XLA trains there).")
    if jit_compile == "auto":
        compile_kwargs["jit_compile"] = False


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, spec):
    """A keras.utils.PyDataset is read in one process's batch order (or refused where it cannot be)."""
    if _as_mirrored(spec) is not None:
        from kerasdist.plugin_tools import read_py_datasets_in_one_processs_order

        read_py_datasets_in_one_processs_order(method, call_kwargs, "mirrored")


def _predict_on_empty_replicas(model):
    """A replica given no rows (``predict`` on fewer rows than replicas) predicts one row of zeros and returns none
    of it: TensorFlow's oneDNN convolution gives an empty batch the input's shape, so the next layer fails
    ("Incompatible shapes: [32] vs. [0,64,64,3]", stock MirroredStrategy too; fine with TF_ENABLE_ONEDNN_OPTS=0).
    Rows never mix in inference, so the others' outputs are one device's. Inputs other than dense tensors go to
    the model's own step; a model with its own ``predict_step`` keeps it (its outputs need not be rows). Idempotent."""
    import keras
    import tensorflow as tf

    step = model.predict_step
    if (getattr(step, "_kerasdist_empty_replicas", False) or "predict_step" in vars(model)
            or type(model).predict_step is not keras.Model.predict_step):
        return

    def at_least_one_row(tensor, rows):
        one_row = tf.zeros(tf.concat([[1], tf.shape(tensor)[1:]], 0), tensor.dtype)
        padded = tf.cond(rows > 0, lambda: tensor, lambda: one_row)
        padded.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
        return padded

    def predict_step(data):
        leaves = [leaf for leaf in keras.tree.flatten(data) if leaf is not None]
        if (not leaves or not all(isinstance(leaf, tf.Tensor) and leaf.shape.rank for leaf in leaves)
                or tf.distribute.get_replica_context() is None):
            return step(data)
        rows = tf.shape(leaves[0])[0]
        outputs = step(keras.tree.map_structure(lambda t: t if t is None else at_least_one_row(t, rows), data))
        return keras.tree.map_structure(  # only the replica given no rows drops its row of zeros
            lambda t: tf.cond(rows > 0, lambda: t, lambda: t[:0]) if isinstance(t, tf.Tensor) and t.shape.rank else t,
            outputs)

    predict_step._kerasdist_empty_replicas = True
    model.predict_step = predict_step


def _evaluate_on_empty_replicas(model):
    """A replica given no rows skips Keras's own ``test_step`` (the convolution of
    :func:`_predict_on_empty_replicas`) and returns its metrics unchanged, as the step on no rows would. A model
    with its own ``test_step`` or ``compute_metrics`` keeps it. Idempotent."""
    import keras
    import tensorflow as tf

    step = model.test_step
    own = vars(model)
    if (getattr(step, "_kerasdist_empty_replicas", False) or "test_step" in own or "compute_metrics" in own
            or type(model).test_step is not keras.Model.test_step
            or type(model).compute_metrics is not keras.Model.compute_metrics):
        return

    def test_step(data):
        leaves = [leaf for leaf in keras.tree.flatten(data) if leaf is not None]
        if (not leaves or not all(isinstance(leaf, tf.Tensor) and leaf.shape.rank for leaf in leaves)
                or tf.distribute.get_replica_context() is None):
            return step(data)
        return tf.cond(tf.shape(leaves[0])[0] > 0, lambda: step(data), model.get_metrics_result)

    test_step._kerasdist_empty_replicas = True
    model.test_step = test_step
