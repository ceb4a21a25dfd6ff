"""ONNX exports run in onnxruntime; TensorRT up to the GPU boundary (a fake tensorrt module at the
builder), and a real engine build on an NVIDIA GPU (skipped here)."""

import json
import os
import platform
import shutil
import subprocess
import sys
import types

import keras
import numpy as np
import onnx
import pytest

import kerasdist
import kerasdist.registry
from kerasdist_plugins.export import onnx as onnx_plugin, tensorrt as trt_plugin
from helpers import ROOT
from runif import run_if

QEMU = shutil.which("qemu-x86_64")
AVX2_CPU = "Haswell"  # QEMU's model of an AVX2 + FMA CPU without AVX-512 or VNNI (QEMU >= 7.2 emulates AVX2)
HASWELL_FLAGS = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}  # /proc/cpuinfo flags of such a CPU
RUN_ONNX = os.path.join(ROOT, "tests", "workers", "onnxruntime_run.py")


@pytest.fixture(scope="module")
def data():
    return np.random.default_rng(0).normal(size=(128, 10, 10, 1)).astype("float32")


@pytest.fixture(scope="module")
def model(data):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10, 10, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(loss="mse", optimizer="sgd", distribute="mirrored")
    model.fit(data, np.zeros((128, 10), "float32"), batch_size=32, epochs=1, verbose=0)
    return model


def test_onnx_runs_in_onnxruntime_like_keras(model, data, tmp_path):
    result = kerasdist.export(model, tmp_path / "m.onnx", format="onnx", verify_with=data[:64])
    print(f"\nonnx: {result.size_bytes} B, max|delta| {result.max_abs_diff:.3g}, argmax {result.argmax_agreement}")
    assert result.max_abs_diff < 1e-5 and result.argmax_agreement == 1.0
    graph = onnx.load(result.path).graph
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param  # dynamic batch


def test_onnx_int8_is_qdq_and_runs_in_onnxruntime(model, data, tmp_path):
    result = kerasdist.export(model, tmp_path / "q.onnx", format="onnx-int8", representative_data=data[:64],
                              verify_with=data[64:])
    reference = np.max(np.abs(model(data[64:]).numpy()))
    print(f"\nonnx-int8: {result.size_bytes} B, max|delta| {result.max_abs_diff:.3g} (max|y| {reference:.3g}), "
          f"argmax {result.argmax_agreement}")
    ops = {node.op_type for node in onnx.load(result.path).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert result.max_abs_diff < 0.1 * reference and result.argmax_agreement >= 0.9


def _need_qemu():
    """Skip (on a non-x86 host, or locally without qemu) or fail (without qemu where CI is set)."""
    if platform.machine() != "x86_64":
        pytest.skip(f"the AVX2 path is emulated on x86_64 hosts only (this is {platform.machine()})")
    if QEMU is None:
        reason = "qemu-x86_64 is not installed: apt-get install -y qemu-user (Debian/Ubuntu)"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)  # CI must run the AVX2 path


def _zero_point_types(path):
    """The element types of the activations' and weights' zero points (biases are int32)."""
    return {i.data_type for i in onnx.load(path).graph.initializer
            if i.name.endswith("zero_point") and i.data_type != onnx.TensorProto.INT32}


