"""One home for process-wide state, and the one reset tests use (as accelerate's ``PartialState``).

kerasdist and its plugins keep what lives as long as the process (the strategy cache, patch tables,
counters that must agree between workers) in named slots here instead of module globals::

    from kerasdist.plugin_tools import process_state

    def _classes():
        return process_state.slot("myplugin.wrapped_classes", dict)

:func:`reset` forgets every slot (the next :func:`slot` call makes it anew with its factory) and then
calls every callback given to :func:`on_reset` (the plugin system: the next use builds a new one).
A slot made with ``keep=True`` survives :func:`reset`: it records something that outlives the Python
objects, which forgetting would leave in place but unrecorded: a patch applied to a Keras class (a
second install would wrap the wrapper, an uninstall could no longer restore Keras's own code), a key
handed to TensorFlow's runtime (handed out twice it aborts collectives), a directory removed at exit.
The code that applies such a thing undoes it itself (e.g. ``uninstall_*`` functions).
"""

import threading

from .errors import KerasdistError

__all__ = ["slot", "on_reset", "reset", "names"]

_slots = {}  # name -> (value, keep)
_callbacks = []
_lock = threading.RLock()


def slot(name, factory, *, keep=False):
    """The process-wide object under ``name``, made by ``factory()`` on first use (and after a reset,
    unless ``keep``). Name slots ``"<plugin or module>.<what>"``."""
    if not isinstance(name, str) or not name.strip():
        raise KerasdistError(f"process_state.slot: name={name!r} is not valid; give a non-empty string such as "
                             "'myplugin.cache'.")
    if not callable(factory):
        raise KerasdistError(f"process_state.slot({name!r}): factory={factory!r} is not callable; give what "
                             "makes the object, e.g. dict.")
    with _lock:
        if name not in _slots:
            _slots[name] = (factory(), bool(keep))
        value, kept = _slots[name]
    if kept != bool(keep):
        raise KerasdistError(f"process_state.slot({name!r}, keep={keep!r}): the slot exists with keep={kept!r}; "
                             "one name is one slot: use another name or the same keep.")
    return value


def on_reset(callback):
    """Call ``callback()`` at every :func:`reset` (once, however often it is registered). Returns it."""
    if not callable(callback):
        raise KerasdistError(f"process_state.on_reset: callback={callback!r} is not callable.")
    with _lock:
        if callback not in _callbacks:
            _callbacks.append(callback)
    return callback


def names(kept=None):
    """The names of the slots made so far (``kept=True``/``False``: only those made with that ``keep``)."""
    with _lock:
        return sorted(n for n, (_, k) in _slots.items() if kept is None or k is bool(kept))


def reset():
    """Forget every slot not made with ``keep=True``, then call the :func:`on_reset` callbacks in order."""
    with _lock:
        for name in [n for n, (_, keep) in _slots.items() if not keep]:
            del _slots[name]
        callbacks = list(_callbacks)
    for callback in callbacks:
        callback()
