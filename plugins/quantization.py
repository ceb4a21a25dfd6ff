"""Deprecated path of the LiteRT exporter, now :mod:`kerasdist_plugins.export.litert` (plugin ``litert``);
its shared helpers (``require``, ``check_exportable``, ``compare_outputs``, ``calibration_batches``...) are
public in :mod:`kerasdist.exporting`. Kept as an alias for one release; not a plugin."""

import warnings

from kerasdist import exporting as _exporting

from .export import litert as _litert

warnings.warn("kerasdist_plugins.quantization is deprecated: import kerasdist_plugins.export.litert (the LiteRT "
              "exporter) or kerasdist.exporting (the shared export helpers)", DeprecationWarning, stacklevel=2)


def __getattr__(name):
    for module in (_litert, _exporting):
        if not name.startswith("kerasdist_") and hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'kerasdist_plugins.quantization' has no attribute {name!r}")
