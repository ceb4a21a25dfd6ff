"""TensorRT export: kerasdist.export(model, path, format="tensorrt").

TF-TRT is gone from TensorFlow's pip wheels (TF 2.18+), so the path to TensorRT is
Keras -> ONNX -> TensorRT engine. The ONNX model comes from the "onnx" format (float, or a model
trained with ``quantize()`` / ``tensorrt()``, whose learned ranges become Q/DQ pairs) or, for
``precision="int8"`` of a float model, from "onnx-int8" with ``int8_scheme="s8s8"`` (TensorRT's INT8:
zero point 0), both asked of ``kerasdist.export`` like any other format: this plugin imports no other.

The engine (``.engine``/``.plan``) is that ONNX model parsed and built with the ``tensorrt`` package,
``precision`` "fp32", "fp16" or "int8" (from the QDQ model). Needs an NVIDIA GPU: engines are built
for, and run on, the GPU that builds them. Without one the format reports itself unavailable
(``kerasdist plugins``) and ``kerasdist.export`` says why.
"""

import glob
import importlib.util
import os
import tempfile

import kerasdist
from kerasdist.exporting import (ExportResult, check_exportable, need_representative_data,
                                 quantization_aware_layers, require)

PRECISIONS = ("fp32", "fp16", "int8")
NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"


def tensorrt_absent_reason(device_glob=NVIDIA_DEVICE_GLOB):
    """Why a TensorRT engine cannot be built here, or None. Imports nothing."""
    reasons = []
    if not glob.glob(device_glob):
        reasons.append("no NVIDIA GPU here (no /dev/nvidia0 device): TensorRT builds an engine on the GPU "
                       "that will run it, so export on a machine with that GPU")
    if importlib.util.find_spec("tensorrt") is None:
        reasons.append("the tensorrt package is not installed: pip install 'kerasdist[tensorrt]'")
    return "; ".join(reasons) or None


def _profile_shapes(shape, name, min_batch, opt_batch, max_batch):
    """(min, opt, max) shapes for one input: the dynamic batch axis takes the three batch sizes."""
    dims = list(shape)
    if any(d < 0 for d in dims[1:]):
        raise kerasdist.KerasdistError(
            f"export(format='tensorrt'): input {name!r} has shape {tuple(dims)} with unknown non-batch "
            "dimensions; build the model with a fixed keras.Input shape (TensorRT needs them).")
    if dims and dims[0] >= 0:
        return tuple(dims), tuple(dims), tuple(dims)
    return tuple([min_batch] + dims[1:]), tuple([opt_batch] + dims[1:]), tuple([max_batch] + dims[1:])


def build_engine(onnx_path, precision, min_batch=1, opt_batch=8, max_batch=64, workspace_bytes=None):
    """Parse ``onnx_path`` and build a serialized TensorRT engine (bytes). Runs on the GPU."""
    trt = require("tensorrt", "tensorrt", "export(format='tensorrt')")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = int(str(trt.__version__).split(".")[0])
    flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as f:
        if not parser.parse(f.read()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise kerasdist.KerasdistError(f"export(format='tensorrt'): TensorRT cannot parse the ONNX model: {errors}")
    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)  # scales come from the QDQ nodes (explicit quantization)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        profile.set_shape(tensor.name, *_profile_shapes(tensor.shape, tensor.name, min_batch, opt_batch, max_batch))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise kerasdist.KerasdistError(
            f"export(format='tensorrt'): TensorRT could not build a {precision} engine (its log above says why).")
    return bytes(engine)


def export_tensorrt(model, filepath, *, precision="fp16", representative_data=None, calibration_steps=100,
                    min_batch=1, opt_batch=8, max_batch=64, workspace_bytes=None, opset_version=None):
    """A serialized TensorRT engine for this machine's GPU; see the module docstring."""
    check_exportable(model, "tensorrt", filepath, None, representative_data)
    if precision not in PRECISIONS:
        raise kerasdist.KerasdistError(
            f"export(format='tensorrt'): precision={precision!r} is not valid; choose one of {', '.join(PRECISIONS)}.")
    calibrated = precision == "int8" and not quantization_aware_layers(model)
    if calibrated:
        need_representative_data("tensorrt", representative_data)
    if not 1 <= min_batch <= opt_batch <= max_batch:
        raise kerasdist.KerasdistError(
            f"export(format='tensorrt'): batch sizes min_batch={min_batch}, opt_batch={opt_batch}, "
            f"max_batch={max_batch} must satisfy 1 <= min <= opt <= max.")
    with tempfile.TemporaryDirectory() as tmp:
        if calibrated:
            onnx_path = _onnx(model, os.path.join(tmp, "model.int8.onnx"), "onnx-int8", opset_version=opset_version,
                              representative_data=representative_data, calibration_steps=calibration_steps,
                              int8_scheme="s8s8")  # TensorRT's INT8: zero point 0
        else:
            onnx_path = _onnx(model, os.path.join(tmp, "model.onnx"), "onnx", opset_version=opset_version)
        engine = build_engine(onnx_path, precision, min_batch, opt_batch, max_batch, workspace_bytes)
    with open(filepath, "wb") as f:
        f.write(engine)
    return ExportResult(os.fspath(filepath), "tensorrt", len(engine))


def _onnx(model, path, format, **options):
    """The ONNX file TensorRT parses, written by the registered ``format`` (another plugin's)."""
    try:
        return os.fspath(kerasdist.export(model, path, format=format, **options))
    except kerasdist.UnknownPluginError as exc:
        raise kerasdist.PluginUnavailableError(
            f"export(format='tensorrt') builds its engine from the ONNX format {format!r}, which no loaded plugin "
            "provides here (is the plugin 'onnx' disabled by KERASDIST_DISABLE_PLUGINS / KERASDIST_LOAD_PLUGINS?).") from exc


@kerasdist.hookimpl
def kerasdist_register_exporters(register):
    register("tensorrt", export_tensorrt, requires=("tf2onnx", "onnx"), extra="tensorrt",
             backends=("tensorflow", "jax", "torch"),
             check=tensorrt_absent_reason,
             description="TensorRT engine built from ONNX (fp32/fp16/int8); needs an NVIDIA GPU.")
