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
        from kerasdist.plugin_tools import mirrored_replicas_as_one_device

        mirrored_replicas_as_one_device(compile_kwargs, model, strategy, "mirrored", spec.sync_batch_norm)


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


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, spec):
    """A keras.utils.PyDataset is read in one process's batch order (or refused where it cannot be)."""
    if _as_mirrored(spec) is not None:
        from kerasdist.plugin_tools import read_py_datasets_in_one_processs_order

        read_py_datasets_in_one_processs_order(method, call_kwargs, "mirrored")
