"""The one module that touches Keras/TensorFlow private attributes.

Keras 3 binds a model to the tf.distribute strategy that is current when the
model object is constructed (``Trainer._distribute_strategy``) and an optimizer
to the strategy current in its ``__init__`` (``TFOptimizer._distribution_strategy``).
kerasdist moves objects built elsewhere under a strategy, which needs those
private attributes and ``Variable._initialize``. Everything private lives here;
``tests/test_keras_internals.py`` fails loudly when a Keras release changes it.
"""

import keras

#: Keras releases these internals were read and tested against.
CHECKED_KERAS_VERSIONS = ("3.15",)

_MODEL_STRATEGY_ATTR = "_distribute_strategy"
_OPTIMIZER_STRATEGY_ATTR = "_distribution_strategy"


def keras_version_checked():
    """True when the running Keras is one these internals were checked against."""
    return any(keras.__version__.startswith(v + ".") or keras.__version__ == v
               for v in CHECKED_KERAS_VERSIONS)


def bound_strategy(model):
    """The strategy the model was built under, or None for the default strategy."""
    return getattr(model, _MODEL_STRATEGY_ATTR, None)


def bind_model(model, strategy):
    """Record ``strategy`` as the model's strategy, as construction under its scope would."""
    setattr(model, _MODEL_STRATEGY_ATTR, strategy)


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
    distribute = getattr(tf_variable, "_distribute_strategy", None)
    if distribute is not None:
        return distribute is strategy
    return strategy is None


def move_to_strategy(model, strategy, optimizer=None):
    """Move ``model`` (weights, non-trainable state, seed generators, compiled
    metrics) and ``optimizer`` (built or not, trained or not) under ``strategy``,
    values preserved, and bind both to it."""
    optimizers = _optimizer_chain(optimizer)
    old_keys = {id(o): _trainable_keys(o) for o in optimizers}
    variables = _all_model_variables(model)
    for opt in optimizers:
        variables += list(opt.variables)
    _move_variables(_unique(variables), strategy)
    bind_model(model, strategy)
    for opt in optimizers:
        setattr(opt, _OPTIMIZER_STRATEGY_ATTR, strategy)
        _rekey_optimizer(opt, old_keys[id(opt)])


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
    which moving changes: rebuild that index (and the weight-decay exclusions)."""
    if not getattr(optimizer, "built", False):
        return
    new_keys = _trainable_keys(optimizer)
    optimizer._trainable_variables_indices = {k: i for i, k in enumerate(new_keys)}
    renamed = dict(zip(old_keys, new_keys))
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None)
    if excluded:
        optimizer._exclude_from_weight_decay = {renamed.get(k, k) for k in excluded}
    optimizer._exclude_from_weight_decay_cache = {}


def _all_model_variables(model):
    return _unique(list(model.variables) + list(_metric_variables(model)))


def _unique(variables):
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def _metric_variables(model):
    for metric in getattr(model, "metrics", []) or []:
        yield from metric.variables
