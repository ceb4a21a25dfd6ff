"""LiteRT exports: each variant converted, run in the LiteRT interpreter and compared with Keras."""

import os
import sys

import keras
import numpy as np
import pytest

import kerasdist
from kerasdist_plugins import pruning

FIGURES = {}  # printed at the end of the module with -s: size, max |delta|, argmax agreement


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 12, 12, 1)).astype("float32")
    return x, (x[:, :6].mean(axis=(1, 2, 3)) > x[:, 6:].mean(axis=(1, 2, 3))).astype("int32") * 5 + \
        rng.integers(0, 5, size=256)


@pytest.fixture(scope="module")
def classifier(data):
    """A small conv net trained for a few steps on 2 CPU replicas."""
    x, y = data
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12, 12, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="adam",
                  distribute="mirrored")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model


# (format, options, size at most this fraction of float, max |delta| at most this fraction of max |y|,
#  argmax agreement at least)
VARIANTS = [
    ("litert", {}, 1.0, 1e-5, 1.0),
    ("litert-dynamic", {}, 0.30, 0.05, 0.95),
    ("litert-float16", {}, 0.55, 0.01, 0.98),
    ("litert-int8", {"representative_data": "x"}, 0.30, 0.1, 0.9),
    ("litert-int8", {"representative_data": "x", "int8_io": True}, 0.30, 0.1, 0.9),
]


@pytest.mark.parametrize("format,options,size_ratio,error_ratio,agreement", VARIANTS,
                         ids=["float", "dynamic", "float16", "int8", "int8-io"])
def test_litert_variant_runs_in_the_interpreter_close_to_keras(classifier, data, tmp_path, format, options,
                                                                 size_ratio, error_ratio, agreement):
    x, _ = data
    options = {k: (x[:100] if v == "x" else v) for k, v in options.items()}
    result = kerasdist.export(classifier, tmp_path / "m.tflite", format=format, verify_with=x[-64:], **options)
    reference = np.max(np.abs(classifier(x[-64:]).numpy()))
    float_size = 4 * classifier.count_params()
    FIGURES[(format, bool(options.get("int8_io")))] = (result.size_bytes, result.max_abs_diff,
                                                       result.argmax_agreement, reference)
    assert os.fspath(result) == str(tmp_path / "m.tflite") and os.path.getsize(result) == result.size_bytes
    assert result.samples_checked == 64
    assert result.size_bytes <= size_ratio * float_size + 8192
    assert result.max_abs_diff <= error_ratio * reference
    assert result.argmax_agreement >= agreement


def test_pruned_mirrored_model_exports_with_its_zeros(data, tmp_path):
    """The whole path: prune under 2 replicas, then full-int8 LiteRT; pruned weights stay zero."""
    x, y = data
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((12, 12, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="adam",
                  distribute=kerasdist.mirrored() + kerasdist.prune(target_sparsity=0.75, schedule="constant"))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert list(pruning.sparsity(model).values()) == [0.75, 0.75]
    result = kerasdist.export(model, tmp_path / "p.tflite", format="litert", verify_with=x[:32])
    assert result.max_abs_diff < 1e-5 and result.argmax_agreement == 1.0


def test_int8_without_representative_data_fails_before_converting(classifier, tmp_path):
    with pytest.raises(kerasdist.KerasdistError, match="litert-int8.*needs representative_data=.*litert-dynamic"):
        kerasdist.export(classifier, tmp_path / "m.tflite", format="litert-int8")
    assert not (tmp_path / "m.tflite").exists()


def test_int8_options_on_other_formats_are_rejected(classifier, data, tmp_path):
    with pytest.raises(kerasdist.KerasdistError, match="options of format='litert-int8' only"):
        kerasdist.export(classifier, tmp_path / "m.tflite", format="litert-dynamic", representative_data=data[0])


def test_missing_litert_interpreter_names_the_extra(classifier, data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ai_edge_litert.interpreter", None)  # import now fails
    with pytest.raises(kerasdist.PluginUnavailableError,
                       match=r"module 'ai_edge_litert.interpreter'.*pip install 'kerasdist\[litert\]'"):
        kerasdist.export(classifier, tmp_path / "m.tflite", format="litert", verify_with=data[0][:4])
    assert not (tmp_path / "m.tflite").exists()


def test_unbuilt_and_keras_quantized_models_are_refused(tmp_path):
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(kerasdist.KerasdistError, match="is not built"):
        kerasdist.export(unbuilt, tmp_path / "u.tflite", format="litert")
    quantized = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    quantized.quantize("int8")
    with pytest.raises(kerasdist.KerasdistError, match="quantized with model.quantize\\(\\).*Export the float model"):
        kerasdist.export(quantized, tmp_path / "q.tflite", format="litert-dynamic")


def test_formats_are_listed():
    rows = {r["name"]: r for r in kerasdist.list_plugins() if r["kind"] == "export"}
    for name in ("litert", "litert-dynamic", "litert-float16", "litert-int8"):
        assert rows[name]["available"], rows[name]


def teardown_module():
    for (format, int8_io), (size, delta, agreement, reference) in sorted(FIGURES.items()):
        print(f"\n{format}{' int8-io' if int8_io else ''}: {size} B, max|delta| {delta:.3g} "
              f"(max|y| {reference:.3g}), argmax agreement {agreement:.3f}", end="")


# -- the exporters' plugin names and module paths (renamed for what they write) -------------------

@pytest.mark.parametrize("variable, value, gone, kept", [
    ("KERASDIST_DISABLE_PLUGINS", "quantization", {"litert", "litert-int8"}, {"onnx", "onnx-int8"}),
    ("KERASDIST_DISABLE_PLUGINS", "tensorrt", {"onnx", "onnx-int8", "tensorrt"}, {"litert", "litert-int8"}),
    ("KERASDIST_DISABLE_PLUGINS", "litert", {"litert", "litert-dynamic"}, {"onnx", "tensorrt"}),
    ("KERASDIST_LOAD_PLUGINS", "quantization", {"onnx", "tensorrt"}, {"litert", "litert-float16"}),
])
def test_the_old_plugin_names_still_select_the_renamed_exporters(variable, value, gone, kept):
    from kerasdist.manager import PluginSystem

    formats = set(PluginSystem(environ={variable: value}).registry.names(("export",)))
    assert not gone & formats and kept <= formats


def test_the_old_module_paths_are_aliases_of_the_exporter_plugins():
    import kerasdist.exporting
    from kerasdist_plugins import quantization, tensorrt
    from kerasdist_plugins.export import litert, onnx, tensorrt as tensorrt_exporter

    assert quantization.run_litert is litert.run_litert and quantization.LITERT_FORMATS is litert.LITERT_FORMATS
    assert quantization.compare_outputs is kerasdist.exporting.compare_outputs
    assert tensorrt.quantize_qdq is onnx.quantize_qdq
    assert tensorrt.tensorrt_absent_reason is tensorrt_exporter.tensorrt_absent_reason
    assert not hasattr(quantization, "kerasdist_register_exporters")  # an alias, never a second plugin


def test_tracing_names_the_valid_modes():
    from kerasdist.exporting import TRACE_MODES, trace_mode, tracing

    with pytest.raises(kerasdist.KerasdistError, match=r"tracing\(mode='int4'\): choose one of 'train', 'float', "
                                                       r"'litert', 'onnx'"):
        with tracing("int4"):
            pass
    with tracing("onnx"):
        assert trace_mode() == "onnx"
    assert trace_mode() == "train" and TRACE_MODES[0] == "train"
