"""A check at a model's FIRST custom train step (nothing after it): every trainable variable the step changed
went through an optimizer whose ``apply`` combines the workers' gradients. An optimizer kerasdist did not find
(kept in a dict or list, on a sub-model, made in the step) applies this worker's own gradients: the workers
drift apart silently. Plugins call ``start_first_step_check`` before the step, ``note_applied`` from their
wrapped ``apply``, and ``unsummed_after_first_step`` after it (then ``unsummed_updates_error``)."""

import weakref

from .errors import KerasdistError

#: model -> _FirstStep while its first custom train step runs; None once checked
_checks = weakref.WeakKeyDictionary()


class _FirstStep:
    def __init__(self, model):
        import keras

        self.before = [(v, keras.ops.convert_to_numpy(v.value).copy()) for v in model.trainable_variables]
        self.applied = set()


def start_first_step_check(model):
    """Before ``model``'s custom train step: at its first, note each trainable variable's value. Returns whether
    this step is checked (the first only)."""
    if model in _checks:
        return False
    _checks[model] = _FirstStep(model)
    return True


def note_applied(model, variables):
    """From a wrapped (gradient-combining) ``apply``: ``variables`` are updated with every worker's gradients."""
    check = _checks.get(model)
    if check is not None:
        check.applied.update(id(v) for v in variables)


def unsummed_after_first_step(model):
    """After the checked step: the paths of the trainable variables it changed without a wrapped ``apply``."""
    import keras
    import numpy as np

    check, _checks[model] = _checks.get(model), None
    if check is None:
        return []
    return [getattr(v, "path", v.name) for v, value in check.before
            if id(v) not in check.applied and not np.array_equal(keras.ops.convert_to_numpy(v.value), value)]


def unsummed_updates_error(names, distribute):
    """The error for trainable variables that a step changed with an optimizer kerasdist does not wrap."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    shown = shown or "(on another worker)"
    return KerasdistError(
        f"distribute={distribute!r}: the custom train_step changed the trainable variable(s) {shown} with an optimizer kerasdist does not see, so each worker applied only its own gradients and the "
        "workers would drift apart. Keep every optimizer the step applies as an attribute of the model before fit "
        "(e.g. self.d_optimizer = keras.optimizers.SGD(...) in __init__ or compile), not in a dict or list, on a "
        "sub-model or made in the step.")
