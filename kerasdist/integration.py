"""Adds ``distribute=`` to ``keras.Model.compile`` and routes fit/evaluate/predict.

A model compiled without ``distribute=`` takes Keras's own code path; the only
extra work is one attribute lookup per call.
"""

import functools
import inspect

from . import session as _session

METHODS = ("fit", "evaluate", "predict")
_originals = {}


def install():
    """Patch ``keras.Model`` once per process (idempotent)."""
    import keras

    if _originals:
        return
    _originals["compile"] = keras.Model.compile
    keras.Model.compile = _make_compile(keras.Model.compile)
    for name in METHODS:
        _originals[name] = getattr(keras.Model, name)
        setattr(keras.Model, name, _make_call(name, _originals[name]))


def uninstall():
    """Restore Keras's own methods."""
    import keras

    for name, original in _originals.items():
        setattr(keras.Model, name, original)
    _originals.clear()


def original(name):
    return _originals[name]


def _make_compile(original_compile):
    @functools.wraps(original_compile)
    def compile(self, *args, distribute=None, **kwargs):
        if distribute is None:
            return original_compile(self, *args, **kwargs)
        return _session.distributed_compile(self, original_compile, args, kwargs, distribute)

    signature = inspect.signature(original_compile)
    parameter = inspect.Parameter("distribute", inspect.Parameter.KEYWORD_ONLY, default=None)
    compile.__signature__ = signature.replace(parameters=[*signature.parameters.values(), parameter])
    compile.__doc__ = (original_compile.__doc__ or "") + (
        "\n\n        distribute (kerasdist): a plugin name ('mirrored', 'multiworker', 'auto', ...),"
        "\n            a tf.distribute.Strategy, a kerasdist spec, a list of these, or None.\n")
    return compile


def _make_call(name, original_method):
    @functools.wraps(original_method)
    def method(self, *args, **kwargs):
        session = self.__dict__.get("_kerasdist_session")
        if session is None:
            return original_method(self, *args, **kwargs)
        return session.run(name, original_method, self, args, kwargs)

    return method
