"""ONNX export: kerasdist.export(model, path, format="onnx" | "onnx-int8").

- "onnx": ``model.export(format="onnx")`` (tf2onnx on TensorFlow; torch.onnx on torch; on JAX, whose
  Keras exporter needs jax2onnx, tf2onnx on the saved model in a TensorFlow process), checked with ``onnx.checker``;
  ``verify_with=inputs`` runs it in onnxruntime (CPU) and compares it with Keras.
- "onnx-int8": the float ONNX model quantized to QDQ form (QuantizeLinear/DequantizeLinear, symmetric,
  per-channel weights) by ``onnxruntime.quantization`` from ``representative_data``, in the
  ``int8_scheme`` that is exact on the CPU it is verified on (:func:`auto_int8_scheme`): "s8s8" (signed
  int8, zero point 0: TensorRT's explicit-quantization input) or "u8u8" (uint8, zero point 128) on x86
  CPUs without VNNI, where onnxruntime's U8S8 kernels saturate. ``verify_with=`` raises when the file
  is further than ``verify_tolerance`` x max |y| from Keras.
- A model trained with ``quantize()`` or ``tensorrt()`` (quantization-aware) exports to "onnx" with
  QuantizeLinear/DequantizeLinear pairs from its learned ranges.

The "tensorrt" format (:mod:`.tensorrt`) builds its engines from these two formats, through ``kerasdist.export``.
"""

import contextlib
import functools
import io
import os
import platform
import tempfile
import warnings

import kerasdist
from kerasdist.exporting import (ExportResult, calibration_batches, check_exportable, check_ranges_learned,
                                 compare_outputs, convert_in_tensorflow, need_representative_data,
                                 quantization_aware_layers, require, tracing)
from kerasdist.plugin_tools import check_number, keras_backend


def write_onnx(model, filepath, opset_version=None):
    """``model.export(format="onnx")`` (TensorFlow: tf2onnx; torch: torch.onnx), then ``onnx.checker`` on the
    file. A JAX model, and a quantization-aware one on torch, is converted by tf2onnx from the saved model
    (:func:`kerasdist.exporting.convert_in_tensorflow`): Keras's JAX exporter needs jax2onnx, and its
    Q/DQ pairs are written from TensorFlow's fake-quantization ops."""
    onnx = require("onnx", "onnx", "export(format='onnx')")
    backend = keras_backend()
    _called(model)
    if backend == "torch" and not quantization_aware_layers(model):
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript tracer's warnings about Keras's shape arithmetic
            model.export(os.fspath(filepath), format="onnx", opset_version=opset_version, verbose=False)
    elif backend != "tensorflow":
        require("tf2onnx", "onnx", f"export(format='onnx') on the {backend} backend")
        check_ranges_learned(model, "onnx")
        options = {} if opset_version is None else {"opset_version": opset_version}
        convert_in_tensorflow(model, filepath, "onnx", **options)
    elif quantization_aware_layers(model):  # Q/DQ pairs from the learned ranges (explicit quantization)
        require("tf2onnx", "onnx", "export(format='onnx')")
        check_ranges_learned(model, "onnx")
        with tracing("onnx"):
            model.export(os.fspath(filepath), format="onnx", opset_version=max(opset_version or 13, 13), verbose=False)
    else:
        require("tf2onnx", "onnx", "export(format='onnx')")
        model.export(os.fspath(filepath), format="onnx", opset_version=opset_version, verbose=False)
    onnx.checker.check_model(os.fspath(filepath))
    return os.fspath(filepath)


def _called(model):
    """Keras's exporter wants a model that was called once (a loaded one was not): call it on zeros."""
    import numpy as np

    shapes = [tuple(1 if d is None else d for d in tensor.shape) for tensor in getattr(model, "inputs", None) or []]
    if shapes:
        model([np.zeros(s, "float32") for s in shapes] if len(shapes) > 1 else np.zeros(shapes[0], "float32"),
              training=False)


def run_onnxruntime(path, x):
    """Run an ONNX file on ``x`` with onnxruntime's CPU provider."""
    ort = require("onnxruntime", "onnx", "Running an ONNX model")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (source,) = session.get_inputs()
    return session.run(None, {source.name: x.astype("float32")})[0]


def _finish(model, path, format, verify_with, tolerance=None, fix=""):
    if verify_with is None:
        return ExportResult(path, format, os.path.getsize(path))
    return compare_outputs(model, verify_with, functools.partial(run_onnxruntime, path), path, format,
                           tolerance, fix)


def export_onnx(model, filepath, *, opset_version=None, verify_with=None):
    """Float ONNX; ``verify_with`` compares onnxruntime with Keras."""
    check_exportable(model, "onnx", filepath, verify_with)
    if verify_with is not None:
        require("onnxruntime", "onnx", "export(format='onnx', verify_with=...)")
    return _finish(model, write_onnx(model, filepath, opset_version), "onnx", verify_with)


class _CalibrationReader:
    """onnxruntime's CalibrationDataReader protocol over :func:`calibration_batches`."""

    def __init__(self, input_names, batches):
        self.input_names, self.batches = input_names, iter(batches)

    def get_next(self):
        batch = next(self.batches, None)
        return None if batch is None else dict(zip(self.input_names, batch))


BACKENDS = ("tensorflow", "jax", "torch")

