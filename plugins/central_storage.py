"""distribute="central_storage": variables on one device, computation mirrored on the local devices."""

import dataclasses
from typing import Optional, Sequence

import kerasdist


@dataclasses.dataclass
class CentralStorage(kerasdist.StrategySpec):
    """``tf.distribute.experimental.CentralStorageStrategy``.

    Trains as ``mirrored`` does, mixed precision and BatchNormalization included: a variable Keras writes
    from inside the replicas without an aggregation (moving statistics, the loss scale) takes the first
    replica's value, the value a MirroredStrategy's primary copy holds (with ``sync_batch_norm=True`` the
    replicas' values are equal, and equal one device's).

    :param compute_devices: replica devices (default: all GPUs, else all logical CPUs).
    :param parameter_device: where variables live (default: the CPU).
    :param sync_batch_norm: BatchNormalization layers use the statistics of the whole global batch
        (one all-reduce of mean and variance per layer and step), as on one device; off by default:
        each replica then normalizes with its own share of the batch, and the moving statistics are
        the first replica's.
    """

    compute_devices: Optional[Sequence[str]] = None
    parameter_device: Optional[str] = None
    sync_batch_norm: bool = False

    def __post_init__(self):
        from kerasdist.plugin_tools import check_device_names

        check_device_names(self.compute_devices, "central_storage: compute_devices")

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

    from kerasdist.plugin_tools import assign_state_from_first_replica, check_devices_exist, local_replica_devices

    devices = list(spec.compute_devices) if spec.compute_devices else local_replica_devices()
    check_devices_exist(devices + ([spec.parameter_device] if spec.parameter_device else []),
                        plugin="central_storage")
    strategy = tf.distribute.experimental.CentralStorageStrategy(devices, parameter_device=spec.parameter_device)
    assign_state_from_first_replica(strategy)
    return strategy


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    """Uneven global batches, gradient accumulation, synchronized batch statistics and an optimizer's own weight decay
    (Muon's) and state (Nadam's) train as on one device."""
    if isinstance(spec, CentralStorage):
        from kerasdist.plugin_tools import (assign_own_state_outside_replicas, custom_steps_train_as_one_device,
                                            decay_weights_outside_replicas, output_losses_weighted_by_share,
                                            replicas_train_as_one_device)

        replicas_train_as_one_device(compile_kwargs, model, strategy, spec.sync_batch_norm)
        decay_weights_outside_replicas(compile_kwargs["optimizer"])
        assign_own_state_outside_replicas(compile_kwargs["optimizer"])
        custom_steps_train_as_one_device(model, compile_kwargs, "central_storage")
        output_losses_weighted_by_share(model)


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, spec):
    """A keras.utils.PyDataset is read in one process's batch order (or refused where it cannot be)."""
    if isinstance(spec, CentralStorage):
        from kerasdist.plugin_tools import read_py_datasets_in_one_processs_order

        read_py_datasets_in_one_processs_order(method, call_kwargs, "central_storage")
