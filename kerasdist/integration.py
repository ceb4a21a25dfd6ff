"""Adds ``distribute=`` to ``keras.Model.compile``, routes fit/evaluate/predict, and keeps ``distribute=``
in the compile config Keras saves and loads (``get_compile_config`` / ``compile_from_config``, see saving.py).

A model compiled without ``distribute=`` takes Keras's own code path; the only
extra work is one attribute lookup per call.
"""

import functools
import inspect

from . import process_state
from . import saving as _saving
from . import session as _session

METHODS = ("fit", "evaluate", "predict")


def _originals():
    """name -> (class, Keras's own method) while patched. Kept across ``process_state.reset()``: the
    patches stay on Keras's classes until :func:`uninstall`."""
    return process_state.slot("kerasdist.keras_patches", dict, keep=True)


def install():
    """Patch the Keras trainer once per process (idempotent).

    Each method is replaced on the class that defines it (for ``compile``, the
    backend-independent Trainer): Keras compares ``type(model).compile`` with that
    class's to tell a user-overridden ``compile``, e.g. when loading a saved model.
    """
    originals = _originals()
    if originals:
        return
    wrappers = {"compile": _make_compile, "get_compile_config": _make_get_compile_config,
                "compile_from_config": _make_compile_from_config, **{name: _make_call(name) for name in METHODS}}
    for name, wrap in wrappers.items():
        owner = _defining_class(name)
        originals[name] = (owner, owner.__dict__[name])
        setattr(owner, name, wrap(owner.__dict__[name]))


def uninstall():
    """Restore Keras's own methods."""
    originals = _originals()
    for name, (owner, method) in originals.items():
        setattr(owner, name, method)
    originals.clear()


def _defining_class(name):
    import keras

    return next(cls for cls in keras.Model.__mro__ if name in cls.__dict__)


def original(name):
    return _originals()[name][1]


def _make_compile(original_compile):
    @functools.wraps(original_compile)
    def compile(self, *args, distribute=None, **kwargs):
        if distribute is None:
            distribute = _saving.pending_plan(self)  # compile_from_config restoring a saved distribute=
        if distribute is None:  # a plain re-compile is plain Keras again
            previous = self.__dict__.pop("_kerasdist_session", None)
            return _session.plain_recompile(self, original_compile, args, kwargs, previous)
        return _session.distributed_compile(self, original_compile, args, kwargs, distribute)

    signature = inspect.signature(original_compile)
    parameter = inspect.Parameter("distribute", inspect.Parameter.KEYWORD_ONLY, default=None)
    compile.__signature__ = signature.replace(parameters=[*signature.parameters.values(), parameter])
    compile.__doc__ = (original_compile.__doc__ or "") + (
        "\n\n        distribute (kerasdist): a plugin name ('mirrored', 'multiworker', 'auto', ...),"
        "\n            a tf.distribute.Strategy, a kerasdist spec, a list of these, or None.\n")
    return compile


def _make_get_compile_config(original_method):
    @functools.wraps(original_method)
    def get_compile_config(self):
        return _saving.add_plan(self, original_method(self))

    return get_compile_config


def _make_compile_from_config(original_method):
    @functools.wraps(original_method)
    def compile_from_config(self, config):
        config, plan = _saving.take_plan(self, config)
        if plan is None:
            return original_method(self, config)
        with _saving.restoring(self, plan):
            return original_method(self, config)

    return compile_from_config


def _make_call(name):
    def wrap(original_method):
        @functools.wraps(original_method)
        def method(self, *args, **kwargs):
            session = self.__dict__.get("_kerasdist_session")
            if session is None:
                return original_method(self, *args, **kwargs)
            return session.run(name, original_method, self, args, kwargs)

        return method

    return wrap
