"""LiteRT (TFLite) export with post-training quantization: kerasdist.export(model, path, format=...).

=================  ==========================================================================
format             what the converter does
=================  ==========================================================================
"litert"           float32 model
"litert-dynamic"   dynamic-range: int8 weights, float activations (about 4x smaller)
"litert-float16"   float16 weights (about 2x smaller; GPU delegates run it in fp16)
"litert-int8"      full integer: int8 weights and activations, calibrated on
                   ``representative_data`` (required); ``int8_io=True`` also makes the
                   model's inputs and outputs int8
=================  ==========================================================================

Conversion is TensorFlow's ``TFLiteConverter.from_keras_model`` (it handles Keras 3 models, also
ones trained under a strategy). A JAX or torch model is saved and converted so in a TensorFlow process
(Keras's own torch path needs the litert-torch package, not installed with kerasdist; JAX has none);
there ``representative_data=`` must be arrays. ``verify_with=inputs`` then runs the written file in the LiteRT
interpreter (``ai_edge_litert``, the ``litert`` extra) and compares it with the Keras model: the
result carries ``max_abs_diff`` and ``argmax_agreement``.

A model trained with ``distribute=[..., kerasdist.quantize()]`` (quantization-aware training) exports
to "litert-int8" from its learned ranges, without representative data; its float formats leave the
fake quantization out.
"""

import contextlib
import functools
import io
import os

import kerasdist
from kerasdist.exporting import (ExportResult, check_exportable, check_ranges_learned, compare_outputs,
                                 calibration_batches, convert_in_tensorflow, need_representative_data,
                                 quantization_aware_layers, quantization_recipe, require, tracing)
from kerasdist.plugin_tools import keras_backend

LITERT_FORMATS = {
    "litert": "float32",
    "litert-dynamic": "dynamic",
    "litert-float16": "float16",
    "litert-int8": "int8",
}


def litert_converter(model, mode, representative_data=None, calibration_steps=100, int8_io=False, per_channel=True):
    """A ``tf.lite.TFLiteConverter`` for ``model`` set up for ``mode`` (see LITERT_FORMATS)."""
    import tensorflow as tf

    from kerasdist.plugin_tools import disable_per_channel_quantization

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    if not per_channel:
        disable_per_channel_quantization(converter)
    if mode != "float32":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if mode == "float16":
        converter.target_spec.supported_types = [tf.float16]
    if mode == "int8":
        if representative_data is not None:  # post-training calibration; a QAT model carries its own ranges
            converter.representative_dataset = lambda: calibration_batches(representative_data, calibration_steps)
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        if int8_io:
            converter.inference_input_type = tf.int8
            converter.inference_output_type = tf.int8
    return converter


def run_litert(path, x):
    """Run a .tflite file on ``x`` (batch by batch of one) in the LiteRT interpreter."""
    import numpy as np

    interpreter_module = require("ai_edge_litert.interpreter", "litert", "Running a LiteRT model")
    interpreter = interpreter_module.Interpreter(model_path=path)
    interpreter.allocate_tensors()
    (source,), (sink,) = interpreter.get_input_details(), interpreter.get_output_details()
    outputs = []
    for example in x:
        value = example[None].astype(np.float32)
        scale, zero = source["quantization"]
        if source["dtype"] != np.float32 and scale:
            limits = np.iinfo(source["dtype"])
            value = np.clip(np.round(value / scale + zero), limits.min, limits.max)
        interpreter.set_tensor(source["index"], value.astype(source["dtype"]))
        interpreter.invoke()
        out = interpreter.get_tensor(sink["index"]).astype(np.float32)
        scale, zero = sink["quantization"]
        if sink["dtype"] != np.float32 and scale:
            out = (out - zero) * scale
        outputs.append(out[0])
    return np.stack(outputs)


