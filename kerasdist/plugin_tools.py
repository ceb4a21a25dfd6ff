"""The toolkit for plugins: the public API a plugin may use besides the hooks and ``kerasdist.*``.

Built-in plugins use nothing else, so a third-party plugin can do everything they do.

Stability: everything listed in ``__all__`` is public. A change to a name or signature is announced
one minor release ahead with a ``DeprecationWarning``. Functions that adapt Keras/TensorFlow
internals (the second group) are re-checked for every Keras release kerasdist supports
(``kerasdist.plugin_tools.CHECKED_KERAS_VERSIONS``); their behaviour, not their implementation, is
the contract.
"""

import math
import numbers
import socket

from ._keras_internals import (CHECKED_KERAS_VERSIONS, keras_shuffles_by_epoch, accumulate_across_replicas, all_layers,
                               assign_own_state_outside_replicas, assign_state_from_first_replica, bind_model,
                               decay_weights_outside_replicas,
                               disable_per_channel_quantization,
                               update_loss_scale_once_per_step, clip_summed_gradients,
                               set_batch_share_weighting, synchronize_batch_norm, bound_strategy, configure_coordination,
                               flatten_metrics_in_order, install_multiworker_fit_fixes,
                               is_multiworker_strategy, tf_global_seed,
                               lay_out_variables, make_chief_aware_backup,
                               move_to_strategy, parameter_server_strategy, refresh_call_signature,
                               route_gradient_all_reduce, state_unlocked,
                               set_log_summer, symbolic_build, tf_context_initialized, unbound_from_strategy,
                               variable_layout, weight_replicas_by_batch_share)
from . import process_state
from .batch_split import (arrays_as_dataset, as_arrays, in_shared_order, input_kind, is_dataset,
                          seed_shuffling_samplers, split_batches, split_validation)
import kerasdist.private_backups as private_backups  # not "from . import": kerasdist.__getattr__ looks up plugins
from ._keras_internals.torch import (compiled_metrics, keep_keras_from_wrapping_ddp, keras_wraps_ddp,
                                     local_metrics_result, synchronize_torch_batch_norm)
from ._keras_internals.training import keras_step_order_is_known, mean_state
from ._keras_internals.training import place_batches_by
from ._keras_internals.torch_sharding import implicitly_replicated, replace_variable_tensor, variable_tensor
from .backend import keras_backend
from .cluster import slurm_step_tasks
from .devices import canonical_devices, check_device_names, check_devices_exist, local_replica_devices
from .errors import ClusterConfigError, KerasdistError, did_you_mean
from .process_group import gather_across_processes, process_group_size, set_process_group
from .agreement import check_agreement
from .chief_writes import redirect_writes, restore_writes, writes_files
from .replicas_in_one_process import mirrored_replicas_as_one_device, replicas_train_as_one_device
from .same_state import (data_loader_draws_alike, digest_pieces, int_pieces, python_random_same_everywhere,
                         same_everywhere, sum_by_all_gather)
from .step_checks import note_applied, start_first_step_check, unsummed_after_first_step, unsummed_updates_error
from .variables import optimizers_held_by, unique_variables

__all__ = [
    # values and the environment
    "check_number", "check_choice", "number_from_env", "split_address", "port_is_free", "unreachable",
    "slurm_step_tasks",
    "is_dataset", "arrays_as_dataset", "as_arrays", "split_batches", "split_validation", "seed_shuffling_samplers",
    "input_kind", "unique_variables", "local_replica_devices",
    # do all ranks hold the same random state? (one process's shuffle order)
    "digest_pieces", "int_pieces", "same_everywhere", "python_random_same_everywhere", "sum_by_all_gather",
    "data_loader_draws_alike",
    # do the ranks start the same fit/evaluate? (one fingerprint per call and epoch, one tiny collective)
    "check_agreement",
    # which callbacks write files (Keras's, KerasTuner's): the chief writes, the others drop or redirect them
    "writes_files", "redirect_writes", "restore_writes",
    "in_shared_order", "keras_shuffles_by_epoch",
    "check_devices_exist", "check_device_names", "canonical_devices", "keras_backend",
    # process-wide state (one home, one reset): process_state.slot / on_reset / reset
    "process_state",
    # processes training as one model without a strategy between them (multiworker's strategy-free step)
    "set_process_group", "process_group_size", "gather_across_processes",
    # Keras / TensorFlow adapters
    "CHECKED_KERAS_VERSIONS", "move_to_strategy", "bound_strategy", "bind_model", "unbound_from_strategy",
    "install_multiworker_fit_fixes", "is_multiworker_strategy", "route_gradient_all_reduce", "tf_global_seed",
    "set_log_summer", "tf_context_initialized", "configure_coordination", "make_chief_aware_backup",
    "parameter_server_strategy", "symbolic_build",
    "flatten_metrics_in_order", "lay_out_variables", "variable_layout", "weight_replicas_by_batch_share",
    "place_batches_by",
    "accumulate_across_replicas", "synchronize_batch_norm", "set_batch_share_weighting", "may_split_unevenly", "all_layers", "first_array",
    "layers_by_name",
    "refresh_call_signature", "state_unlocked", "disable_per_channel_quantization",
    "assign_state_from_first_replica", "decay_weights_outside_replicas", "assign_own_state_outside_replicas", "update_loss_scale_once_per_step",
    "replicas_train_as_one_device",
    "mirrored_replicas_as_one_device", "read_py_datasets_in_one_processs_order",
    # the PyTorch backend
    "keras_wraps_ddp", "keep_keras_from_wrapping_ddp", "local_metrics_result", "keras_step_order_is_known",
    "mean_state", "compiled_metrics", "synchronize_torch_batch_norm",
    "replace_variable_tensor",
    "implicitly_replicated", "variable_tensor",
    # custom training steps (any backend)
    "optimizers_held_by",
    "start_first_step_check", "note_applied", "unsummed_after_first_step", "unsummed_updates_error",
    # kerasdist's private, identity-checked BackupAndRestore backups: private_backups.add_backup(call_kwargs, spec,
    # model, strategy, fit_index, chief, scratch) (spec.backup_dir; strategy.num_replicas_in_sync)
    "private_backups",
]


