"""``kerasdist.export``, and the public toolkit every exporter shares (the built-in LiteRT, ONNX and
TensorRT exporters use nothing else, so a third-party exporter can do what they do).

- :func:`export` / :class:`ExportResult`: post-training conversion through a registered format.
- Checks before converting: :func:`require` (an optional module, or the pip extra that installs it),
  :func:`check_exportable` (the path, the model, the example inputs), :func:`need_representative_data`.
- Data: :func:`calibration_batches` (representative data as one-example batches); verification:
  :func:`compare_outputs` (the written file against the Keras model, an :class:`ExportResult`).
- Models that learned their own int8 ranges (quantization-aware training, e.g. ``kerasdist.quantize()``):
  :func:`quantization_aware_layers`, :func:`quantization_recipe`, :func:`check_ranges_learned`, and
  :func:`tracing` / :func:`trace_mode`, the switch under which such layers trace for a converter.
- Other backends: :func:`convert_in_tensorflow` runs a TensorFlow-backend converter (tf2onnx, LiteRT's) on
  a JAX or torch model, saved and loaded in a TensorFlow child process; verify the file in the caller.

The quantization protocol: a layer that simulates int8 quantization in training carries
``kerasdist_quantization_recipe`` (a string naming the runtime whose scheme it learned, e.g. "litert" or
"tensorrt") and ``kerasdist_quantization_ranges()`` (``{name: (min, max)}``, not finite until trained: NaN or
+-inf), and reads :func:`trace_mode` in ``call``: "train" (fake quantization from variables), "float" (no quantization),
"litert" or "onnx" (constant ranges, the ops that converter turns into int8).
"""

import contextlib
import dataclasses
import importlib
import math
import os
import threading
from typing import Optional

from .errors import KerasdistError, PluginUnavailableError
from .export_in_ranks import _export_in_rank0, _job_processes, _Processes  # noqa: F401 (tests stand in ranks)

__all__ = ["ExportResult", "export", "require", "check_exportable", "need_representative_data", "single_array",
           "compare_outputs", "calibration_batches", "quantization_aware_layers", "quantization_recipe",
           "check_ranges_learned", "trace_mode", "tracing", "TRACE_MODES", "convert_in_tensorflow"]


@dataclasses.dataclass
class ExportResult:
    """What an exporter wrote; ``os.fspath(result)`` is the file's path. Exporters should return one
    (a plain path is accepted too); the verification fields stay None/0 when nothing was checked."""

    path: str
    format: str
    size_bytes: int
    max_abs_diff: Optional[float] = None
    argmax_agreement: Optional[float] = None
    samples_checked: int = 0

    def __fspath__(self):
        return self.path


def export(model, filepath, format, **options):
    """Convert ``model`` to ``format`` (see ``kerasdist plugins --kind export``) and write ``filepath``.

    Options are checked against the exporter's before anything runs. In a job of several torch ranks or JAX
    processes, call it in every rank: rank 0 alone writes ``filepath`` (from a plain copy of the model that every
    rank saves), and every rank returns its result or raises its error (:func:`_export_in_rank0`)."""
    from .manager import get_system

    entry = get_system().registry.get(format, kinds=("export",))
    entry.check_options(options)
    reason = entry.unavailable_reason()
    if reason:
        raise PluginUnavailableError(f"Export format {entry.name!r} cannot run here: {reason}.")
    options = {**entry.defaults, **options}
    job = _job_processes()
    if job is None:
        return entry.factory(model, filepath, **options)
    return _export_in_rank0(job, entry, model, filepath, options)


# -- checks before converting ------------------------------------------------------------------

def require(module, extra, purpose):
    """Import ``module`` or raise PluginUnavailableError with the pip extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PluginUnavailableError(
            f"{purpose} needs the Python module {module!r} ({type(exc).__name__}: {exc}): "
            f"pip install 'kerasdist[{extra}]'") from exc


def check_exportable(model, format, filepath=None, verify_with=None, representative_data=None):
    """Errors that would otherwise surface deep inside a converter, or after the file was written: a
    path that is a folder or not writable, examples that do not fit the model, an unbuilt model, layers
    quantized with Keras's ``model.quantize()`` (converters cannot read them)."""
    from .plugin_tools import all_layers

    if filepath is not None:
        _check_writable(filepath, format)
    if verify_with is not None:
        _check_inputs_match(model, verify_with, f"export(format={format!r}, verify_with=...)")
    if representative_data is not None:
        _check_inputs_match(model, _first_sample(representative_data),
                            f"export(format={format!r}, representative_data=...)")
    if not model.built:
        raise KerasdistError(
            f"export(format={format!r}): model {model.name!r} is not built; call it on data, give it a "
            "keras.Input, or call model.build(input_shape) first.")
    quantized = sorted({layer.name for layer in all_layers(model)
                        if getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)})
    if quantized:
        raise KerasdistError(
            f"export(format={format!r}): layers {quantized} were quantized with model.quantize(); "
            "converters cannot read Keras-quantized kernels. Export the float model: the format "
            "quantizes it.")


