"""The Keras backend of this process, found without importing Keras (as Keras itself finds it)."""

import json
import os
import sys

DEFAULT_BACKEND = "tensorflow"


def keras_backend(environ=None):
    """``keras.backend.backend()`` if Keras is imported, else what it will be: KERAS_BACKEND, then
    ``$KERAS_HOME/keras.json`` (default ``~/.keras``), then "tensorflow"."""
    keras = sys.modules.get("keras")
    backend_module = getattr(keras, "backend", None)
    if backend_module is not None and hasattr(backend_module, "backend"):
        return backend_module.backend()
    environ = os.environ if environ is None else environ
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    return _configured_backend(environ) or DEFAULT_BACKEND


def _configured_backend(environ):
    base = environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    if not environ.get("KERAS_HOME") and not os.access(os.path.dirname(base) or ".", os.W_OK):
        base = os.path.join("/tmp", ".keras")
    try:
        with open(os.path.join(base, "keras.json")) as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) and backend else None
