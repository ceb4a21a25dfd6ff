"""Deprecated path of the ONNX and TensorRT exporters, now :mod:`kerasdist_plugins.export.onnx` (plugin
``onnx``) and :mod:`kerasdist_plugins.export.tensorrt` (plugin ``tensorrt``). Kept as an alias for one
release; not a plugin."""

import warnings

from .export import onnx as _onnx, tensorrt as _tensorrt

warnings.warn("kerasdist_plugins.tensorrt is deprecated: import kerasdist_plugins.export.onnx or "
              "kerasdist_plugins.export.tensorrt", DeprecationWarning, stacklevel=2)


def __getattr__(name):
    for module in (_tensorrt, _onnx):
        if not name.startswith("kerasdist_") and hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'kerasdist_plugins.tensorrt' has no attribute {name!r}")
