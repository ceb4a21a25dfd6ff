"""An exporter written as a third-party package, pip-installed into a temporary folder (never into the venv),
found through its entry point, and built only on kerasdist's public export toolkit (kerasdist.exporting):
require, check_exportable, need_representative_data, calibration_batches and compare_outputs. It writes a
file that numpy alone runs (int8 weights per output channel, the input range calibrated), verified
against the Keras model."""

import json
import textwrap

import numpy as np
import pytest

from tests.helpers import child_env, python, run
from tests.test_plugin_loading import _pip_install_package

EXPORTER = '''
"""numpy-mlp: a Dense-only Keras model as an .npz that numpy alone runs (int8 weights per output channel)."""

import functools
import os

import kerasdist
from kerasdist.exporting import (ExportResult, calibration_batches, check_exportable, compare_outputs,
                                 need_representative_data, require)

FORMAT = "numpy-mlp"
ACTIVATIONS = ("linear", "relu")


def run_npz(path, x):
    """The written file on ``x``, in numpy only."""
    np = require("numpy", "numpy", "Running a numpy-mlp file")
    weights = np.load(path)
    low, high = weights["input_range"]
    x = np.clip(np.asarray(x, dtype=np.float32), low, high)
    for i in range(int(weights["layers"])):
        x = x @ (weights[f"w{i}"].astype(np.float32) * weights[f"s{i}"]) + weights[f"b{i}"]
        if str(weights[f"a{i}"]) == "relu":
            x = np.maximum(x, 0.0)
    return x


def export_numpy_mlp(model, filepath, *, representative_data=None, calibration_steps=100, verify_with=None,
                     verify_tolerance=0.05):
    check_exportable(model, FORMAT, filepath, verify_with, representative_data)
    need_representative_data(FORMAT, representative_data, "the input range")
    np = require("numpy", "numpy", f"export(format={FORMAT!r})")
    import keras

    bad = [layer.name for layer in model.layers if not isinstance(layer, keras.layers.Dense)
           or layer.activation.__name__ not in ACTIVATIONS]
    if bad:
        raise kerasdist.KerasdistError(f"export(format={FORMAT!r}): layers {bad} are not Dense with activation "
                                       f"{' or '.join(ACTIVATIONS)}.")
    arrays = {"layers": np.array(len(model.layers))}
    for i, layer in enumerate(model.layers):
        kernel = np.asarray(keras.ops.convert_to_numpy(layer.kernel), dtype=np.float32)
        scale = np.maximum(np.abs(kernel).max(axis=0), 1e-12) / 127.0
        arrays.update({f"w{i}": np.round(kernel / scale).astype(np.int8), f"s{i}": scale.astype(np.float32),
                       f"b{i}": np.asarray(keras.ops.convert_to_numpy(layer.bias), dtype=np.float32),
                       f"a{i}": np.array(layer.activation.__name__)})
    batches = [batch[0] for batch in calibration_batches(representative_data, calibration_steps)]
    arrays["input_range"] = np.array([min(b.min() for b in batches), max(b.max() for b in batches)], np.float32)
    with open(filepath, "wb") as f:
        np.savez(f, **arrays)
    if verify_with is None:
        return ExportResult(os.fspath(filepath), FORMAT, os.path.getsize(filepath))
    return compare_outputs(model, verify_with, functools.partial(run_npz, os.fspath(filepath)), os.fspath(filepath),
                           FORMAT, verify_tolerance, "Give more typical representative_data=.")


@kerasdist.hookimpl
def kerasdist_register_exporters(register):
    register(FORMAT, export_numpy_mlp, requires=("numpy",), backends=(),
             description="Dense-only model as an .npz that numpy runs (int8 weights per output channel).")
'''

EXPORT = """
import json, sys, numpy as np, keras, kerasdist
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
x = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
result = kerasdist.export(model, sys.argv[1], format="numpy-mlp", representative_data=x[:64], verify_with=x[64:])
np.save(sys.argv[1] + ".x.npy", x[64:])
np.save(sys.argv[1] + ".y.npy", keras.ops.convert_to_numpy(model(x[64:])))
try:
    kerasdist.export(model, sys.argv[1] + ".2", format="numpy-mlp")
except kerasdist.KerasdistError as exc:
    missing = str(exc)
row = next(r for r in kerasdist.list_plugins() if r["name"] == "numpy-mlp")
print("RESULT", json.dumps({"path": result.path, "format": result.format, "max_abs_diff": result.max_abs_diff,
                            "samples": result.samples_checked, "missing_data": missing, "package": row["package"],
                            "plugin": row["plugin"], "kind": row["kind"]}))
"""


@pytest.fixture
def installed_exporter(tmp_path):
    """The package built and pip-installed into a --target folder (its entry point in a .dist-info there)."""
    site = _pip_install_package(tmp_path, "kerasdist-numpy-exporter", textwrap.dedent(EXPORTER),
                                {"numpy_mlp": "kerasdist_numpy_exporter"})
    assert list(site.glob("kerasdist_numpy_exporter-*.dist-info/entry_points.txt"))
    return site


@pytest.mark.timeout(600)
def test_a_third_party_exporter_reuses_the_export_toolkit_and_writes_a_verified_file(installed_exporter, tmp_path):
    path = tmp_path / "mlp.npz"
    out = run(python("-c", EXPORT, str(path)), timeout=300, env=child_env(PYTHONPATH=str(installed_exporter))).stdout
    result = json.loads(out.split("RESULT", 1)[1])
    assert result["package"] == "kerasdist-numpy-exporter" and result["plugin"] == "numpy_mlp"
    assert result["kind"] == "export" and result["format"] == "numpy-mlp" and result["samples"] == 32
    assert "export(format='numpy-mlp') needs representative_data=" in result["missing_data"]  # the shared check
    expected = np.load(f"{path}.y.npy")
    assert 0 < result["max_abs_diff"] < 0.02 * np.abs(expected).max()  # int8 weights: close, not equal

    # the file itself, read here with numpy alone (no kerasdist, no keras), gives the same figures
    weights = np.load(path)
    x = np.clip(np.load(f"{path}.x.npy"), *weights["input_range"])
    for i in range(int(weights["layers"])):
        assert weights[f"w{i}"].dtype == np.int8
        x = x @ (weights[f"w{i}"].astype(np.float32) * weights[f"s{i}"]) + weights[f"b{i}"]
        x = np.maximum(x, 0) if str(weights[f"a{i}"]) == "relu" else x
    assert np.max(np.abs(x - expected)) == pytest.approx(result["max_abs_diff"], rel=1e-5)
