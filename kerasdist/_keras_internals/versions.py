"""Where each private Keras piece lives, per Keras version (part of kerasdist._keras_internals).

Keras moves its private code between releases: the 3.16 nightlies moved ``backend/tensorflow/core.py``
to ``backend/tensorflow/ops/core.py``, renamed ``TensorFlowTrainer`` to ``Trainer`` and the base
``Trainer`` to ``BaseTrainer``, and replaced the optimizer's weight-decay cache by a per-variable index.
Each private Keras class, function or method the internals import or replace is named in :data:`PIECES`
with where it lives on each Keras line, and looked up here with :func:`locate` / :func:`require`; a
private instance attribute whose name changed is in :data:`INSTANCE_ATTRIBUTES`. (Instance attributes
that kept their name, and TensorFlow's private API, are checked by the behaviour tests.) A piece that the installed Keras lacks is one
:class:`kerasdist.KerasdistError` naming the Keras version and the supported range, raised when a model is
compiled (never at ``import kerasdist``). tests/test_keras_internals.py checks every row.
"""

import importlib
import importlib.metadata
import importlib.util
import os
from typing import NamedTuple

#: Keras releases these internals were read and tested against: a line ("3.15") covers its patch
#: releases; a nightly is named by its exact build.
CHECKED_KERAS_VERSIONS = ("3.15", "3.16.0.dev2026102704")

#: The Keras lines of the tables below, newest first. "3.16.0.dev" is the keras-nightly line.
KERAS_LINES = ("3.16.0.dev", "3.15")

SUPPORTED_KERAS = ("Keras 3.15.x (pip install 'keras>=3.15,<3.16'); the nightly keras-nightly "
                   "3.16.0.dev2026102704 was checked too")


class Piece(NamedTuple):
    what: str  # what kerasdist does with it
    needed_by: str  # "tf" (every tf.distribute strategy), or one strategy / backend
    where: dict  # Keras line -> "module:attribute.path"


def _everywhere(location):
    return {line: location for line in KERAS_LINES}


_TF_TRAINER = "keras.src.backend.tensorflow.trainer"
_TORCH_TRAINER = "keras.src.backend.torch.trainer"
_TRAINER = "keras.src.trainers.trainer"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:TFOptimizer"

