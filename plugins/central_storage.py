"""distribute="central_storage": variables on one device, computation mirrored on the local devices."""

import dataclasses
from typing import Optional, Sequence

import kerasdist


@dataclasses.dataclass
class CentralStorage(kerasdist.StrategySpec):
    """``tf.distribute.experimental.CentralStorageStrategy``.

    :param compute_devices: replica devices (default: all GPUs, else all logical CPUs).
    :param parameter_device: where variables live (default: the CPU).
    :param sync_batch_norm: BatchNormalization layers use the statistics of the whole global batch
        (Keras's ``synchronized=True``), so training equals one device's; off, each replica normalizes
        with its own part of the batch and the moving statistics are the first replica's.
    """

    compute_devices: Optional[Sequence[str]] = None
    parameter_device: Optional[str] = None
    sync_batch_norm: bool = False

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

    from kerasdist.plugin_tools import check_devices_exist, first_replica_assigns_unaggregated, local_replica_devices

    devices = list(spec.compute_devices) if spec.compute_devices else local_replica_devices()
    check_devices_exist(devices + ([spec.parameter_device] if spec.parameter_device else []),
                        plugin="central_storage")
    # BatchNormalization's moving statistics are assigned in replica context
    return first_replica_assigns_unaggregated(
        tf.distribute.experimental.CentralStorageStrategy(devices, parameter_device=spec.parameter_device))


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    """Uneven global batches, gradient accumulation and (with sync_batch_norm) batch statistics train as on
    one device."""
    if isinstance(spec, CentralStorage):
        from kerasdist.plugin_tools import accumulate_across_replicas, weight_replicas_by_batch_share

        _loss_scale_for_central_storage(compile_kwargs)
        weight_replicas_by_batch_share(model, compile_kwargs["optimizer"], strategy)
        accumulate_across_replicas(compile_kwargs["optimizer"], strategy)
        if spec.sync_batch_norm:
            from kerasdist.plugin_tools import synchronize_batch_norm

            synchronize_batch_norm(model)


def _loss_scale_for_central_storage(compile_kwargs):
    """Under a mixed_float16 policy Keras wraps the optimizer in a LossScaleOptimizer, whose loss-scale update
    (a cond in replica context) cannot assign this strategy's variables; wrapped here, it updates with
    unconditional assignments instead (the same values)."""
    import keras

    from kerasdist.plugin_tools import loss_scale_updates_without_cond

    if keras.mixed_precision.global_policy().name != "mixed_float16":
        return
    optimizer = compile_kwargs["optimizer"]
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    compile_kwargs["optimizer"] = loss_scale_updates_without_cond(optimizer)