def _check_writable(filepath, format):
    if os.path.isdir(filepath):
        raise KerasdistError(f"export(format={format!r}): {os.fspath(filepath)} is a folder; give "
                             "the path of the file to write, e.g. os.path.join(folder, 'model.bin').")
    folder = os.path.dirname(os.path.abspath(os.fspath(filepath)))
    if not os.path.isdir(folder):
        raise KerasdistError(f"export(format={format!r}): the folder {folder} does not exist; create it first.")
    if not os.access(folder, os.W_OK):
        raise KerasdistError(f"export(format={format!r}): cannot write to {folder} (read-only); "
                             "choose a writable folder.")


def need_representative_data(format, representative_data, what="the int8 ranges", fix=""):
    """Raise when a format that calibrates ``what`` got no ``representative_data=``."""
    if representative_data is None:
        raise KerasdistError(
            f"export(format={format!r}) needs representative_data=: about 100 typical inputs (an array, a "
            f"tf.data.Dataset or a generator function) to calibrate {what}.{' ' + fix if fix else ''}")


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
        raise KerasdistError(f"{what}: no examples given (empty input); give at least one example "
                             "with the model's input shape.")
    expected = [tuple(t.shape)[1:] for t in getattr(model, "inputs", None) or []]
    if expected and (len(expected) != len(arrays) or any(
            len(e) != a.ndim - 1 or any(d is not None and d != s for d, s in zip(e, a.shape[1:]))
            for e, a in zip(expected, arrays))):
        got = [tuple(a.shape) for a in arrays]
        raise KerasdistError(f"{what}: shape {got if len(got) > 1 else got[0]} does not fit the model's "
                             f"input {expected if len(expected) > 1 else expected[0]} (batch first); give "
                             "arrays of the model's input shape.")


# -- data and verification ----------------------------------------------------------------------

def single_array(value, what):
    """``value`` as one numpy array (verification supports single-input, single-output models)."""
    import keras
    import numpy as np

    flat = keras.tree.flatten(value)
    if len(flat) != 1:
        raise KerasdistError(
            f"{what}: got {len(flat)} arrays; verification compares single-input, single-output models.")
    return np.asarray(keras.ops.convert_to_numpy(flat[0]))


def compare_outputs(model, inputs, run_exported, path, format, tolerance=None, fix=""):
    """Run the Keras model and the exported file (``run_exported(x) -> outputs``) on ``inputs``; an
    :class:`ExportResult` with ``max_abs_diff`` and (for class scores) ``argmax_agreement``.

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
        raise KerasdistError(
            f"export(format={format!r}, verify_with=...): the written file is far from the Keras model on "
            f"{len(x)} examples: max |diff| {result.max_abs_diff:.3g}{argmax}; the bound is {tolerance * scale:.3g} "
            f"(verify_tolerance={tolerance} x the output's max |y| {scale:.3g}). The file {path} was removed. "
            f"{fix}".rstrip())
    return result


def calibration_batches(representative_data, steps):
    """Yield lists of input arrays (one example each) from arrays, a tf.data.Dataset or a callable."""
    import keras
    import numpy as np

    from .plugin_tools import is_dataset

    if callable(representative_data):
        yield from representative_data()
        return
    if is_dataset(representative_data):
        for element in representative_data.take(steps):
            x = element[0] if isinstance(element, tuple) else element
            yield [np.asarray(a, dtype=np.float32) for a in keras.tree.flatten(x)]
        return
    arrays = [np.asarray(a, dtype=np.float32) for a in keras.tree.flatten(representative_data)]
    for i in range(min(steps, len(arrays[0]))):
        yield [a[i:i + 1] for a in arrays]


# -- models that learned their own int8 ranges -------------------------------------------------

TRACE_MODES = ("train", "float", "litert", "onnx")
_trace = threading.local()


def trace_mode():
    """How quantization-aware layers trace now: one of TRACE_MODES ("train" outside :func:`tracing`)."""
    return getattr(_trace, "mode", "train")


@contextlib.contextmanager
def tracing(mode):
    """Trace (convert) the model in ``mode`` inside the block: "float" leaves the fake quantization out,
    "litert" / "onnx" make the learned ranges constants in the ops that converter reads as int8."""
    if mode not in TRACE_MODES:
        raise KerasdistError(f"tracing(mode={mode!r}): choose one of {', '.join(map(repr, TRACE_MODES))}.")
    previous, _trace.mode = trace_mode(), mode
    try:
        yield
    finally:
        _trace.mode = previous


def quantization_aware_layers(model):
    """The layers of ``model`` (nested ones too) that learned int8 ranges (see the module docstring)."""
    from .plugin_tools import all_layers

    return [layer for layer in all_layers(model) if callable(getattr(layer, "kerasdist_quantization_ranges", None))]


def quantization_recipe(model):
    """The recipe ("litert", "tensorrt", ...) a quantization-aware model learned, or None for a float model."""
    return next((layer.kerasdist_quantization_recipe for layer in quantization_aware_layers(model)), None)


def check_ranges_learned(model, format):
    """Export needs learned ranges: a layer that never saw a training batch has none (NaN or +-inf)."""
    untrained = sorted(layer.name for layer in quantization_aware_layers(model)
                       if not all(math.isfinite(v)
                                  for pair in layer.kerasdist_quantization_ranges().values() for v in pair))
    if untrained:
        raise KerasdistError(
            f"export(format={format!r}): the quantization ranges of layers {untrained} were never learned (the model "
            "was compiled with quantize() but not trained); run fit first, at least one step.")


# -- converters of the TensorFlow backend, for models of the other backends ---------------------

#: The child process that converts: it loads the saved model with the TensorFlow backend and exports it.
_CHILD = """
import json, sys
import numpy as np
import kerasdist, keras
folder = sys.argv[1]
with open(folder + "/job.json") as f:
    job = json.load(f)
