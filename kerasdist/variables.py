"""Lists of Keras variables and optimizers, without importing Keras at import time (used by kerasdist._keras_internals and
re-exported by kerasdist.plugin_tools)."""


def unique_variables(variables):
    """``variables`` in order, each object once (Keras variables are unhashable by value)."""
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def optimizers_held_by(model):
    """Every optimizer ``model`` trains with: ``model.optimizer`` first, then each other
    ``keras.optimizers.Optimizer`` held as an attribute of the model (a GAN's ``d_optimizer`` and
    ``g_optimizer``, set in its own ``compile``). The outermost only: a LossScaleOptimizer, not its inner one."""
    import keras

    found = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    inner = {id(getattr(o, "inner_optimizer", None)) for o in found}
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not f for f in found):
            found.append(value)
            inner.add(id(getattr(value, "inner_optimizer", None)))
    return [o for o in found if id(o) not in inner]