# Symmetric QDQ schemes: (activation type, weight type, reduce_range i.e. 7-bit weights).
INT8_SCHEMES = {
    "s8s8": ("QInt8", "QInt8", False),  # TensorRT's INT8; exact in onnxruntime on ARM and x86 with VNNI
    "u8u8": ("QUInt8", "QUInt8", False),  # zero point 128; onnxruntime's U8U8 kernels, exact on every x86
    "s8s8-7bit": ("QInt8", "QInt8", True),  # TensorRT-readable and AVX2-safe, coarser weights
}
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")  # /proc/cpuinfo flags of the CPUs whose U8S8 kernels do not saturate
X86_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU's feature flags (the ``flags`` line of /proc/cpuinfo), or None where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def auto_int8_scheme(machine=None, flags=None):
    """(scheme, why) for this CPU: "u8u8" on x86 without VNNI (or flags unreadable), else "s8s8".

    onnxruntime fuses Q/DQ pairs into U8S8 int8 kernels; on x86 without VNNI (AVX2, AVX-512 without
    VNNI) they multiply with VPMADDUBSW, whose int16 pair sums saturate, and the model drifts far off."""
    machine = (machine or platform.machine()).lower()
    if machine not in X86_MACHINES:
        return "s8s8", f"a {machine} CPU, where onnxruntime's int8 kernels do not saturate"
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return "u8u8", "an x86 CPU whose flags could not be read (/proc/cpuinfo): the scheme exact on every x86"
    vnni = sorted(set(VNNI_FLAGS) & set(flags))
    if vnni:
        return "s8s8", f"an x86 CPU with VNNI ({', '.join(vnni)})"
    return "u8u8", (f"an x86 CPU without VNNI (no {' or '.join(VNNI_FLAGS)} in /proc/cpuinfo), where "
                    "onnxruntime's U8S8 int8 kernels saturate")


def resolve_int8_scheme(int8_scheme):
    """(scheme, why) for an ``int8_scheme`` option; KerasdistError for an unknown one."""
    if int8_scheme == "auto":
        return auto_int8_scheme()
    if int8_scheme not in INT8_SCHEMES:
        raise kerasdist.KerasdistError(
            f"export(format='onnx-int8'): int8_scheme={int8_scheme!r} is not valid; choose one of "
            f"'auto', {', '.join(map(repr, INT8_SCHEMES))}.")
    return int8_scheme, "chosen with int8_scheme="


def quantize_qdq(float_path, int8_path, representative_data, calibration_steps=100, per_channel=True,
                 scheme="s8s8"):
    """Static QDQ quantization of an ONNX file in one of INT8_SCHEMES (TensorRT requires "s8s8")."""
    onnx = require("onnx", "onnx", "export(format='onnx-int8')")
    quantization = require("onnxruntime.quantization", "onnx", "export(format='onnx-int8')")
    activation_type, weight_type, reduce_range = INT8_SCHEMES[scheme]
    graph = onnx.load(float_path).graph
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    reader = _CalibrationReader(names, calibration_batches(representative_data, calibration_steps))
    quantization.quantize_static(
        float_path, int8_path, reader, quant_format=quantization.QuantFormat.QDQ, per_channel=per_channel,
        reduce_range=reduce_range, activation_type=getattr(quantization.QuantType, activation_type),
        weight_type=getattr(quantization.QuantType, weight_type),
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    return int8_path


def export_onnx_int8(model, filepath, *, representative_data=None, calibration_steps=100, per_channel=True,
                     int8_scheme="auto", opset_version=None, verify_with=None, verify_tolerance=0.1):
    """QDQ ONNX in ``int8_scheme``; ``verify_with`` compares onnxruntime with Keras and raises beyond
    ``verify_tolerance`` x max |y|."""
    check_exportable(model, "onnx-int8", filepath, verify_with, representative_data)
    if quantization_aware_layers(model):
        raise kerasdist.KerasdistError(
            "export(format='onnx-int8'): this model was trained with quantization-aware training and carries its "
            "int8 ranges; export it with format='onnx', which writes them as QuantizeLinear/DequantizeLinear pairs.")
    need_representative_data("onnx-int8", representative_data)
    scheme, why = resolve_int8_scheme(int8_scheme)
    check_number(verify_tolerance, "verify_tolerance", "export(format='onnx-int8')", minimum=0, inclusive_minimum=False)
    with tempfile.TemporaryDirectory() as tmp:
        float_path = write_onnx(model, os.path.join(tmp, "float.onnx"), opset_version)
        quantize_qdq(float_path, os.fspath(filepath), representative_data, calibration_steps, per_channel, scheme)
    fix = (f"It was quantized with int8_scheme {scheme!r} ({why}). Fixes: "
           + ("int8_scheme='u8u8' if onnxruntime runs it on an x86 CPU without VNNI; " if scheme != "u8u8" else "")
           + "more typical representative_data= (or calibration_steps=); per_channel=True; or a larger "
             "verify_tolerance= if this accuracy is acceptable.")
    return _finish(model, os.fspath(filepath), "onnx-int8", verify_with, verify_tolerance, fix)


@kerasdist.hookimpl
def kerasdist_register_exporters(register):
    register("onnx", export_onnx, requires=("tf2onnx", "onnx"), extra="onnx", backends=BACKENDS,
             description="ONNX: tf2onnx (TensorFlow; JAX through a TensorFlow process), torch.onnx (torch); "
                         "verify_with= runs onnxruntime.")
    register("onnx-int8", export_onnx_int8, requires=("tf2onnx", "onnx", "onnxruntime"), extra="onnx",
             backends=BACKENDS,
             description="QDQ int8 ONNX via onnxruntime.quantization (needs representative_data=); "
                         "int8_scheme='s8s8' is TensorRT's INT8 input.")
