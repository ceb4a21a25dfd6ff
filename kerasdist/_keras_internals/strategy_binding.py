"""Moving Keras objects built elsewhere under a tf.distribute strategy (part of kerasdist._keras_internals).

Keras 3 binds a model to the tf.distribute strategy that is current when the model object is constructed
(``Trainer._distribute_strategy``) and an optimizer to the strategy current in its ``__init__``
(``TFOptimizer._distribution_strategy``). kerasdist moves objects built elsewhere under a strategy, which
needs those private attributes and ``Variable._initialize``; under a plain MirroredStrategy it also makes the
distributed variables itself, from TensorFlow's ``MirroredExtended._devices`` and
``distribute_utils.VARIABLE_CLASS_MAPPING`` (checked against TensorFlow's own path in
tests/test_keras_internals.py).
"""

import contextlib

from ..variables import unique_variables
from . import versions
from .losses import install_single_loss_scaling
from .multiworker_fit import METRICS_MOVER, MOVED_ATTR, install_multiworker_fit_fixes, is_multiworker_strategy

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
    callbacks hold references to them); only the backing value moves. A callable
    (not a tf.Variable) must be passed to ``_initialize``: given a tf.Variable it
    silently keeps the old, non-distributed one. Where the strategy puts its first
    component on the old variable's device, the old variable becomes that component
    (:func:`_reusing_first_components`): half the variables to create, no copy.
    Under a plain MirroredStrategy :class:`_DirectMirroring` makes the same MirroredVariable
    without TensorFlow's variable-creator stack.
    """
    import tensorflow as tf
    from tensorflow.python.eager import context, record

    direct = _DirectMirroring.for_strategy(strategy)
    # already inside the strategy's scope (load_model's compile_from_config), its creator runs after the reusing
    # one, which must then not hand the old variable back as it is (the model stayed plain: "colocate_vars_with")
    reusable = not tf.distribute.has_strategy()
    with (_reusing_first_components() as reuse, strategy.scope(),
          context.device_policy(context.DEVICE_PLACEMENT_SILENT), record.stop_recording()):
        belongs = _belonging_to(strategy)
        # a variable not created yet will be created under the scope
        moving = [v for v in variables if getattr(v, "_value", None) is not None and not belongs(v._value)]
        with _all_or_none_moved(moving), _trainable_as_backed(moving):
            if direct is not None:
                moving = direct.move_all(moving)
            for variable in moving:
                variable._initialize(reuse.offer(variable._value, reusable and _agrees_with(variable, variable._value)))


@contextlib.contextmanager
def _trainable_as_backed(variables):
    """While moving: each Keras variable's ``trainable`` flag as its backing tf.Variable's. Keras picks what
    trains from its own flag, but TensorFlow's tape watches only tf.Variables made trainable, and Keras's
    ``_initialize`` makes the new one from the flag: a base frozen (``trainable=False``) at the compile that
    moved it got untrainable tf.Variables, so unfrozen later it never trained (issue 29). The tf.Variable keeps
    what it had, as in one process; Keras's flags are given back."""
    flags = [(variable, variable.trainable) for variable in variables]
    try:
        for variable, _ in flags:
            variable.trainable = variable._value.trainable
        yield
    finally:
        for variable, flag in flags:
            variable.trainable = flag


@contextlib.contextmanager
def _all_or_none_moved(variables):
    """On any error, give every variable back its old tf.Variable (no longer a component of a distributed
    one) before the error goes on: a half-moved model would train wrongly."""
    def holders(old):  # where DistributedVariable records its container: the handle of a ResourceVariable
        return [h for h in (old, old.handle) if not hasattr(h, "_distributed_container")]

    olds = [(variable, variable._value, holders(variable._value)) for variable in variables]
    try:
        yield
    except BaseException:
        for variable, old, uncontained in olds:
            variable._value = old
            for holder in uncontained:
                if hasattr(holder, "_distributed_container"):
                    delattr(holder, "_distributed_container")
        raise