PIECES = {
    "tf_trainer_build": Piece(
        "the TensorFlow trainer's first-batch build (fit calls it), replaced for multi-worker fit and "
        "uneven batches", "tf",
        {"3.15": f"{_TF_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",
         "3.16.0.dev": f"{_TF_TRAINER}:Trainer._maybe_symbolic_build"}),
    "tf_reduce_per_replica": Piece(
        "the TensorFlow trainer's log reduction, replaced for multi-worker fit", "multiworker",
        _everywhere(f"{_TF_TRAINER}:reduce_per_replica")),
    "py_dataset_enqueuer_generator": Piece(
        "the generator a threaded PyDataset's batches come from (it stops the enqueuer once read past its last "
        "batch, which a strategy's prefetch does from tf.data's thread): kerasdist never reads past it",
        "tf", _everywhere("keras.src.trainers.data_adapters.py_dataset_adapter:"
                          "PyDatasetAdapter._finite_enqueuer_generator")),
    "py_dataset_tf_dataset": Piece(
        "PyDatasetAdapter.get_tf_dataset: a PyDataset under mirrored/central_storage read by batch index "
        "(py_dataset_reading)", "py_dataset_order",
        _everywhere("keras.src.trainers.data_adapters.py_dataset_adapter:PyDatasetAdapter.get_tf_dataset")),
    "py_dataset_epoch_begin": Piece(
        "PyDatasetAdapter.on_epoch_begin: where that reading draws each epoch's order", "py_dataset_order",
        _everywhere("keras.src.trainers.data_adapters.py_dataset_adapter:PyDatasetAdapter.on_epoch_begin")),
    "trainer_symbolic_build": Piece(
        "Trainer._symbolic_build: builds every variable fit needs from a batch's structure", "tf",
        {"3.15": f"{_TRAINER}:Trainer._symbolic_build", "3.16.0.dev": f"{_TRAINER}:BaseTrainer._symbolic_build"}),
    "trainer_flatten_metrics": Piece(
        "Trainer._flatten_metrics_in_order: evaluate()'s list from its logs (horovod)", "horovod",
        {"3.15": f"{_TRAINER}:Trainer._flatten_metrics_in_order",
         "3.16.0.dev": f"{_TRAINER}:BaseTrainer._flatten_metrics_in_order"}),
    "tf_variable": Piece(
        "the TensorFlow backend's Variable class, whose assign_add/assign_sub central storage patches",
        "central_storage",
        {"3.15": "keras.src.backend.tensorflow.core:Variable",
         "3.16.0.dev": "keras.src.backend.tensorflow.ops.core:Variable"}),
    "tf_variable_initialize": Piece(
        "Variable._initialize: re-creates a variable's tf.Variable under a strategy", "tf",
        {"3.15": "keras.src.backend.tensorflow.core:Variable._initialize",
         "3.16.0.dev": "keras.src.backend.tensorflow.ops.core:Variable._initialize"}),
    "tf_all_reduce_gradients": Piece(
        "TFOptimizer._all_reduce_sum_gradients: routed to another all-reduce", "tf",
        _everywhere(f"{_TF_OPTIMIZER}._all_reduce_sum_gradients")),
    "tf_apply_gradients": Piece(
        "BaseOptimizer._backend_apply_gradients: replaced for gradient accumulation", "tf",
        _everywhere("keras.src.optimizers.base_optimizer:BaseOptimizer._backend_apply_gradients")),
    "tf_update_step": Piece(
        "TFOptimizer._distributed_tf_update_step: the update gradient accumulation runs", "tf",
        _everywhere(f"{_TF_OPTIMIZER}._distributed_tf_update_step")),
    "optimizer_clip_gradients": Piece(
        "BaseOptimizer._clip_gradients: replaced per optimizer to clip the replicas' summed gradient", "tf",
        _everywhere("keras.src.optimizers.base_optimizer:BaseOptimizer._clip_gradients")),
    "optimizer_apply_weight_decay": Piece(
        "BaseOptimizer._apply_weight_decay: an optimizer's own (Muon's) replaced per instance to run in cross-replica "
        "context under CentralStorageStrategy", "central_storage",
        _everywhere("keras.src.optimizers.base_optimizer:BaseOptimizer._apply_weight_decay")),
    "tf_optimizer_apply_weight_decay": Piece(
        "TFOptimizer._apply_weight_decay: the TensorFlow optimizers' weight decay through the strategy, left alone",
        "central_storage", _everywhere(f"{_TF_OPTIMIZER}._apply_weight_decay")),
    "tf_optimizer_backend_update_step": Piece(
        "TFOptimizer._backend_update_step: the TensorFlow optimizers' step (all-reduce, then the update through the "
        "strategy); an optimizer overriding it (Nadam) writes its own state first, in replica context",
        "central_storage", _everywhere(f"{_TF_OPTIMIZER}._backend_update_step")),
    "tf_optimizer_assign": Piece(
        "TFOptimizer.assign: an optimizer's write of its own variables, replaced per instance to write a replica-context "
        "update once, outside the replicas, under CentralStorageStrategy", "central_storage",
        _everywhere(f"{_TF_OPTIMIZER}.assign")),
    "optimizer_var_key": Piece(
        "BaseOptimizer._var_key: how an optimizer indexes its variables (re-indexed after a move)", "tf",
        _everywhere("keras.src.optimizers.base_optimizer:BaseOptimizer._var_key")),
    "loss_scale_handle_finite_grads": Piece(
        "LossScaleOptimizer._stateful_handle_finite_grads: replaced for central storage", "central_storage",
        _everywhere("keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer._stateful_handle_finite_grads")),
    "optimizer_overwrite_with_gradient": Piece(
        "BaseOptimizer._overwrite_variable_with_gradient: variables a loss-scale optimizer does not unscale",
        "central_storage",
        _everywhere("keras.src.optimizers.base_optimizer:BaseOptimizer._overwrite_variable_with_gradient")),
    "layer_flatten_layers": Piece(
        "Layer._flatten_layers: every nested layer", "tf",
        _everywhere("keras.src.layers.layer:Layer._flatten_layers")),
    "batch_norm_moments": Piece(
        "BatchNormalization._moments: replaced to sum statistics across processes (horovod)", "horovod",
        _everywhere("keras.src.layers.normalization.batch_normalization:BatchNormalization._moments")),
    "file_utils_join": Piece(
        "keras.src.utils.file_utils.join: BackupAndRestore's file paths (multi-worker backups)", "multiworker",
        _everywhere("keras.src.utils.file_utils:join")),
    "loss_scale_for_distribution": Piece(
        "losses.loss.scale_loss_for_distribution: a Loss's 1/replicas, skipped inside a moved model's call "
        "(add_loss values are scaled once by the trainer)", "tf",
        _everywhere("keras.src.losses.loss:scale_loss_for_distribution")),
    "loss_unscale_for_distribution": Piece(
        "losses.loss.unscale_loss_for_distribution: the trackers' x replicas, skipped in a custom step whose "
        "losses kerasdist leaves unscaled (custom_replica_steps)", "tf",
        _everywhere("keras.src.losses.loss:unscale_loss_for_distribution")),
    "layer_call_context_attribute": Piece(
        "global_state.get_global_attribute: reads the layer call context ('current_call_ctx', its entry_layer)",
        "tf", _everywhere("keras.src.backend.common.global_state:get_global_attribute")),
    # Looked up when used, never required at compile ("step_order", "torch"): without them kerasdist takes its
    # general path (the step's order unknown; the torch trainer's source not read).
    "tf_train_step": Piece(
        "the TensorFlow trainer's own train_step (whether a model trains with it: the strategy-free step)",
        "step_order",
        {"3.15": f"{_TF_TRAINER}:TensorFlowTrainer.train_step", "3.16.0.dev": f"{_TF_TRAINER}:Trainer.train_step"}),
    "torch_train_step": Piece(
        "the torch trainer's own train_step (whether a model trains with it; its module's source says "
        "whether it wraps models in DistributedDataParallel)", "torch",
        {"3.15": f"{_TORCH_TRAINER}:TorchTrainer.train_step", "3.16.0.dev": f"{_TORCH_TRAINER}:Trainer.train_step"}),
    "torch_ddp_wrapping": Piece(
        "where the torch trainer wraps the model in DistributedDataParallel once torch.distributed is "
        "initialised (3.16: Trainer._initialize_ddp, turned off per model: kerasdist averages the gradients "
        "itself; 3.15 wraps nothing: its make_train_function, never replaced)", "torch",
        {"3.15": f"{_TORCH_TRAINER}:TorchTrainer.make_train_function",
         "3.16.0.dev": f"{_TORCH_TRAINER}:Trainer._initialize_ddp"}),
    "torch_trainer_metrics_result": Piece(
        "the torch trainer's get_metrics_result (3.16: sums every metric state over the ranks, so kerasdist "
        "calls the base trainer's instead; 3.15: the base trainer's)", "torch",
        {"3.15": f"{_TORCH_TRAINER}:TorchTrainer.get_metrics_result",
         "3.16.0.dev": f"{_TORCH_TRAINER}:Trainer.get_metrics_result"}),
    "trainer_metrics_result": Piece(
        "the base trainer's get_metrics_result: this rank's metric results, not summed over the ranks", "torch",
        {"3.15": f"{_TRAINER}:Trainer.get_metrics_result", "3.16.0.dev": f"{_TRAINER}:BaseTrainer.get_metrics_result"}),
    "trainer_compute_metrics": Piece(
        "Trainer.compute_metrics: updates the compiled metrics only (the step order kerasdist relies on)",
        "step_order",
        {"3.15": f"{_TRAINER}:Trainer.compute_metrics", "3.16.0.dev": f"{_TRAINER}:BaseTrainer.compute_metrics"}),
    "array_data_adapter": Piece(
        "ArrayDataAdapter: the tf.data pipeline (and shuffle) Keras's fit makes of arrays, which every multiworker "
        "worker makes to draw one process's permutation", "multiworker",
        _everywhere("keras.src.trainers.data_adapters.array_data_adapter:ArrayDataAdapter")),
    "jax_variable_direct_assign": Piece(
        "the JAX Variable's _direct_assign: places a value by its layout", "jax",
        {"3.15": "keras.src.backend.jax.core:JaxVariable._direct_assign",
         "3.16.0.dev": "keras.src.backend.jax.ops.core:Variable._direct_assign"}),
    "jax_distribute_data_input": Piece(
        "the JAX backend's distribute_data_input: places each batch under a distribution (kerasdist places the "
        "global batch every process reads)", "jax",
        _everywhere("keras.src.backend.jax.distribution_lib:distribute_data_input")),
}

