"""The one module that touches Keras/TensorFlow private attributes.

Keras 3 binds a model to the tf.distribute strategy that is current when the
model object is constructed (``Trainer._distribute_strategy``) and an optimizer
to the strategy current in its ``__init__`` (``TFOptimizer._distribution_strategy``).
kerasdist moves objects built elsewhere under a strategy, which needs those
private attributes and ``Variable._initialize``. Everything private lives here;
``tests/test_keras_internals.py`` fails loudly when a Keras release changes it.

This package is that one module, in parts: strategies, multi-worker and parameter-server training here;
what a training step and its variables need (uneven batches, gradient accumulation, synchronized batch
statistics, JAX layouts) in ``training.py``; replica writes to CentralStorageStrategy's variables in
``central.py``. Where each private piece lives on each Keras version is in ``versions.py``: a piece the
installed Keras lacks is one KerasdistError when a model is compiled.
"""

import contextlib

from . import versions
from .versions import (CHECKED_KERAS_VERSIONS, SUPPORTED_KERAS, installed_keras_version,  # noqa: F401
                       keras_version_checked)

_MODEL_STRATEGY_ATTR = "_distribute_strategy"
_OPTIMIZER_STRATEGY_ATTR = "_distribution_strategy"


def bound_strategy(model):
    """The strategy the model was built under, or None for the default strategy."""
    return getattr(model, _MODEL_STRATEGY_ATTR, None)


def bind_model(model, strategy):
    """Record ``strategy`` as the model's strategy, as construction under its scope would."""
    setattr(model, _MODEL_STRATEGY_ATTR, strategy)


@contextlib.contextmanager
def unbound_from_strategy(model):
    """Run Keras's own loops for ``model`` as if it had been built outside any strategy."""
    import tensorflow as tf

    bound = bound_strategy(model)
    bind_model(model, tf.distribute.get_strategy())
    try:
        yield model
    finally:
        bind_model(model, bound)


def optimizer_strategy(optimizer):
    return getattr(optimizer, _OPTIMIZER_STRATEGY_ATTR, None)


def _move_variables(variables, strategy):
    """Re-create each Keras variable's backing tf.Variable under ``strategy``.

    The keras.Variable objects keep their identity (layers, optimizers and
    callbacks hold references to them); only the backing value moves. A tensor
    (not a tf.Variable) must be passed to ``_initialize``: given a tf.Variable it
    silently keeps the old, non-distributed one.
    """
    import tensorflow as tf

    with strategy.scope():
        for variable in variables:
            if getattr(variable, "_value", None) is None:
                continue  # not created yet: it will be created under the scope
            current = variable._value
            if _belongs_to(current, strategy):
                continue
            variable._initialize(tf.convert_to_tensor(current.read_value()))


def _belongs_to(tf_variable, strategy):
    """True when the backing variable already lives under ``strategy`` (a plain
    tf.Variable lives under the default strategy)."""
    import tensorflow as tf

    distribute = getattr(tf_variable, "_distribute_strategy", None)
    if distribute is not None:
        return distribute is strategy
    return strategy is None or (strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy())


def move_to_strategy(model, strategy, optimizer=None):
    """Move ``model`` (weights, non-trainable state, seed generators, compiled
    metrics) and ``optimizer`` (built or not, trained or not) under ``strategy``,
    values preserved, and bind both to it. Raises a KerasdistError first when this Keras lacks a private
    piece that training under ``strategy`` needs (called by every ``compile`` under a tf.distribute strategy)."""
    from ..variables import unique_variables

    versions.require(*versions.pieces_needed_by(*_piece_users(strategy)))
    optimizers = _optimizer_chain(optimizer)
    old_keys = {id(o): _trainable_keys(o) for o in optimizers}
    variables = _all_model_variables(model)
    for opt in optimizers:
        variables += list(opt.variables)
    _move_variables(unique_variables(variables), strategy)
    bind_model(model, strategy)
    for opt in optimizers:
        setattr(opt, _OPTIMIZER_STRATEGY_ATTR, strategy)
        _rekey_optimizer(opt, old_keys[id(opt)])


