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
ones trained under a strategy). ``verify_with=inputs`` then runs the written file in the LiteRT
interpreter (``ai_edge_litert``, the ``litert`` extra) and compares it with the Keras model: the
result carries ``max_abs_diff`` and ``argmax_agreement``.

A model trained with ``distribute=[..., kerasdist.quantize()]`` (quantization-aware training) exports
to "litert-int8" from its learned ranges, without representative data; its float formats leave the
fake quantization out.
"""

import contextlib
import functools
import importlib
import io
import os

import kerasdist
from kerasdist_plugins import qat

LITERT_FORMATS = {
    "litert": "float32",
    "litert-dynamic": "dynamic",
    "litert-float16": "float16",
    "litert-int8": "int8",
}


ExportResult = kerasdist.ExportResult  # the public result type, for callers that import it from here


def require(module, extra, purpose):
    """Import ``module`` or raise PluginUnavailableError with the pip extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise kerasdist.PluginUnavailableError(
            f"{purpose} needs the Python module {module!r} ({type(exc).__name__}: {exc}): "
            f"pip install 'kerasdist[{extra}]'") from exc


def check_exportable(model, format, filepath=None, verify_with=None, representative_data=None):
    """Errors that would otherwise surface deep inside a converter, or after the file was written."""
    if filepath is not None:
        if os.path.isdir(filepath):
            raise kerasdist.KerasdistError(f"export(format={format!r}): {os.fspath(filepath)} is a folder; give "
                                           "the path of the file to write, e.g. os.path.join(folder, 'model.bin').")
        folder = os.path.dirname(os.path.abspath(os.fspath(filepath)))
        if not os.path.isdir(folder):
            raise kerasdist.KerasdistError(f"export(format={format!r}): the folder {folder} does not exist; "
                                           "create it first.")
        if not os.access(folder, os.W_OK):
            raise kerasdist.KerasdistError(f"export(format={format!r}): cannot write to {folder} (read-only); "
                                           "choose a writable folder.")
    if verify_with is not None:
        _check_inputs_match(model, verify_with, f"export(format={format!r}, verify_with=...)")
    if representative_data is not None:
        _check_inputs_match(model, _first_sample(representative_data),
                            f"export(format={format!r}, representative_data=...)")
    if not model.built:
        raise kerasdist.KerasdistError(
            f"export(format={format!r}): model {model.name!r} is not built; call it on data, give it a "
            "keras.Input, or call model.build(input_shape) first.")
    quantized = sorted({layer.name for layer in _all_layers(model)
                        if getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)})
    if quantized:
        raise kerasdist.KerasdistError(
            f"export(format={format!r}): layers {quantized} were quantized with model.quantize(); "
            "converters cannot read Keras-quantized kernels. Export the float model: the format "
            "quantizes it.")


def _first_sample(representative_data):
    """The data as given (arrays), or its first element (a generator function or a tf.data.Dataset)."""
    if callable(representative_data):
        return next(iter(representative_data()), [])
    if hasattr(representative_data, "element_spec"):
        element = next(iter(representative_data.take(1)), [])
        return element[0] if isinstance(element, tuple) else element
    return representative_data


def _check_inputs_match(model, value, what):
    """Arrays that are empty or do not fit the model's inputs are refused before converting."""
    import keras
    import numpy as np

    arrays = [np.asarray(a) for a in keras.tree.flatten(value)]
    if not arrays or any(a.ndim == 0 or len(a) == 0 for a in arrays):
        raise kerasdist.KerasdistError(f"{what}: no examples given (empty input); give at least one example "
                                       "with the model's input shape.")
    expected = [tuple(t.shape)[1:] for t in getattr(model, "inputs", None) or []]
    if expected and (len(expected) != len(arrays) or any(
            len(e) != a.ndim - 1 or any(d is not None and d != s for d, s in zip(e, a.shape[1:]))
            for e, a in zip(expected, arrays))):
        got = [tuple(a.shape) for a in arrays]
        raise kerasdist.KerasdistError(f"{what}: shape {got if len(got) > 1 else got[0]} does not fit the model's "
                                       f"input {expected if len(expected) > 1 else expected[0]} (batch first); give "
                                       "arrays of the model's input shape.")


def _all_layers(model):
    for layer in getattr(model, "layers", []):
        yield layer
        yield from _all_layers(layer)


