"""Deprecated path of the LiteRT exporter, now :mod:`.export.litert` (plugin ``litert``);
its shared helpers are public in :mod:`kerasdist.exporting`. An alias for one release, not a plugin."""

import warnings

from kerasdist.exporting import (ExportResult, calibration_batches, check_exportable, compare_outputs,  # noqa: F401
                                 require, single_array)

from .export.litert import LITERT_FORMATS, export_litert, litert_converter, run_litert  # noqa: F401

warnings.warn(f"{__name__} is deprecated: import {__package__}.export.litert (the LiteRT exporter) or "
              "kerasdist.exporting (the shared export helpers)", DeprecationWarning, stacklevel=2)