def _piece_users(strategy):
    """Who needs private pieces when training under ``strategy`` (``versions.Piece.needed_by``)."""
    import tensorflow as tf

    users = ["tf"]
    if is_multiworker_strategy(strategy):
        users.append("multiworker")
    if isinstance(strategy, tf.distribute.experimental.CentralStorageStrategy):
        users.append("central_storage")
    return users


def _optimizer_chain(optimizer):
    chain = []
    while optimizer is not None:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    return chain


def _trainable_keys(optimizer):
    return [optimizer._var_key(v) for v in getattr(optimizer, "_trainable_variables", [])]


def _rekey_optimizer(optimizer, old_keys):
    """A built optimizer indexes its variables by the backing tf.Variable's id,
    which moving changes: rebuild that index, the weight-decay exclusions and the per-variable
    weight-decay dict (``versions.INSTANCE_ATTRIBUTES["optimizer_weight_decay_by_key"]``)."""
    if not getattr(optimizer, "built", False):
        return
    new_keys = _trainable_keys(optimizer)
    optimizer._trainable_variables_indices = {k: i for i, k in enumerate(new_keys)}
    renamed = dict(zip(old_keys, new_keys))
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None)
    if excluded:
        optimizer._exclude_from_weight_decay = {renamed.get(k, k) for k in excluded}
    by_key = versions.instance_attribute("optimizer_weight_decay_by_key")
    decays = getattr(optimizer, by_key, None)
    if decays is not None:
        setattr(optimizer, by_key, {renamed.get(k, k): decay for k, decay in decays.items()})


def _all_model_variables(model):
    from ..variables import unique_variables

    return unique_variables(list(model.variables) + list(_metric_variables(model)))


def _metric_variables(model):
    for metric in getattr(model, "metrics", []) or []:
        yield from metric.variables


def flatten_metrics_in_order(model, logs):
    """What ``evaluate()`` returns without ``return_dict=True``, made from its ``logs`` dict:
    the values in metric order, or the one value (``Trainer._flatten_metrics_in_order``)."""
    versions.require("trainer_flatten_metrics")
    return model._flatten_metrics_in_order(logs)


# -- multi-worker (MultiWorkerMirroredStrategy) --------------------------------
#
# Stock Keras 3.15 + TF 2.21 cannot ``fit`` under a multi-worker strategy
# (keras-team/keras#20585, tensorflow/tensorflow#72388): ``_maybe_symbolic_build``
# reduces a PerReplica data batch across workers, and ``reduce_per_replica``
# reduces scalar logs with ``axis=0``. Both paths always raise under a
# multi-worker MultiWorkerMirroredStrategy, so the patches below only change
# code paths that cannot work today; every other strategy takes Keras's code.

_multiworker_patches = {}