# -- values and the environment ---------------------------------------------------------------

def check_number(value, name, where, *, minimum=None, maximum=None, integer=False, allow_none=False,
                 inclusive_minimum=True, error=KerasdistError):
    """Return ``value`` as a Python int/float if it is a finite number in range, else raise ``error``.

    NumPy scalars are accepted; bools, strings, NaN and infinities are not. The message names
    ``where`` (e.g. ``"multiworker"``), the option, the value and what is valid.
    """
    if value is None and allow_none:
        return None
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok and minimum is not None:
        ok = value >= minimum if inclusive_minimum else value > minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        what = "a whole number" if integer else "a number"
        bounds = []
        if minimum is not None:
            bounds.append(f"{'>=' if inclusive_minimum else '>'} {minimum:g}")
        if maximum is not None:
            bounds.append(f"<= {maximum:g}")
        suffix = f" {' and '.join(bounds)}" if bounds else ""
        none = " (or None)" if allow_none else ""
        raise error(f"{where}: {name}={value!r} is not valid; give {what}{suffix}{none}.")
    return int(value) if integer else float(value)


def check_choice(value, name, where, choices, *, allow_none=False, error=KerasdistError):
    """Return ``value`` lowercased if it is one of ``choices`` (strings), else raise ``error``."""
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    hint = did_you_mean(value, choices) if isinstance(value, str) else ""
    raise error(f"{where}: {name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}.{hint}")


def number_from_env(environ, name, kind=float, default=None, *, minimum=0, maximum=None):
    """The number in environment variable ``name`` (``default`` when unset or empty), checked like
    :func:`check_number`; a bad value raises :class:`kerasdist.ClusterConfigError` naming the variable."""
    raw = environ.get(name, "")
    if raw is None or not str(raw).strip():
        return default
    try:
        value = kind(str(raw).strip())
    except ValueError:
        value = raw
    bounds = [f">= {minimum:g}"] if minimum is not None else []
    bounds += [f"<= {maximum:g}"] if maximum is not None else []
    what = "a whole number" if kind is int else "a number"
    ok = (isinstance(value, (int, float)) and math.isfinite(value)
          and (minimum is None or value >= minimum) and (maximum is None or value <= maximum))
    if not ok:
        raise ClusterConfigError(f"{name}={raw!r} is not valid: give {what} {' and '.join(bounds)}.".replace(" .", "."))
    return value


def split_address(address, what="address", error=ClusterConfigError):
    """``(host, port)`` of ``"host:port"`` or ``"[v6 host]:port"``; raises ``error`` naming ``what``."""
    text = str(address) if isinstance(address, str) else None
    host, sep, port = (text or "").rpartition(":")
    host = host.strip("[]")
    if text is None or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise error(f"{what} {address!r} is not 'host:port' with a port in 1..65535 (e.g. '10.0.0.2:2222').")
    return host, int(port)


