"""distribute="central_storage": variables on one device, computation mirrored on the local devices."""

import dataclasses
from typing import Optional, Sequence

import kerasdist


@dataclasses.dataclass
class CentralStorage(kerasdist.StrategySpec):
    """``tf.distribute.experimental.CentralStorageStrategy``.

    :param compute_devices: replica devices (default: all GPUs, else all logical CPUs).
    :param parameter_device: where variables live (default: the CPU).
    """

    compute_devices: Optional[Sequence[str]] = None
    parameter_device: Optional[str] = None

    def identity(self):
        """Equal when the devices are (the default devices resolved)."""
        from kerasdist.plugin_tools import canonical_devices, local_replica_devices

        return (canonical_devices(self.compute_devices or local_replica_devices()), self.parameter_device)


@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("central_storage", CentralStorage, aliases=("central-storage", "centralstorage"),
             description="Variables on one device (the CPU by default), computation replicated on the local "
                         "GPUs or logical CPUs; for models whose variables do not fit on every GPU.")


@kerasdist.hookimpl
def kerasdist_create_strategy(spec):
    if not isinstance(spec, CentralStorage):
        return None
    import tensorflow as tf

    from kerasdist.plugin_tools import check_devices_exist, local_replica_devices

    devices = list(spec.compute_devices) if spec.compute_devices else local_replica_devices()
    check_devices_exist(devices + ([spec.parameter_device] if spec.parameter_device else []),
                        plugin="central_storage")
    return tf.distribute.experimental.CentralStorageStrategy(devices, parameter_device=spec.parameter_device)


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    """Uneven global batches and gradient accumulation train as on one device."""
    if isinstance(spec, CentralStorage):
        from kerasdist.plugin_tools import accumulate_across_replicas, weight_replicas_by_batch_share

        weight_replicas_by_batch_share(model, compile_kwargs["optimizer"], strategy)
        accumulate_across_replicas(compile_kwargs["optimizer"], strategy)
