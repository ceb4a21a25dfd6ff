"""Export and quantization-aware training on the JAX and torch backends (issue 36): the digits net of
tests/workers/qat_digits.py trained in one process per backend (tests/workers/export_backends.py), each
format written with verify_with= and run in onnxruntime / LiteRT."""

import importlib.util
import json
import os

import numpy as np
import pytest

from helpers import ROOT, child_env, python, run

WORKER = os.path.join(ROOT, "tests", "workers", "export_backends.py")
BACKENDS = {
    # JAX: one process, 2 CPU devices; quantization-aware training under data_parallel (1x2)
    "jax": {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "EXPORT_BACKENDS_DISTRIBUTE": "data_parallel"},
    "torch": {"KERAS_BACKEND": "torch"},
}


@pytest.fixture(scope="module", params=[pytest.param("jax", marks=pytest.mark.extended), "torch"])  # JAX: extended
def results(request, tmp_path_factory):
    backend = request.param
    if importlib.util.find_spec(backend) is None or importlib.util.find_spec("onnxruntime") is None:
        pytest.skip(f"needs {backend} and onnxruntime (make test installs them)")
    out = str(tmp_path_factory.mktemp(backend) / "results.json")
    run(python(WORKER, out), timeout=900, env=child_env(**BACKENDS[backend]))
    with open(out) as f:
        return json.load(f)


def _case(results, name):
    case = results[name]
    assert "exception" not in case, case.get("traceback")
    print(results["backend"], name, {k: v for k, v in case.items() if k != "ranges"})
    return case


@pytest.mark.timeout(1000)
def test_float_onnx_matches_the_keras_model(results):
    case = _case(results, "float_onnx")
    assert case["max_abs_diff"] <= 1e-4 and case["agreement"] == 1.0
    assert case["onnx"] == case["keras"] >= 0.85  # 3 epochs: 0.94 (JAX), 0.90 (torch)


@pytest.mark.timeout(1000)
def test_onnx_int8_from_the_float_model_with_representative_data(results):
    case = _case(results, "onnx_int8_calibrated")
    assert case["agreement"] >= 0.97 and abs(case["onnx_int8"] - case["keras"]) <= 0.02


@pytest.mark.timeout(1000)
def test_litert_matches_the_keras_model(results):
    case = _case(results, "litert")
    assert case["max_abs_diff"] <= 1e-4 and case["agreement"] == 1.0


@pytest.mark.timeout(1000)
def test_a_generator_as_representative_data_is_refused_naming_arrays(results):
    case = _case(results, "generator_data_is_refused")
    assert case["error"] and "representative_data=" in case["error"] and "numpy array" in case["error"]


@pytest.mark.timeout(1000)
def test_quantization_aware_training_exports_int8_onnx_without_representative_data(results):
    case = _case(results, "qat_onnx")
    assert case["quantize_linear"] > 0 and case["dequantize_linear"] > 0
    assert case["qat_onnx"] >= case["float"] - 0.005, case  # within 0.5 pt of the float model, or better
    assert abs(case["qat_onnx"] - case["qat_keras"]) <= 0.005, case
    assert case["agreement"] >= 0.98


def test_exporters_and_quantization_declare_every_backend():
    import kerasdist
    from kerasdist.manager import get_system

    registry = get_system().registry
    for name, kinds in [("onnx", "export"), ("onnx-int8", "export"), ("litert", "export"),
                        ("litert-int8", "export"), ("quantize", "optimization"), ("tensorrt", "optimization")]:
        assert set(registry.get(name, kinds=(kinds,)).backends) == {"tensorflow", "jax", "torch"}, name
    assert kerasdist



def _stand_in_job(monkeypatch, rank, answer=None):
    """kerasdist.export sees a job of 2 processes (no process started): this process is ``rank``; the broadcast
    records what it was given and returns it (rank 0) or ``answer`` (rank 0's outcome, in another rank)."""
    from kerasdist import exporting

    heard = []

    def broadcast(value):
        heard.append(value)
        return value if rank == 0 else answer

    monkeypatch.setattr(exporting, "_job_processes", lambda: exporting._Processes(rank, 2, broadcast, "stand-in ranks"))
    return heard


def _small_model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_export_called_in_every_rank_returns_rank_0s_result_or_error_in_the_others(monkeypatch, tmp_path):
    """kerasdist.export in rank 1 of a job: it saves the model (a collective where weights are sharded), writes no
    file, and returns rank 0's result, or raises rank 0's error naming it."""
    import kerasdist
    from kerasdist import exporting

    model, path = _small_model(), str(tmp_path / "m.onnx")
    sentinel = exporting.ExportResult(path, "onnx", 1)
    _stand_in_job(monkeypatch, 1, ("ok", sentinel))
    assert kerasdist.export(model, path, format="onnx") is sentinel and not os.path.exists(path)
    _stand_in_job(monkeypatch, 1, ("error", "KerasdistError: the folder is gone"))
    with pytest.raises(kerasdist.KerasdistError, match="rank 0, which writes .*m.onnx for every rank, failed: "
                                                       "KerasdistError: the folder is gone"):
        kerasdist.export(model, path, format="onnx")


def test_export_called_in_every_rank_writes_in_rank_0_a_plain_copy(monkeypatch, tmp_path):
    """Rank 0 of a job (stand-in): it exports a plain copy of the model and broadcasts its result, or its error."""
    import kerasdist

    if importlib.util.find_spec("tf2onnx") is None or importlib.util.find_spec("onnxruntime") is None:
        pytest.skip("needs tf2onnx and onnxruntime (make test installs them)")
    model, path = _small_model(), str(tmp_path / "m.onnx")
    heard = _stand_in_job(monkeypatch, 0)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    result = kerasdist.export(model, path, format="onnx", verify_with=x)
    assert os.path.exists(path) and result.max_abs_diff <= 1e-6 and heard[-1] == ("ok", result)
    with pytest.raises(kerasdist.KerasdistError, match="does not exist"):  # rank 0 raises its own error
        kerasdist.export(model, str(tmp_path / "gone" / "m.onnx"), format="onnx")
    assert heard[-1][0] == "error" and "does not exist" in heard[-1][1]