options = job["options"]
with np.load(folder + "/arrays.npz") as arrays:
    options.update({name: arrays[name] for name in arrays.files})
model = keras.saving.load_model(folder + "/model.keras", compile=False)
kerasdist.export(model, job["filepath"], format=job["format"], **options)
"""
_CLUSTER_VARIABLES = ("TF_CONFIG", "KERASDIST_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "XLA_FLAGS", "TORCHELASTIC_")
#: torchrun's (and kerasdist launch's) variables: the converting child is one process of no job
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT")


def convert_in_tensorflow(model, filepath, format, timeout=600, **options):
    """Write ``filepath`` in ``format`` with the TensorFlow backend's converter (tf2onnx, LiteRT's), for a
    model of the JAX or torch backend: the model is saved (``.keras``) and loaded in a child process with
    ``KERAS_BACKEND=tensorflow``, which runs ``kerasdist.export`` on it. Options are JSON values or numpy
    arrays; nothing is verified there (the caller compares the file with ``model`` itself)."""
    import json
    import subprocess
    import sys
    import tempfile

    import numpy as np

    arrays = {k: np.asarray(v) for k, v in options.items() if hasattr(v, "shape") or isinstance(v, (list, tuple))}
    plain = {k: v for k, v in options.items() if k not in arrays}
    for name, value in plain.items():
        if callable(value) or hasattr(value, "element_spec"):
            raise KerasdistError(
                f"export(format={format!r}, {name}=...): on the {_backend()} backend the file is converted by "
                f"TensorFlow in another process, which takes arrays only; give {name}= as a numpy array.")
    with tempfile.TemporaryDirectory(prefix="kerasdist-export-") as folder:
        try:
            model.save(os.path.join(folder, "model.keras"))
        except Exception as exc:
            raise KerasdistError(
                f"export(format={format!r}): on the {_backend()} backend the file is converted by TensorFlow from "
                f"the saved model, but model.save failed ({type(exc).__name__}: {exc}); make every custom layer "
                "serializable (keras.saving.register_keras_serializable, get_config).") from exc
        with open(os.path.join(folder, "job.json"), "w") as f:
            json.dump({"filepath": os.path.abspath(os.fspath(filepath)), "format": format, "options": plain}, f)
        np.savez(os.path.join(folder, "arrays.npz"), **arrays)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(_CLUSTER_VARIABLES) and k not in _TORCHRUN_VARIABLES}
        env.update(KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
        done = subprocess.run([sys.executable, "-c", _CHILD, folder], env=env, capture_output=True, text=True,
                              timeout=timeout)
    if done.returncode != 0:
        last = [line for line in done.stderr.strip().splitlines() if line.strip()][-12:]
        raise KerasdistError(
            f"export(format={format!r}): TensorFlow's converter, run on the saved {_backend()} model in another "
            f"process, failed (exit {done.returncode}):\n  " + "\n  ".join(last) + "\nA custom layer must be "
            "importable and registered (keras.saving.register_keras_serializable) for TensorFlow to load it; "
            "or train with KERAS_BACKEND=tensorflow.")
    return os.fspath(filepath)


def _backend():
    from .backend import keras_backend

    return keras_backend()