def is_multiworker_strategy(strategy):
    """True for a MultiWorkerMirroredStrategy spanning more than this process."""
    import tensorflow as tf

    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def install_multiworker_fit_fixes():
    """Make Keras 3's TF trainer work under a multi-worker strategy (idempotent); True once installed.

    Runs when a worker joins its cluster, at ``import kerasdist``: on a Keras that lacks a piece it
    replaces (``versions.PIECES``) it changes nothing and returns False, and compiling under the
    multi-worker strategy raises the KerasdistError naming that piece."""
    if _multiworker_patches:
        return True
    if versions.missing("tf_trainer_build", "tf_reduce_per_replica"):
        return False
    import tensorflow as tf
    from keras import tree

    trainer, build_name = versions.owner_of("tf_trainer_build")
    trainer_module, reduce_name = versions.owner_of("tf_reduce_per_replica")
    original_build = getattr(trainer, build_name)
    original_reduce = getattr(trainer_module, reduce_name)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or not is_multiworker_strategy(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:  # only shapes matter: this worker's first replica batch
            data_batch = tree.map_structure(
                lambda v: (strategy.experimental_local_results(v)[0]
                           if isinstance(v, tf.distribute.DistributedValues) else v),
                next(it))
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and is_multiworker_strategy(strategy):
            return _mean_over_workers(values, strategy)
        return original_reduce(values, strategy, reduction)

    _multiworker_patches["build"] = (trainer, build_name, original_build)
    _multiworker_patches["reduce"] = (trainer_module, reduce_name, original_reduce)
    setattr(trainer, build_name, _maybe_symbolic_build)
    setattr(trainer_module, reduce_name, reduce_per_replica)
    return True


def _mean_over_workers(values, strategy):
    """Keras's per-step logs averaged over the workers: float scalars through the strategy's
    log summer when one is set (one message for all of them), the rest by ``strategy.reduce``."""
    from keras import tree

    flat = tree.flatten(values)
    summer = _log_summers.get(id(strategy))
    local = [strategy.experimental_local_results(v) for v in flat]
    fast = [i for i, v in enumerate(flat) if summer is not None and len(local[i]) == 1
            and local[i][0].shape.rank == 0 and local[i][0].dtype.is_floating]
    means = [None if i in fast else strategy.reduce("MEAN", v, axis=None if v.shape.rank == 0 else 0)
             for i, v in enumerate(flat)]
    if fast:
        for i, total in zip(fast, summer[1]([local[i][0] for i in fast])):
            means[i] = total / summer[0]
    return tree.pack_sequence_as(values, means)


#: id(strategy) -> (number of workers, function summing a list of tensors over the workers)
_log_summers = {}


def set_log_summer(strategy, workers, sum_tensors):
    """Average ``fit``/``evaluate`` logs under ``strategy`` with ``sum_tensors`` (None: TensorFlow's reduce)."""
    if sum_tensors is None:
        _log_summers.pop(id(strategy), None)
    else:
        _log_summers[id(strategy)] = (workers, sum_tensors)


def route_gradient_all_reduce(optimizer, strategy, sum_tensors):
    """Sum the dense gradients of ``optimizer`` (and the optimizers it wraps) with ``sum_tensors``
    while it runs under ``strategy``; sparse gradients and other strategies take Keras's own
    all-reduce (``TFOptimizer._all_reduce_sum_gradients``). ``sum_tensors=None`` restores it.

    A ``LossScaleOptimizer`` (mixed_float16) gets its gradients summed before it checks them for
    inf/NaN: Keras checks each worker's local gradients and then all-reduces only inside the branch
    taken for finite ones, so workers that disagree (an overflow on one) would run different
    all-reduces, and the all-reduce nested in that branch is not ordered with the step's other
    collectives. Summed first, every worker checks the same numbers and takes the same branch.
    """
    chain = _optimizer_chain(optimizer)
    for inner in chain:
        for attr in (_GRADIENT_ALL_REDUCE_ATTR, _APPLY_ATTR, _PRESUMMED_ATTR):
            inner.__dict__.pop(attr, None)
    if sum_tensors is None:
        return
    for inner in chain:
        object.__setattr__(inner, _GRADIENT_ALL_REDUCE_ATTR,
                           _routed_all_reduce(inner, strategy, sum_tensors, getattr(inner, _GRADIENT_ALL_REDUCE_ATTR)))
    if len(chain) > 1:
        object.__setattr__(chain[0], _APPLY_ATTR, _sum_before_apply(chain, strategy, sum_tensors,
                                                                   getattr(chain[0], _APPLY_ATTR)))


def _under(strategy):
    import tensorflow as tf

    return tf.distribute.get_replica_context() is not None and tf.distribute.get_strategy() is strategy


def _sum_dense(grads, sum_tensors):
    import tensorflow as tf

    grads = list(grads)
    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    if dense:
        for i, total in zip(dense, sum_tensors([grads[i] for i in dense])):
            grads[i] = total
    return grads


def _routed_all_reduce(optimizer, strategy, sum_tensors, keras_all_reduce):
    import tensorflow as tf

    def all_reduce(grads_and_vars):
        pairs = list(grads_and_vars)
        if not _under(strategy):
            return keras_all_reduce(pairs)
        presummed = optimizer.__dict__.get(_PRESUMMED_ATTR, False)
        grads = [g for g, _ in pairs] if presummed else _sum_dense([g for g, _ in pairs], sum_tensors)
        pairs = [(g, v) for g, (_, v) in zip(grads, pairs)]
        sparse = [i for i, (g, _) in enumerate(pairs) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            for i, pair in zip(sparse, keras_all_reduce([pairs[i] for i in sparse])):
                pairs[i] = pair
        return pairs

    return all_reduce


def _sum_before_apply(chain, strategy, sum_tensors, keras_apply):
    def apply(grads, trainable_variables=None):
        if not _under(strategy):
            return keras_apply(grads, trainable_variables)
        grads = _sum_dense(grads, sum_tensors)
        for inner in chain[1:]:  # set while Keras traces the update (replica threads included)
            object.__setattr__(inner, _PRESUMMED_ATTR, True)
        try:
            return keras_apply(grads, trainable_variables)
        finally:
            for inner in chain[1:]:
                inner.__dict__.pop(_PRESUMMED_ATTR, None)

    return apply


_APPLY_ATTR = "apply"
_PRESUMMED_ATTR = "_kerasdist_gradients_summed"
_GRADIENT_ALL_REDUCE_ATTR = "_all_reduce_sum_gradients"


def uninstall_multiworker_fit_fixes():
    """Restore Keras's own functions (tests)."""
    for key in ("build", "reduce"):
        if key in _multiworker_patches:
            owner, name, original = _multiworker_patches.pop(key)
            setattr(owner, name, original)


def tf_context_initialized():
    """True once TensorFlow ran an op: collective ops can no longer be configured."""
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def configure_coordination(cluster_spec, register_timeout_s):
    """Set up TF's coordination service as MultiWorkerMirroredStrategy would, but with a
    registration timeout (the strategy's own set-up waits forever for absent workers)."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    if context.context().coordination_service is not None:
        return
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        cluster_register_timeout_in_ms=int(register_timeout_s * 1000),
        coordinated_jobs=jobs)


def make_chief_aware_backup(backup_dir, write_dir, **kwargs):
    """A ``keras.callbacks.BackupAndRestore`` that restores from ``backup_dir`` but
    writes (and deletes at the end) ``write_dir``: non-chief workers read the
    chief's backup and write theirs to a temporary directory."""
    import keras

    join = versions.locate("file_utils_join")

    class ChiefAwareBackupAndRestore(keras.callbacks.BackupAndRestore):
        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            self.backup_dir = write_dir
            self._weights_path = join(write_dir, "latest.weights.h5")
            self._training_metadata_path = join(write_dir, "training_metadata.json")
            self._prev_weights_path = f"{self._weights_path}.bkp"
            self._prev_training_metadata_path = f"{self._training_metadata_path}.bkp"

    return ChiefAwareBackupAndRestore(backup_dir, **kwargs)


from .layers import disable_per_channel_quantization, refresh_call_signature, state_unlocked  # noqa: E402,F401  # noqa: E402,F401
from .ps import PS_COORDINATOR_JOB, parameter_server_strategy, symbolic_build  # noqa: E402,F401
from .training import (accumulate_across_replicas, all_layers, keras_tree, lay_out_variables,  # noqa: E402,F401
                       set_batch_share_weighting, synchronize_batch_norm, variable_layout,
                       weight_replicas_by_batch_share)
from .central import assign_state_from_first_replica, update_loss_scale_once_per_step  # noqa: E402,F401
