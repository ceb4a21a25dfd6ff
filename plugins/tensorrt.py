"""Deprecated path of the ONNX and TensorRT exporters, now :mod:`.export.onnx` (plugin ``onnx``) and
:mod:`.export.tensorrt` (plugin ``tensorrt``). An alias for one release, not a plugin."""

import warnings

from .export.onnx import (INT8_SCHEMES, VNNI_FLAGS, X86_MACHINES, auto_int8_scheme, cpu_flags,  # noqa: F401
                          export_onnx, export_onnx_int8, quantize_qdq, resolve_int8_scheme, run_onnxruntime,
                          write_onnx)
from .export.tensorrt import (NVIDIA_DEVICE_GLOB, PRECISIONS, build_engine, export_tensorrt,  # noqa: F401
                              tensorrt_absent_reason)

warnings.warn(f"{__name__} is deprecated: import {__package__}.export.onnx or {__package__}.export.tensorrt",
              DeprecationWarning, stacklevel=2)