def export_litert(model, filepath, *, mode, representative_data=None, calibration_steps=100,
                  int8_io=False, per_channel=True, verify_with=None):
    """Convert ``model`` to a LiteRT flatbuffer at ``filepath``; see the module docstring."""
    format = next(name for name, m in LITERT_FORMATS.items() if m == mode)
    check_exportable(model, format, filepath, verify_with, representative_data)
    if quantization_aware_layers(model):
        return _export_quantization_aware(model, filepath, format, mode, representative_data, int8_io, verify_with)
    if mode == "int8":
        need_representative_data(format, representative_data, "the activation ranges",
                                 "Without data, use format='litert-dynamic'.")
    if mode != "int8" and (representative_data is not None or int8_io):
        raise kerasdist.KerasdistError(
            f"export(format={format!r}): representative_data= and int8_io= are options of "
            "format='litert-int8' only.")
    if verify_with is not None:
        require("ai_edge_litert.interpreter", "litert", f"export(format={format!r}, verify_with=...)")
    if not per_channel and mode != "int8":
        raise kerasdist.KerasdistError(f"export(format={format!r}): per_channel= is an option of format='litert-int8' only.")
    if keras_backend() != "tensorflow":
        options = dict(representative_data=representative_data, calibration_steps=calibration_steps,
                       int8_io=int8_io, per_channel=per_channel)
        return _convert_in_tensorflow(model, filepath, format, verify_with, options)
    converter = litert_converter(model, mode, representative_data, calibration_steps, int8_io, per_channel)
    return _write(model, converter, filepath, format, verify_with)


def _convert_in_tensorflow(model, filepath, format, verify_with, options):
    """A JAX or torch model: TensorFlow's converter from the saved model (Keras's own torch path needs the
    litert-torch package), then the file verified against this model."""
    convert_in_tensorflow(model, filepath, format, **{k: v for k, v in options.items() if v is not None})
    return _verify(model, filepath, format, verify_with)


def _write(model, converter, filepath, format, verify_with):
    with contextlib.redirect_stdout(io.StringIO()):  # Keras prints its temporary SavedModel's signature
        flatbuffer = converter.convert()
    with open(filepath, "wb") as f:
        f.write(flatbuffer)
    return _verify(model, filepath, format, verify_with)


def _verify(model, filepath, format, verify_with):
    if verify_with is None:
        return ExportResult(os.fspath(filepath), format, os.path.getsize(filepath))
    return compare_outputs(model, verify_with, functools.partial(run_litert, os.fspath(filepath)),
                           os.fspath(filepath), format)


def _export_quantization_aware(model, filepath, format, mode, representative_data, int8_io, verify_with):
    """A model trained with ``quantize()``: "litert-int8" converts its learned ranges (full integer, no
    calibration); the other formats are of the float model (the fake quantization is left out)."""
    if mode == "int8" and representative_data is not None:
        raise kerasdist.KerasdistError(
            "export(format='litert-int8'): this model was trained with quantize() and carries its learned int8 "
            "ranges; leave out representative_data=.")
    if mode != "int8" and int8_io:
        raise kerasdist.KerasdistError(f"export(format={format!r}): int8_io= is an option of format='litert-int8' only.")
    if verify_with is not None:
        require("ai_edge_litert.interpreter", "litert", f"export(format={format!r}, verify_with=...)")
    if mode == "int8":
        check_ranges_learned(model, format)
        recipe = quantization_recipe(model)
        if recipe != "litert":
            raise kerasdist.KerasdistError(
                f"export(format={format!r}): this model was trained with the {recipe!r} recipe "
                "(symmetric Q/DQ for TensorRT); export it with format='onnx' or 'tensorrt', or train with quantize().")
    if keras_backend() != "tensorflow":
        return _convert_in_tensorflow(model, filepath, format, verify_with, {"int8_io": int8_io})
    with tracing("litert" if mode == "int8" else "float"):
        return _write(model, litert_converter(model, mode, int8_io=int8_io), filepath, format, verify_with)


@kerasdist.hookimpl
def kerasdist_register_exporters(register):
    descriptions = {
        "float32": "LiteRT (TFLite) flatbuffer, float32.",
        "dynamic": "LiteRT with dynamic-range quantization (int8 weights, float activations).",
        "float16": "LiteRT with float16 weights.",
        "int8": "LiteRT full-integer int8 (needs representative_data=).",
    }
    for format, mode in LITERT_FORMATS.items():
        register(format, functools.partial(export_litert, mode=mode), description=descriptions[mode],
                 extra="litert", backends=("tensorflow", "jax", "torch"), requires=("tensorflow",),
                 install="pip install 'kerasdist[cpu]' 'kerasdist[litert]'")  # TensorFlow converts on every backend