class _DirectMirroring:
    """The distributed variable ``tf.Variable`` would make under a plain MirroredStrategy's scope for a
    variable built outside any scope, with the old variable as replica 0's component, made without the
    creator stack's per-variable Python: what ``distribute_utils.create_mirrored_variable`` does in eager
    mode (the wrapper class its ``VARIABLE_CLASS_MAPPING`` gives for the synchronization, with the
    aggregation), less the two ``no_op`` it runs per variable to set each component's
    ``_initializer_op``, which stays None in eager mode either way."""

    _SYNCHRONIZATIONS = ("AUTO", "ON_WRITE", "ON_READ")  # what create_mirrored_variable accepts

    def __init__(self, strategy, devices):
        self.strategy, self.devices = strategy, devices

    @classmethod
    def for_strategy(cls, strategy):
        """None unless ``strategy`` is exactly a MirroredStrategy (a subclass such as the multi-worker one
        creates its variables otherwise) without variable policies and without a ``_create_variable`` of
        its own on ``extended`` (central.assign_state_from_first_replica changes aggregations there), and
        eager. Variable creators the
        caller has in force are no reason: on TensorFlow's path too the strategy's creator, entered
        last, hands each component to :func:`_reusing_first_components`'s, which never calls them."""
        import tensorflow as tf
        from tensorflow.python.distribute import mirrored_strategy

        if (type(strategy.extended) is not mirrored_strategy.MirroredExtended
                or "_create_variable" in vars(strategy.extended)
                or strategy.extended._use_var_policy or not tf.executing_eagerly()):
            return None
        return cls(strategy, tuple(strategy.extended._devices))

    def move_all(self, variables):
        """Give each variable its distributed variable, each replica's copies made under one device scope;
        returns those left to TensorFlow's path (see :meth:`_movable`), untouched."""
        import tensorflow as tf
        from tensorflow.python.distribute import distribute_utils
        from tensorflow.python.framework import ops

        movable, left = [], []
        for variable in variables:
            (movable if self._movable(variable, variable._value) else left).append(variable)
        olds = [variable._value for variable in movable]
        synchronizations = [tf.VariableSynchronization.ON_WRITE  # as TensorFlow resolves AUTO for every component
                            if old.synchronization == tf.VariableSynchronization.AUTO else old.synchronization
                            for old in olds]
        names = [old.name.split(":")[0] for old in olds]
        components = [[old] for old in olds]
        for i, device in enumerate(self.devices[1:], start=1):
            with ops.device(device):
                for old, synchronization, name, values in zip(olds, synchronizations, names, components):
                    values.append(_copy_on_this_device(old, {
                        "name": f"{name}/replica_{i}/", "trainable": old.trainable,
                        "synchronization": synchronization, "aggregation": old.aggregation}))
        wrappers = [distribute_utils.VARIABLE_CLASS_MAPPING[synchronization](self.strategy, values, old.aggregation)
                    for old, synchronization, values in zip(olds, synchronizations, components)]
        for variable, wrapper in zip(movable, wrappers):  # all built first: an error leaves none moved
            variable._initialize(wrapper)
        return left

    def _movable(self, variable, old):
        """False where TensorFlow's path must do it: ``old`` distributed, elsewhere than replica 0's device,
        unlike the variable in trainable, dtype, aggregation or synchronization (TensorFlow's path takes
        those from the Keras variable, through ``Variable._map_aggregation``/``_map_synchronization``, the
        direct one from ``old``), or with a synchronization TensorFlow refuses (its error then comes from
        its own path)."""
        import tensorflow as tf

        return not (isinstance(old, tf.distribute.DistributedValues) or old.device != self.devices[0]
                    or not _agrees_with(variable, old) or old.synchronization.name not in self._SYNCHRONIZATIONS)


def _agrees_with(variable, old):
    """Does the tf.Variable ``old`` have what TensorFlow's path gives the Keras ``variable``'s new one:
    trainable, dtype, and aggregation and synchronization as ``Variable._initialize`` maps them
    (``_map_aggregation``/``_map_synchronization``)? Only then may it serve as a component."""
    import tensorflow as tf

    return (variable.trainable == old.trainable and tf.as_dtype(variable.dtype) == old.dtype
            and old.aggregation == variable._map_aggregation(variable.aggregation)
            and old.synchronization == variable._map_synchronization(variable.synchronization))


class _FirstComponentReuse:
    """What the creator below may reuse: the initial value it was given for one variable, and that variable."""

    def __init__(self):
        self.initial_value = self.variable = self.copying = None

    def offer(self, variable, reusable=True):
        """The initial value to give ``tf.Variable`` for ``variable``'s replacement: it reads ``variable``
        only when called, which a component that reuses ``variable`` (only if ``reusable``) never does."""
        import tensorflow as tf

        self.variable, self.copying = (variable if reusable else None), None
        self.initial_value = lambda: tf.convert_to_tensor(variable.read_value())  # what moving read before
        return self.initial_value