def single_array(value, what):
    """``value`` as one numpy array (verification supports single-input, single-output models)."""
    import keras
    import numpy as np

    flat = keras.tree.flatten(value)
    if len(flat) != 1:
        raise kerasdist.KerasdistError(
            f"{what}: got {len(flat)} arrays; verification compares single-input, single-output models.")
    return np.asarray(keras.ops.convert_to_numpy(flat[0]))


def compare_outputs(model, inputs, run_exported, path, format, tolerance=None, fix=""):
    """Run the Keras model and the exported file on ``inputs``; an :class:`ExportResult`.

    With ``tolerance``, a max |diff| above ``tolerance * max|y|`` (y: the Keras output) removes the
    file and raises KerasdistError naming the figures, the bound and ``fix``."""
    import numpy as np

    x = single_array(inputs, f"export(format={format!r}, verify_with=...)")
    expected = single_array(model(x, training=False), "the model's output")
    got = np.asarray(run_exported(x), dtype=np.float32).reshape(expected.shape)
    agreement = None
    if expected.ndim >= 2 and expected.shape[-1] > 1:
        agreement = float(np.mean(np.argmax(expected, -1) == np.argmax(got, -1)))
    result = ExportResult(path, format, os.path.getsize(path), float(np.max(np.abs(expected - got))),
                          agreement, len(x))
    scale = float(np.max(np.abs(expected)))
    if tolerance is not None and not result.max_abs_diff <= tolerance * scale:  # NaN fails too
        os.remove(path)
        argmax = "" if agreement is None else f", argmax agreement {agreement:.3f}"
        raise kerasdist.KerasdistError(
            f"export(format={format!r}, verify_with=...): the written file is far from the Keras model on "
            f"{len(x)} examples: max |diff| {result.max_abs_diff:.3g}{argmax}; the bound is {tolerance * scale:.3g} "
            f"(verify_tolerance={tolerance} x the output's max |y| {scale:.3g}). The file {path} was removed. "
            f"{fix}".rstrip())
    return result


def calibration_batches(representative_data, steps):
    """Yield lists of input arrays (one example each) from arrays, a tf.data.Dataset or a callable."""
    import keras
    import numpy as np
    import tensorflow as tf

    if callable(representative_data):
        yield from representative_data()
        return
    if isinstance(representative_data, tf.data.Dataset):
        for element in representative_data.take(steps):
            x = element[0] if isinstance(element, tuple) else element
            yield [np.asarray(a, dtype=np.float32) for a in keras.tree.flatten(x)]
        return
    arrays = [np.asarray(a, dtype=np.float32) for a in keras.tree.flatten(representative_data)]
    for i in range(min(steps, len(arrays[0]))):
        yield [a[i:i + 1] for a in arrays]


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
    if qat.is_quantization_aware(model):
        return _export_quantization_aware(model, filepath, format, mode, representative_data, int8_io, verify_with)
    if mode == "int8" and representative_data is None:
        raise kerasdist.KerasdistError(
            "export(format='litert-int8') needs representative_data=: about 100 typical inputs (an array, "
            "a tf.data.Dataset or a generator function) to calibrate the activation ranges. Without "
            "data, use format='litert-dynamic'.")
    if mode != "int8" and (representative_data is not None or int8_io):
        raise kerasdist.KerasdistError(
            f"export(format={format!r}): representative_data= and int8_io= are options of "
            "format='litert-int8' only.")
    if verify_with is not None:
        require("ai_edge_litert.interpreter", "litert", f"export(format={format!r}, verify_with=...)")
    if not per_channel and mode != "int8":
        raise kerasdist.KerasdistError(f"export(format={format!r}): per_channel= is an option of format='litert-int8' only.")
    converter = litert_converter(model, mode, representative_data, calibration_steps, int8_io, per_channel)
    return _write(model, converter, filepath, format, verify_with)


def _write(model, converter, filepath, format, verify_with):
    with contextlib.redirect_stdout(io.StringIO()):  # Keras prints its temporary SavedModel's signature
        flatbuffer = converter.convert()
    with open(filepath, "wb") as f:
        f.write(flatbuffer)
    if verify_with is None:
        return ExportResult(os.fspath(filepath), format, len(flatbuffer))
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
        qat.check_trained(model, format)
        if qat.recipe_of(model) != "litert":
            raise kerasdist.KerasdistError(
                f"export(format={format!r}): this model was trained with the {qat.recipe_of(model)!r} recipe "
                "(symmetric Q/DQ for TensorRT); export it with format='onnx' or 'tensorrt', or train with quantize().")
    with qat.export_mode("litert" if mode == "int8" else "float"):
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
                 extra="litert")
