"""Lists of Keras variables, without importing Keras (used by kerasdist._keras_internals and
re-exported by kerasdist.plugin_tools)."""


def unique_variables(variables):
    """``variables`` in order, each object once (Keras variables are unhashable by value)."""
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result