def run_on_avx2_cpu(path, x, tmp_path):
    """Outputs of the ONNX file from onnxruntime on an emulated AVX2 CPU without AVX-512/VNNI."""
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run([QEMU, "-cpu", AVX2_CPU, sys.executable, RUN_ONNX, os.fspath(path),
                           os.fspath(tmp_path / "x.npy"), os.fspath(tmp_path / "y.npy")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    features = json.loads(proc.stdout.strip().splitlines()[-1])
    assert features["AVX2"] and features["FMA3"] and not features["AVX512F"], features  # the emulated CPU
    return np.load(tmp_path / "y.npy")


def test_onnx_int8_auto_is_right_on_an_avx2_cpu_without_vnni(model, data, tmp_path, monkeypatch):
    """'auto' on an AVX2 CPU writes u8u8, exact in onnxruntime's AVX2 kernels; s8s8 saturates there."""
    _need_qemu()
    x, expected = data[64:], model(data[64:]).numpy()
    reference = np.max(np.abs(expected))
    monkeypatch.setattr(onnx_plugin.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(onnx_plugin, "cpu_flags", lambda: HASWELL_FLAGS)
    auto = kerasdist.export(model, tmp_path / "auto.onnx", format="onnx-int8", representative_data=data[:64])
    assert _zero_point_types(auto.path) == {onnx.TensorProto.UINT8}
    emulated, native = run_on_avx2_cpu(auto.path, x, tmp_path), onnx_plugin.run_onnxruntime(auto.path, x)
    diff, argmax = np.max(np.abs(emulated - expected)), np.mean(emulated.argmax(-1) == expected.argmax(-1))
    print(f"\nAVX2 u8u8: max|delta| {diff:.3g} (max|y| {reference:.3g}), argmax {argmax:.3f}")
    assert np.max(np.abs(emulated - native)) < 1e-5 * reference  # the AVX2 kernels compute what the native ones do
    assert diff < 0.1 * reference and argmax >= 0.95

    s8s8 = kerasdist.export(model, tmp_path / "s8s8.onnx", format="onnx-int8", representative_data=data[:64],
                            int8_scheme="s8s8")
    saturated = np.max(np.abs(run_on_avx2_cpu(s8s8.path, x, tmp_path) - expected))
    print(f"AVX2 s8s8: max|delta| {saturated:.3g}")
    assert saturated > 0.1 * reference, "onnxruntime's AVX2 U8S8 kernels no longer saturate: revisit auto_int8_scheme"


@pytest.mark.parametrize("machine, flags, scheme", [
    ("x86_64", HASWELL_FLAGS, "u8u8"),
    ("x86_64", HASWELL_FLAGS | {"avx512f", "avx512bw"}, "u8u8"),  # Skylake-SP: AVX-512 without VNNI
    ("x86_64", HASWELL_FLAGS | {"avx512f", "avx512_vnni"}, "s8s8"),
    ("AMD64", HASWELL_FLAGS | {"avx_vnni"}, "s8s8"),
    ("aarch64", set(), "s8s8"),
])
def test_auto_int8_scheme_reads_the_cpu_flags(machine, flags, scheme):
    assert onnx_plugin.auto_int8_scheme(machine, flags)[0] == scheme


def test_cpu_flags_from_cpuinfo(tmp_path, monkeypatch):
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert onnx_plugin.cpu_flags(str(tmp_path / "cpuinfo")) == {"fpu", "avx2", "fma"}
    assert onnx_plugin.cpu_flags(str(tmp_path / "absent")) is None
    monkeypatch.setattr(onnx_plugin, "cpu_flags", lambda: None)
    assert onnx_plugin.auto_int8_scheme("x86_64")[0] == "u8u8"  # unknown x86: the scheme exact on all of them


def _scale_up_the_dense_weights(real_quantize_qdq):
    """quantize_qdq, then the Dense layer's weight scale x4 in the written file: a file far off."""
    from onnx import numpy_helper

    def quantize_qdq(float_path, int8_path, *args, **kwargs):
        real_quantize_qdq(float_path, int8_path, *args, **kwargs)
        model = onnx.load(int8_path)
        matmul = next(n for n in model.graph.node if n.op_type == "MatMul")
        weights = next(n for n in model.graph.node if n.output[0] == matmul.input[1])
        scale = next(i for i in model.graph.initializer if i.name == weights.input[1])
        scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 4, scale.name))
        onnx.save(model, int8_path)
        return int8_path

    return quantize_qdq


def test_onnx_int8_far_off_is_an_error_not_a_result(model, data, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_plugin, "quantize_qdq", _scale_up_the_dense_weights(onnx_plugin.quantize_qdq))
    with pytest.raises(kerasdist.KerasdistError, match=(
            r"far from the Keras model on 64 examples: max \|diff\| [0-9.]+, argmax agreement [0-9.]+; the bound is "
            r"[0-9.]+ \(verify_tolerance=0.1 x the output's max \|y\| 1.53\)\. The file .*q.onnx was removed\. "
            r"It was quantized with int8_scheme '(s8s8|u8u8)' .*Fixes: .*verify_tolerance=")):
        kerasdist.export(model, tmp_path / "q.onnx", format="onnx-int8", representative_data=data[:64],
                         verify_with=data[64:])
    assert not (tmp_path / "q.onnx").exists()
    loose = kerasdist.export(model, tmp_path / "q.onnx", format="onnx-int8", representative_data=data[:64],
                             verify_with=data[64:], verify_tolerance=10)
    assert loose.max_abs_diff > 0.1 * np.max(np.abs(model(data[64:]).numpy()))


@pytest.mark.parametrize("options, message", [
    ({"int8_scheme": "int4"}, r"int8_scheme='int4' is not valid; choose one of 'auto', 's8s8', 'u8u8', 's8s8-7bit'"),
    ({"verify_tolerance": 0}, r"verify_tolerance=0 is not valid; give a number > 0"),
    ({"verify_tolerance": "1%"}, r"verify_tolerance='1%' is not valid"),
])
def test_onnx_int8_bad_options_fail_early(model, data, tmp_path, options, message):
    with pytest.raises(kerasdist.KerasdistError, match=message):
        kerasdist.export(model, tmp_path / "q.onnx", format="onnx-int8", representative_data=data[:8], **options)
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("scheme", ["s8s8", "u8u8", "s8s8-7bit"])
def test_each_int8_scheme_is_close_to_keras_here(model, data, tmp_path, scheme):
    """Each scheme is right on this CPU; "s8s8" is the one with signed int8 zero points TensorRT reads."""
    if scheme == "s8s8" and onnx_plugin.auto_int8_scheme()[0] != "s8s8":
        pytest.skip("s8s8 saturates in onnxruntime on this x86 CPU without VNNI (the AVX2 test covers it)")
    result = kerasdist.export(model, tmp_path / "q.onnx", format="onnx-int8", representative_data=data[:64],
                              verify_with=data[64:], int8_scheme=scheme)
    print(f"\n{scheme}: max|delta| {result.max_abs_diff:.3g}, argmax {result.argmax_agreement}")
    assert _zero_point_types(result.path) == {onnx.TensorProto.UINT8 if scheme == "u8u8" else onnx.TensorProto.INT8}


def test_missing_converter_dependency_is_one_clear_error(model, tmp_path, monkeypatch):
    real = kerasdist.plugin_entry._module_exists
    monkeypatch.setattr(kerasdist.plugin_entry, "_module_exists", lambda name: name != "tf2onnx" and real(name))
    with pytest.raises(kerasdist.PluginUnavailableError,
                       match=r"'onnx' cannot run here: needs tf2onnx \(not installed\): pip install 'kerasdist\[onnx"):
        kerasdist.export(model, tmp_path / "m.onnx", format="onnx")


def test_onnx_int8_without_data_fails_early(model, tmp_path):
    with pytest.raises(kerasdist.KerasdistError, match="'onnx-int8'.*needs representative_data="):
        kerasdist.export(model, tmp_path / "q.onnx", format="onnx-int8")


# -- TensorRT ----------------------------------------------------------------------

def test_tensorrt_listed_unavailable_with_the_reason():
    row = next(r for r in kerasdist.list_plugins() if r["name"] == "tensorrt")
    assert row["kind"] == "export"
    if trt_plugin.tensorrt_absent_reason() is not None:
        assert row["available"] is False and "no NVIDIA GPU here" in row["reason"]


@pytest.mark.skipif(trt_plugin.tensorrt_absent_reason() is None, reason="this machine can build engines")
def test_tensorrt_export_without_gpu_is_a_clear_error(model, tmp_path):
    with pytest.raises(kerasdist.PluginUnavailableError, match="'tensorrt' cannot run here: no NVIDIA GPU here"):
        kerasdist.export(model, tmp_path / "m.engine", format="tensorrt")


def test_absent_reason_sees_gpu_devices_and_the_package(tmp_path, monkeypatch):
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(trt_plugin.importlib.util, "find_spec", lambda name: object())
    assert trt_plugin.tensorrt_absent_reason(str(tmp_path / "nvidia[0-9]*")) is None
    monkeypatch.setattr(trt_plugin.importlib.util, "find_spec", lambda name: None)
    assert "pip install 'kerasdist[tensorrt]'" in trt_plugin.tensorrt_absent_reason(str(tmp_path / "nvidia[0-9]*"))
    assert "no NVIDIA GPU" in trt_plugin.tensorrt_absent_reason(str(tmp_path / "none*"))


def _fake_tensorrt(calls, parse_ok=True):
    """The tensorrt API surface build_engine uses; the network's inputs come from the real ONNX bytes."""

    class Network:
        def __init__(self):
            self.inputs = []

        num_inputs = property(lambda self: len(self.inputs))

        def get_input(self, i):
            return self.inputs[i]

    class Parser:
        num_errors = 1

        def __init__(self, network, logger):
            self.network = network

        def parse(self, data):
            graph = onnx.load_from_string(data).graph
            calls["onnx_ops"] = {node.op_type for node in graph.node}
            for tensor in graph.input:
                dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.type.tensor_type.shape.dim]
                self.network.inputs.append(types.SimpleNamespace(name=tensor.name, shape=tuple(dims)))
            return parse_ok

        def get_error(self, i):
            return "In node 3: unsupported op"

    class Config:
        def set_flag(self, flag):
            calls.setdefault("flags", []).append(flag)

        def set_memory_pool_limit(self, pool, size):
            calls["workspace"] = size

        def add_optimization_profile(self, profile):
            calls["profile"] = profile.shapes

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, low, opt, high):
            self.shapes[name] = (low, opt, high)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            calls["network_flags"] = flags
            return Network()

        create_builder_config = staticmethod(Config)
        create_optimization_profile = staticmethod(Profile)

        def build_serialized_network(self, network, config):
            return b"fake-engine"

    return types.SimpleNamespace(
        __version__="10.9.0", Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
        Builder=Builder, OnnxParser=Parser, BuilderFlag=types.SimpleNamespace(FP16="FP16", INT8="INT8"),
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="WORKSPACE"))


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_engine_build_up_to_the_gpu(model, data, tmp_path, monkeypatch, precision):
    """Everything before the GPU is real (ONNX, QDQ, shapes, flags); the fake stands in for tensorrt."""
    calls = {}
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(calls))
    result = trt_plugin.export_tensorrt(model, tmp_path / "m.engine", precision=precision, max_batch=32,
                                        workspace_bytes=1 << 28,
                                        representative_data=data[:32] if precision == "int8" else None)
    assert open(result.path, "rb").read() == b"fake-engine" and result.size_bytes == 11
    assert calls["network_flags"] == 0 and calls["workspace"] == 1 << 28
    assert calls["flags"] == [precision.upper()]
    assert list(calls["profile"].values()) == [((1, 10, 10, 1), (8, 10, 10, 1), (32, 10, 10, 1))]
    assert ("QuantizeLinear" in calls["onnx_ops"]) == (precision == "int8")