@contextlib.contextmanager
def _reusing_first_components():
    """A variable creator entered outside the strategy's scope, so that it creates the components
    (MirroredStrategy's ``_real_mirrored_creator`` calls the next creator once per device, the first
    time with the initial value it was given, under that device). When it gets the offered initial
    value on the old variable's own device it returns the old variable instead of a copy. Anything else
    (other strategies, other devices, other variables) goes to the next creator unchanged."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    reuse = _FirstComponentReuse()

    def creator(next_creator, **kwargs):
        old, offered = reuse.variable, reuse.initial_value
        if (offered is not None and old is not None and kwargs.get("initial_value") is offered
                and not isinstance(old, tf.distribute.DistributedValues)
                and old.device == context.context().device_name
                and kwargs.get("trainable", old.trainable) == old.trainable
                and tf.as_dtype(kwargs.get("dtype") or old.dtype) == old.dtype):
            reuse.initial_value = None  # once
            reuse.copying = old
            return old
        if (reuse.copying is not None and callable(kwargs.get("initial_value"))
                and str(kwargs.get("name", "")).endswith("/")):  # a later replica's copy of the first
            return _copy_on_this_device(reuse.copying, kwargs)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield reuse


def _copy_on_this_device(variable, kwargs):
    """A copy of ``variable`` on the current device, created uninitialized and then assigned (much less
    Python than ``tf.Variable``'s initializer path). The read and the assign are the bare ops
    ``variable.value()`` and ``assign`` run, without their Python (a tape notice that
    ``record.stop_recording`` silences, graph-mode bookkeeping): in an interleaved A/B it cut the extra
    compile time on ResNet50 by a third."""
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops

    copy = resource_variable_ops.UninitializedVariable(
        shape=variable.shape, dtype=variable.dtype, name=kwargs["name"], trainable=kwargs.get("trainable", True),
        synchronization=kwargs.get("synchronization"), aggregation=kwargs.get("aggregation"))
    value = tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype)
    tf.raw_ops.AssignVariableOp(resource=copy.handle, value=value, validate_shape=True)
    return copy


def _belonging_to(strategy):
    """A test: does a backing variable already live under ``strategy`` (a plain tf.Variable lives under
    the default strategy)? What it says of plain variables is worked out once."""
    import tensorflow as tf

    plain_ones_do = strategy is None or (strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy())

    def belongs(tf_variable):
        distribute = getattr(tf_variable, "_distribute_strategy", None)
        return plain_ones_do if distribute is None else distribute is strategy

    return belongs


def move_to_strategy(model, strategy, optimizer=None):
    """Move ``model`` (weights, non-trainable state, seed generators, compiled
    metrics) and ``optimizer`` (built or not, trained or not) under ``strategy``,
    values preserved, and bind both to it. Raises a KerasdistError first when this Keras lacks a private
    piece that training under ``strategy`` needs (called by every ``compile`` under a tf.distribute strategy)."""
    versions.require(*versions.pieces_needed_by(*_piece_users(strategy)))
    optimizers = optimizer_chain(optimizer)
    old_keys = {id(o): _trainable_keys(o) for o in optimizers}
    variables = _all_model_variables(model)
    for opt in optimizers:
        variables += list(opt.variables)
    _move_variables(unique_variables(variables), strategy)
    bind_model(model, strategy)
    setattr(model, MOVED_ATTR, True)
    install_multiworker_fit_fixes()  # fit then builds it without reading the user's data (issue 29)
    install_single_loss_scaling()  # a Loss passed to add_loss inside its call is scaled once (issue 29)
    for opt in optimizers:
        setattr(opt, _OPTIMIZER_STRATEGY_ATTR, strategy)
        _rekey_optimizer(opt, old_keys[id(opt)])


def move_metrics_to_strategy(model, strategy):
    """Move ``model``'s metric variables not yet under ``strategy`` there (values kept): a metric object made
    before ``compile`` (keras.io's ``metrics=[CategoricalTruePositives()]``) is built outside any scope, and compile
    cannot see it until Keras builds the compiled metrics at the first ``fit``. Left plain, each worker of a
    MultiWorkerMirroredStrategy read its own share's state: the epoch logs differed per rank (issue 29)."""
    _move_variables(unique_variables(_metric_variables(model)), strategy)


METRICS_MOVER[:] = [move_metrics_to_strategy]


def _piece_users(strategy):
    """Who needs private pieces when training under ``strategy`` (``versions.Piece.needed_by``)."""
    import tensorflow as tf

    users = ["tf"]
    if is_multiworker_strategy(strategy):
        users.append("multiworker")
    if isinstance(strategy, tf.distribute.experimental.CentralStorageStrategy):
        users.append("central_storage")
    return users


def optimizer_chain(optimizer):
    """``optimizer`` and the optimizers it wraps (a LossScaleOptimizer's inner one), outermost first."""
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
    return unique_variables(list(model.variables) + list(_metric_variables(model)))


def _metric_variables(model):
    for metric in getattr(model, "metrics", []) or []:
        yield from metric.variables