def port_is_free(port, host="0.0.0.0"):
    """Whether a server could bind ``port`` on ``host`` (TensorFlow's gRPC servers bind every
    interface, hence the default)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def unreachable(addresses, timeout=1.0):
    """``{address: reason}`` for each ``"host:port"`` in ``addresses`` that does not accept a TCP connection."""
    down = {}
    for address in addresses:
        try:
            host, port = split_address(address)
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except (OSError, KerasdistError) as exc:
            down[address] = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return down


def may_split_unevenly(call_kwargs, replicas):
    """Whether some global batch of this fit may not split evenly over ``replicas`` (NumPy: known from the
    sizes; a Dataset: unless its batch size is static, divisible, and every batch is full)."""
    x = call_kwargs.get("x")
    if is_dataset(x):
        import tensorflow as tf

        first = next(iter(tf.nest.flatten(x.element_spec)))
        batch = first.shape[0] if first.shape.rank else None
        return batch is None or batch % replicas != 0
    first = first_array(x)
    if not hasattr(first, "shape") or not len(getattr(first, "shape", ())):
        return True
    size, batch = int(first.shape[0]), int(call_kwargs.get("batch_size") or 32)
    return batch % replicas != 0 or (size % batch) % replicas != 0


def layers_by_name(model, names, where):
    """The layers of ``model`` (nested ones too) called ``names``, in that order; a KerasdistError
    (``"{where}: layers=[...] names [...] that the model does not have; its layers are [...]"``) otherwise."""
    by_name = {layer.name: layer for layer in all_layers(model)}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise KerasdistError(f"{where}: layers={list(names)!r} names {unknown} that the model does not have; its "
                             f"layers are {sorted(by_name)}.")
    return [by_name[name] for name in names]


def first_array(value):
    """The first array of an input given as an array or a (nested) dict/list/tuple of arrays."""
    while isinstance(value, (dict, list, tuple)) and value:
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return value


def read_py_datasets_in_one_processs_order(method, call_kwargs, word):
    """Under a strategy of several replicas in one process (MirroredStrategy, CentralStorageStrategy): every
    ``keras.utils.PyDataset`` among ``x`` and ``validation_data`` is read by batch index, its order drawn as one
    process draws it (``_keras_internals/py_dataset_reading.py``): through Keras's shared loader the strategy's
    prefetch raced it (issue 29). Raises one KerasdistError, naming ``word``, where that reading cannot be one
    process's order. A generator's batches (fit's x) are copied: Keras hands them to TensorFlow without a copy,
    and under such a strategy the user's arrays were written in place (targets changed, 0.11 off after 3 epochs).
    Call from ``kerasdist_adjust_call``."""
    import keras

    from ._keras_internals.py_dataset_reading import read_by_index

    inputs = [("x", call_kwargs.get("x"), call_kwargs.get("steps_per_epoch" if method == "fit" else "steps"))]
    if method == "fit":
        inputs.append(("validation_data", call_kwargs.get("validation_data"), call_kwargs.get("validation_steps")))
    for name, value, steps in inputs:
        if name == "validation_data" and input_kind(value) == "generator" and word != "multiworker":
            raise KerasdistError(
                f"distribute={word!r}: fit(validation_data=a generator) cannot be read in one process's order: each "
                "evaluation's prefetching iterator under this strategy may take the generator's batches (val_loss "
                "measured 0.44 off, weights exact). Pass validation_data as arrays, a tf.data.Dataset or a "
                "keras.utils.PyDataset, or use distribute=\"multiworker\".")
        if method == "fit" and name == "x" and input_kind(value) == "generator":
            call_kwargs[name] = _copied_batches(value)  # not validation_data: see docs/equivalence.md
        if not isinstance(value, keras.utils.PyDataset):
            continue
        shuffled = method == "fit" and name == "x" and call_kwargs.get("shuffle", True)
        threaded = value.workers > 1 or (value.workers > 0 and value.use_multiprocessing)
        steps_shuffled = steps is not None and shuffled
        unindexed = not steps_shuffled and not (read_by_index(value) or not threaded)
        if steps_shuffled or unindexed:
            raise KerasdistError(
                f"distribute={word!r}: {method}({name}=a keras.utils.PyDataset"
                + (f" with workers={value.workers}" if threaded else "")
                + (", num_batches=None (infinite)" if unindexed and value.num_batches is None else "")
                + (f", shuffle=True and {'steps_per_epoch' if method == 'fit' else 'steps'}={steps}"
                   if steps_shuffled else "")
                + ") cannot be read in one process's batch order: the strategy's prefetch races Keras's shared "
                "loader. Pass a tf.data pipeline (tf.data.Dataset.range(n).map(...) reading your batches, or "
                "from_tensor_slices), " + ("leave steps_per_epoch out or pass shuffle=False, " if steps_shuffled
                                           else "give the PyDataset workers=1 (read in order, no threads), ")
                + ("or let multiworker train strategy-free (KERASDIST_STRATEGY_FREE unset and sync_batch_norm off; "
                   "exact for PyDatasets)."
                   if word == "multiworker" else "or use distribute=\"multiworker\" (exact for PyDatasets)."))


def _copied_batches(generator):
    import keras
    import numpy as np

    for batch in generator:
        yield keras.tree.map_structure(lambda leaf: np.array(leaf) if isinstance(leaf, np.ndarray) else leaf, batch)

# -- a model's own train_step/test_step under the replicas of one process (mirrored, central_storage) -------------

_CUSTOM_REPLICA_STEPS = ("custom_steps_train_as_one_device", "rows_of", "weighted_scalar_updates",
                         "output_losses_weighted_by_share")


def __getattr__(name):
    """The custom-step helpers import Keras: loaded at first use, so that importing kerasdist never imports Keras."""
    if name in _CUSTOM_REPLICA_STEPS:
        from . import custom_replica_steps

        return getattr(custom_replica_steps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ += list(_CUSTOM_REPLICA_STEPS)
