"""Export and quantization-aware training on the JAX and torch backends (issue 36): the digits net of
tests/workers/qat_digits.py trained in one process per backend (tests/workers/export_backends.py), each
format written with verify_with= and run in onnxruntime / LiteRT."""

import importlib.util
import json
import os

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