#: Private attributes of instances (set in ``__init__``/``build``), per Keras line: the name to use.
INSTANCE_ATTRIBUTES = {
    # A built optimizer's dict, keyed like _trainable_variables_indices, saying which variables get
    # weight decay: a lazily filled cache in 3.15, an index filled by build() (read unguarded) in 3.16.
    "optimizer_weight_decay_by_key": {"3.15": "_exclude_from_weight_decay_cache",
                                      "3.16.0.dev": "_weight_decay_by_var_key"},
}


def installed_keras_version():
    """The installed Keras's version from its distribution's metadata (``keras`` or ``keras-nightly``),
    without importing it: the one whose files ``import keras`` loads when both are on the path (a nightly
    first on PYTHONPATH beside a venv's keras); None when neither is installed."""
    found = []
    for name in ("keras", "keras-nightly"):
        try:
            found.append(importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    spec = importlib.util.find_spec("keras") if found else None
    origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
    for distribution in found:
        if os.path.realpath(distribution.locate_file("keras/__init__.py")) == origin:
            return distribution.version
    return found[0].version if found else None


def _keras_version():
    import keras

    return keras.__version__


def _on_line(version, line):
    return version == line or version.startswith(line if line.endswith(".dev") else line + ".")


def keras_line(version=None):
    """The line of :data:`KERAS_LINES` that ``version`` (default: the imported Keras's) is on, or None."""
    version = _keras_version() if version is None else version
    return next((line for line in KERAS_LINES if _on_line(version, line)), None)


def keras_shuffles_by_epoch(version=None):
    """Whether Keras draws each epoch's shuffle from the epoch's number alone (3.16: a torch generator or
    ``random.Random`` seeded with it), not from the global random state (3.15). A Keras on no known line is
    taken to be newer than the newest."""
    return keras_line(version) != "3.15"


def keras_version_checked(version=None):
    """True when the installed Keras (read from its metadata, not imported) is one these internals
    were checked against; True when Keras is not installed at all."""
    version = installed_keras_version() if version is None else version
    if version is None:
        return True
    return any(_on_line(version, v) for v in CHECKED_KERAS_VERSIONS)


def _candidates(name, version):
    """Where to look for piece ``name`` on Keras ``version``: its line's location, or on a line not in the
    table (an unchecked Keras) every known location, newest line first."""
    where = PIECES[name].where if name in PIECES else INSTANCE_ATTRIBUTES[name]
    line = keras_line(version)
    if line is not None:
        return [where[line]] if line in where else []
    return list(dict.fromkeys(where[line] for line in KERAS_LINES if line in where))


def _resolve(location):
    """``(owner, attribute)`` for "module:a.b.c" (owner: the module or the object holding the last name),
    or None when the module or a name is missing."""
    module_name, _, path = location.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return None
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, None)
        if owner is None:
            return None
    return (owner, attribute) if hasattr(owner, attribute) else None