def test_engine_build_errors(model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt({}, parse_ok=False))
    with pytest.raises(kerasdist.KerasdistError, match="cannot parse the ONNX model: In node 3: unsupported op"):
        trt_plugin.export_tensorrt(model, tmp_path / "m.engine")
    with pytest.raises(kerasdist.KerasdistError, match="precision='int4' is not valid; choose one of fp32, fp16, int8"):
        trt_plugin.export_tensorrt(model, tmp_path / "m.engine", precision="int4")
    with pytest.raises(kerasdist.KerasdistError, match="'tensorrt'\\) needs representative_data="):
        trt_plugin.export_tensorrt(model, tmp_path / "m.engine", precision="int8")
    assert not (tmp_path / "m.engine").exists()


@run_if(nvidia_gpu=True)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_real_engine_builds_and_deserializes_on_an_nvidia_gpu(model, data, tmp_path, precision):
    import tensorrt as trt

    result = kerasdist.export(model, tmp_path / "m.engine", format="tensorrt", precision=precision,
                              representative_data=data[:64] if precision == "int8" else None)
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(open(result.path, "rb").read())
    assert engine is not None and engine.num_io_tensors == 2
    assert tuple(engine.get_tensor_shape(engine.get_tensor_name(0)))[1:] == (10, 10, 1)
    assert os.path.getsize(result.path) > 0


@run_if(nvidia_gpu=True)
def test_int8_engine_from_a_tensorrt_qat_model_needs_no_representative_data(data, tmp_path):
    import keras
    import tensorrt as trt

    keras.utils.set_random_seed(0)
    qat_model = keras.Sequential([keras.Input((10, 10, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                                  keras.layers.Flatten(), keras.layers.Dense(4)])
    qat_model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.tensorrt(sparsity="2:4"))
    qat_model.fit(data[:64], np.zeros((64, 4), "float32"), batch_size=16, epochs=1, verbose=0)
    result = kerasdist.export(qat_model, tmp_path / "qat.engine", format="tensorrt", precision="int8")
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(open(result.path, "rb").read())
    assert engine is not None and engine.num_io_tensors == 2
