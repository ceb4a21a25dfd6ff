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

        _refuse_what_fails_in_fit(model)

        weight_replicas_by_batch_share(model, compile_kwargs["optimizer"], strategy)
        accumulate_across_replicas(compile_kwargs["optimizer"], strategy)


def _refuse_what_fails_in_fit(model):
    """What CentralStorageStrategy cannot run in Keras 3.15 fails here, not deep inside fit: variables that
    Keras assigns in replica context without an aggregation (the loss scale of mixed precision, the moving
    statistics of BatchNormalization) are AggregatingVariables there, which refuse such assignments."""
    import keras

    from kerasdist.plugin_tools import all_layers

    policy = keras.mixed_precision.global_policy().name
    if policy.startswith("mixed"):
        raise kerasdist.KerasdistError(
            f"central_storage: the mixed precision policy {policy!r} cannot train under CentralStorageStrategy "
            "(its loss scale is assigned in replica context, which the strategy refuses); use "
            "distribute='mirrored', or the 'float32' policy.")
    norms = sorted({layer.name for layer in all_layers(model) if isinstance(layer, keras.layers.BatchNormalization)})
    if norms:
        raise kerasdist.KerasdistError(
            f"central_storage: BatchNormalization layers {norms} cannot train under CentralStorageStrategy (their "
            "moving statistics are assigned in replica context, which the strategy refuses); use "
            "distribute='mirrored' (with sync_batch_norm=True for whole-batch statistics).")