def _missing_error(names, version):
    from ..errors import KerasdistError

    lacks = "; ".join(f"{PIECES[n].what} ({n}: looked for {' or '.join(_candidates(n, version)) or 'nothing'})"
                      for n in names)
    return KerasdistError(
        f"kerasdist does not support Keras {version}: it lacks {lacks}. Supported: {SUPPORTED_KERAS}. "
        "Install a supported Keras, or a kerasdist release checked against this one.")


def owner_of(name):
    """``(owner, attribute name)`` of piece ``name`` on the installed Keras, for replacing it; raises
    a :class:`KerasdistError` when this Keras lacks it."""
    version = _keras_version()
    for location in _candidates(name, version):
        found = _resolve(location)
        if found is not None:
            return found
    raise _missing_error([name], version)


def locate(name):
    """The object piece ``name`` is on the installed Keras (a class, function or method)."""
    owner, attribute = owner_of(name)
    return getattr(owner, attribute)


def missing(*names):
    """The pieces among ``names`` (default: all of :data:`PIECES`) that the installed Keras lacks."""
    version = _keras_version()
    return [n for n in (names or PIECES)
            if not any(_resolve(loc) is not None for loc in _candidates(n, version))]


def require(*names):
    """Raise one :class:`KerasdistError` naming every piece among ``names`` the installed Keras lacks."""
    lacking = missing(*names)
    if lacking:
        raise _missing_error(lacking, _keras_version())


def pieces_needed_by(*users):
    """The names of the pieces that ``users`` ("tf", "multiworker", "central_storage", ...) need."""
    return [name for name, piece in PIECES.items() if piece.needed_by in users]


def instance_attribute(name):
    """The name of private instance attribute ``name`` on the installed Keras (newest known on a Keras not
    in the table)."""
    candidates = _candidates(name, _keras_version())
    return candidates[0] if candidates else None
