"""Run a function when a module finishes importing, so ``import kerasdist`` imports neither Keras nor
TensorFlow: kerasdist patches Keras when the user imports it, and splits the CPU when TensorFlow loads."""

import importlib.abc
import sys

from . import process_state


def _callbacks():
    """Top-level module name -> callbacks waiting for its import. Kept across ``process_state.reset()``:
    a forgotten callback would never run (Keras imported later would not be patched)."""
    return process_state.slot("kerasdist.import_callbacks", dict, keep=True)


def when_imported(name, callback):
    """Call ``callback(module)`` once top-level module ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _callbacks().setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders return for a watched name."""

    def find_spec(self, name, path=None, target=None):
        waiting = _callbacks()
        if name not in waiting:
            return None
        spec = _find_with_others(self, name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            # popped only now: importlib.util.find_spec() probes (TensorFlow, Horovod do) find specs
            # that are never executed
            for callback in waiting.pop(name, ()):
                callback(module)
            if not waiting and self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_then_call
        return spec


def _find_with_others(skip, name, path, target):
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if finder is skip or find_spec is None:
            continue
        spec = find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


_finder = _PostImportFinder()
