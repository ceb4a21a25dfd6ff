"""distribute=[..., kerasdist.quantize()]: int8 quantization-aware training, its exports, and the oracles.

Accuracy numbers come from tests/workers/qat_digits.py (scikit-learn's bundled digits); TFMOT's own
QAT runs in a separate process (tests/workers/tfmot_oracle.py) because importing it switches tf.keras
to Keras 2.
"""

import collections
import importlib.util
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kerasdist
from kerasdist_plugins import qat
from runif import run_if

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "workers"))
import qat_digits  # noqa: E402


def _replica_values(variable):
    value = variable.value
    return [v.numpy() for v in value.values] if hasattr(value, "values") else [value.numpy()]


def _small_net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(8, 3, activation="relu"),
                             keras.layers.DepthwiseConv2D(3, activation="relu"), keras.layers.Flatten(),
                             keras.layers.Dense(4)])


def _small_data(n=64):
    rng = np.random.default_rng(3)
    return rng.normal(size=(n, 6, 6, 2)).astype("float32"), rng.integers(0, 4, size=(n,)).astype("int32")


def _train_small(distribute, epochs=3):
    x, y = _small_data()
    model = _small_net()
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(0.05), distribute=distribute)
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model


# -- Must show 1: accuracy on real data, exported file agreement -------------------------------

@pytest.mark.slow
def test_qat_on_digits_stays_within_half_a_point_of_float_in_the_litert_file(tmp_path):
    result = qat_digits.run("per_channel", folder=str(tmp_path), seed=3)
    print(result)
    # The float bar only says the float model learned (else "QAT within half a point of float" proves
    # nothing); float kernels differ between CPUs and 20 epochs amplify it. Measured float accuracies
    # (python tests/workers/qat_digits.py --seed N): seeds 1-8 on AVX-512/VNNI 0.982-0.995 (seed 3: 0.992),
    # the same with ONEDNN_MAX_CPU_ISA=AVX2 0.982-0.990, on an AVX2-only EPYC seed 1 0.965, seeds 2-6
    # 0.985-0.992. 0.95 sits 1.5 points under the lowest. The claim itself holds on every seed measured:
    # QAT int8 minus float from -0.25 to +0.75 points (bound -0.5).
    assert result["float"] >= 0.95
    assert result["qat_int8"] >= result["float"] - 0.005
    assert result["qat_agreement"] >= 0.99
    assert result["sizes"]["qat_int8"] < result["sizes"]["float"] / 1.8


@pytest.mark.slow
def test_qat_recovers_what_per_tensor_post_training_int8_loses(tmp_path):
    result = qat_digits.run("per_tensor", folder=str(tmp_path), imbalanced=True, qat_epochs=20,
                            qat_learning_rate=0.002)
    print(result)
    assert result["ptq_int8"] < result["float"] - 0.01  # post-training per-tensor int8 loses > 1 point
    assert result["qat_int8"] > result["ptq_int8"] + 0.05
    assert result["qat_agreement"] >= 0.99


# -- Must show 2: replicas ------------------------------------------------------------------

def test_mirrored_qat_equals_single_device_qat_and_replicas_hold_identical_ranges():
    single = _train_small([kerasdist.quantize()])
    mirrored = _train_small(["mirrored", kerasdist.quantize()])
    assert mirrored.distribute_strategy.num_replicas_in_sync == 2
    for a, b in zip(single.weights, mirrored.weights):
        assert a.path.split("/")[-1] == b.path.split("/")[-1]
        replicas = _replica_values(b)
        assert all(np.array_equal(replicas[0], r) for r in replicas), b.path
        np.testing.assert_allclose(a.numpy(), replicas[0], atol=1e-5, err_msg=b.path)
    single_ranges, mirrored_ranges = list(qat.ranges(single).values()), list(qat.ranges(mirrored).values())
    assert [list(pairs) for pairs in single_ranges] == [["input", "output"], ["output"], ["output"]]
    for pairs, mirrored_pairs in zip(single_ranges, mirrored_ranges):
        for where, pair in pairs.items():
            np.testing.assert_allclose(pair, mirrored_pairs[where], atol=1e-5)
            assert all(np.isfinite(pair))


@pytest.mark.slow
def test_multiworker_qat_equals_one_process_and_workers_hold_identical_ranges(tmp_path):
    """The equivalence script with --quantize: one process vs `kerasdist launch -n 2` (two real processes)."""
    from helpers import PYTHON, child_env, run

    kerasdist_command = os.path.join(os.path.dirname(PYTHON), "kerasdist")
    script = os.path.join(HERE, "workers", "equivalence_script.py")
    plain, launched = str(tmp_path / "plain.npz"), str(tmp_path / "mw.npz")
    env = child_env(TF_CPP_MIN_LOG_LEVEL=3)
    run([PYTHON, script, "--out", plain, "--quantize", "--distribute", "none"], timeout=240, env=env)
    run([kerasdist_command, "launch", "-n", "2", "--join-timeout", "60", script, "--out", launched, "--quantize",
         "--distribute", "multiworker"], timeout=240, env=env)
    reference, chief = np.load(plain), np.load(launched)
    other = np.load(launched.replace(".npz", "-task1.npz"))
    names = [n for n in reference.files if n != "steps"]
    assert len(names) == 4 + 8  # 2 kernels, 2 biases; ranges (min, max): input, pre-tanh, output; output
    assert reference["steps"].tolist() == chief["steps"].tolist()
    for name in names:
        np.testing.assert_allclose(chief[name], reference[name], atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(chief[name], other[name], err_msg=name)


@pytest.mark.slow
@run_if(horovod=True)
def test_horovod_qat_equals_one_process_and_ranks_hold_identical_ranges(tmp_path):
    """Issue 36: QAT under horovodrun learns one set of int8 ranges from the global batch (the horovod word declares its
    ranks a process group: the ranges' min/max go through hvd.allreduce). Before: refused at compile ("each would
    learn its own int8 ranges")."""
    from helpers import PYTHON, child_env, run
    from runif import HOROVODRUN
    from test_equivalence import HOROVOD_ARGS

    script = os.path.join(HERE, "workers", "equivalence_script.py")
    plain, launched = str(tmp_path / "plain.npz"), str(tmp_path / "hvd.npz")
    env = child_env(TF_CPP_MIN_LOG_LEVEL=3)
    run([PYTHON, script, "--out", plain, "--quantize", "--distribute", "none"], timeout=240, env=env)
    run([HOROVODRUN, *HOROVOD_ARGS, PYTHON, script, "--out", launched, "--quantize", "--distribute", "horovod"],
        timeout=240, env=env)
    reference, chief = np.load(plain), np.load(launched)
    other = np.load(launched.replace(".npz", "-task1.npz"))
    names = [n for n in reference.files if n != "steps"]
    assert len(names) == 4 + 8 and reference["steps"].tolist() == chief["steps"].tolist()
    print("horovod QAT: max |rank 0 - one process| =", max(float(np.max(np.abs(chief[n] - reference[n]))) for n in names))
    for name in names:
        np.testing.assert_allclose(chief[name], reference[name], atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(chief[name], other[name], err_msg=name)


# -- Must show 3: 2:4 sparsity ----------------------------------------------------------------

def _blocks_of_four_have_two_zeros(kernel, input_axis=-2):
    moved = np.moveaxis(np.asarray(kernel), input_axis, -1)
    groups = moved.reshape(-1, 4)
    return bool(np.all(np.sum(groups == 0, axis=-1) >= 2))


@pytest.mark.slow
def test_two_of_four_pruning_keeps_accuracy_and_survives_quantized_export(tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    from kerasdist_plugins import pruning

    x, y, x_test, y_test = qat_digits.digits()
    dense_model = qat_digits.conv_net()
    qat_digits.compile_model(dense_model, 0.05)
    dense_model.fit(x, y, batch_size=32, epochs=20, verbose=0)
    dense_accuracy = qat_digits.accuracy(dense_model.predict(x_test, verbose=0), y_test)

    model = qat_digits.conv_net()
    with pytest.warns(UserWarning, match=r"conv2d\w* \(3, 3, 1, 16\).*stay dense"):
        qat_digits.compile_model(model, 0.05, [kerasdist.prune(pattern="2:4", frequency=10)])
        model.fit(x, y, batch_size=32, epochs=20, verbose=0)
    state = pruning.state_of(model)
    assert [layer.name for layer in state.layers][0] == "conv_after" and len(state.layers) == 2
    for layer in state.layers:
        assert _blocks_of_four_have_two_zeros(layer.kernel.numpy()), layer.name
    sparse_accuracy = qat_digits.accuracy(model.predict(x_test, verbose=0), y_test)
    assert sparse_accuracy >= dense_accuracy - 0.01

    qat_digits.compile_model(model, 0.005, [kerasdist.prune(pattern="2:4", frequency=10), kerasdist.quantize()])
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    for layer in state.layers:
        assert _blocks_of_four_have_two_zeros(pruning.state_of(model).layers[0].kernel.numpy())
    result = kerasdist.export(model, str(tmp_path / "sparse.tflite"), format="litert-int8", verify_with=x_test)
    assert result.argmax_agreement >= 0.99
    interpreter = Interpreter(model_path=result.path)
    interpreter.allocate_tensors()
    pruned = [t for t in interpreter.get_tensor_details()
              if t["dtype"] == np.int8 and len(t["shape"]) >= 2 and "FakeQuant" in t["name"]
              and ("conv_after" in t["name"] or "/dense" in t["name"])]
    # the int8 kernels in the file; LiteRT lays them out (output, ..., input): the input axis is last
    assert len(pruned) == 2
    assert all(_blocks_of_four_have_two_zeros(interpreter.get_tensor(t["index"]), input_axis=-1) for t in pruned)


# -- Must show 4: TFMOT oracle ------------------------------------------------------------------

def _oracle_inputs():
    rng = np.random.default_rng(0)
    data = {}
    for kind, x_shape, k_shape in (("dense", (8, 5), (5, 6)), ("conv", (4, 6, 6, 3), (3, 3, 3, 4))):
        x = rng.normal(size=x_shape).astype("float32")
        data.update({f"{kind}_x": x, f"{kind}_kernel": (rng.normal(size=k_shape) * 0.5).astype("float32"),
                     f"{kind}_bias": (rng.normal(size=k_shape[-1:]) * 0.1).astype("float32"),
                     f"{kind}_input_min": np.float32(min(x.min(), 0)), f"{kind}_input_max": np.float32(max(x.max(), 0)),
                     f"{kind}_output_min": np.float32(-1.0), f"{kind}_output_max": np.float32(2.0)})
    return data


@pytest.mark.slow
def test_fake_quantized_outputs_and_range_updates_equal_tfmot(tmp_path):
    # find_spec, not importorskip: importing TFMOT sets TF_USE_LEGACY_KERAS=1 for the rest of this process
    # (tf.keras would be Keras 2 in every later test of this pytest worker); the oracle imports it in a child.
    if importlib.util.find_spec("tensorflow_model_optimization") is None:
        pytest.skip("needs tensorflow-model-optimization (the oracle)")
    data = _oracle_inputs()
    np.savez(tmp_path / "in.npz", **data)
    environ = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    subprocess.run([sys.executable, os.path.join(HERE, "workers", "tfmot_oracle.py"), str(tmp_path / "in.npz"),
                    str(tmp_path / "out.npz")], check=True, timeout=240, env=environ)
    tfmot = dict(np.load(tmp_path / "out.npz"))
    assert tfmot["dense_per_channel_kernel_range"].tolist() == [1]  # TFMOT: Dense per tensor, Conv2D per channel
    assert tfmot["conv_per_channel_kernel_range"].tolist() == [4]
    for kind, layer, weights in (("dense", keras.layers.Dense(6, activation="relu"), "per_tensor"),
                                 ("conv", keras.layers.Conv2D(4, 3, activation="relu"), "per_channel")):
        x = data[f"{kind}_x"]
        model = keras.Sequential([keras.Input(x.shape[1:]), layer])
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize(weights=weights))
        layer.kernel.assign(data[f"{kind}_kernel"])
        layer.bias.assign(data[f"{kind}_bias"])
        assert layer.quantization_plan.per_channel == (kind == "conv")
        for where in ("input", "output"):
            low, high = layer.range_variables[where]
            low.assign(data[f"{kind}_{where}_min"])
            high.assign(data[f"{kind}_{where}_max"])
        training, inference = model(x, training=True), model(x, training=False)
        print(kind, "max |kerasdist - TFMOT|: training", float(np.abs(training - tfmot[f"{kind}_training"]).max()),
              "inference", float(np.abs(inference - tfmot[f"{kind}_inference"]).max()))
        np.testing.assert_allclose(training, tfmot[f"{kind}_training"], atol=1e-6)
        np.testing.assert_allclose(inference, tfmot[f"{kind}_inference"], atol=1e-6)
        (low, high) = layer.ranges()["output"]
        assert low == pytest.approx(float(tfmot[f"{kind}_post_activation_min"]), abs=1e-6)
        assert high == pytest.approx(float(tfmot[f"{kind}_post_activation_max"]), abs=1e-6)
        assert layer.ranges()["input"] == pytest.approx(
            (float(tfmot[f"{kind}_quantize_layer_min"]), float(tfmot[f"{kind}_quantize_layer_max"])), abs=1e-6)


# -- Must show 5: ONNX Q/DQ ---------------------------------------------------------------------

@pytest.mark.slow
def test_onnx_export_of_a_qat_model_has_qdq_pairs_and_agrees_with_keras(tmp_path):
    import onnx

    x, y, x_test, y_test = qat_digits.digits()
    model = qat_digits.conv_net()
    qat_digits.compile_model(model, 0.05, [kerasdist.quantize()])
    model.fit(x, y, batch_size=32, epochs=6, verbose=0)
    result = kerasdist.export(model, str(tmp_path / "qat.onnx"), format="onnx", verify_with=x_test)
    ops = collections.Counter(node.op_type for node in onnx.load(result.path).graph.node)
    assert ops["QuantizeLinear"] >= 9 and ops["DequantizeLinear"] == ops["QuantizeLinear"]
    assert result.argmax_agreement >= 0.99
    float_result = kerasdist.export(model, str(tmp_path / "float.tflite"), format="litert", verify_with=x_test)
    assert float_result.max_abs_diff < 1e-4  # the float formats leave the fake quantization out


# -- save / load --------------------------------------------------------------------------------

def test_save_and_load_in_a_fresh_process_keeps_the_qat_state(tmp_path):
    model = _train_small([kerasdist.quantize()], epochs=1)
    model.save(tmp_path / "qat.keras")
    x, _ = _small_data(8)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    script = ("import sys, json, numpy as np, kerasdist, keras\n"
              "from kerasdist_plugins import qat\n"
              f"m = keras.saving.load_model({str(tmp_path / 'qat.keras')!r})\n"
              f"got = m.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)\n"
              f"print(float(np.abs(got - np.load({str(tmp_path / 'expected.npy')!r})).max()))\n"
              "print(json.dumps(qat.ranges(m)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    diff, ranges = done.stdout.strip().splitlines()[-2:]
    assert float(diff) == 0.0
    import json

    assert {k: {w: list(p) for w, p in v.items()} for k, v in qat.ranges(model).items()} == json.loads(ranges)


# -- TensorRT recipe ----------------------------------------------------------------------------

def test_tensorrt_recipe_writes_symmetric_int8_qdq_and_two_of_four_sparsity(tmp_path):
    import onnx
    from onnx import numpy_helper

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 4)), keras.layers.Conv2D(8, 3, activation="relu", name="conv"),
                              keras.layers.Flatten(), keras.layers.Dense(4, name="fc")])
    x = np.random.default_rng(1).normal(size=(64, 6, 6, 4)).astype("float32")
    y = np.random.default_rng(2).integers(0, 4, size=(64,))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd",
                  distribute=["mirrored", kerasdist.tensorrt(sparsity="2:4")])
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    for layer in model.layers[::2]:
        assert _blocks_of_four_have_two_zeros(layer.kernel.numpy()), layer.name
    assert {name: list(pairs) for name, pairs in qat.ranges(model).items()} == {"conv": ["input"], "fc": ["input"]}
    result = kerasdist.export(model, str(tmp_path / "trt.onnx"), format="onnx", verify_with=x)
    graph = onnx.load(result.path).graph
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type in ("Const", "Constant"):
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    zero_points = [constants[n.input[2]] for n in graph.node if n.op_type == "QuantizeLinear" and n.input[2] in constants]
    assert len(zero_points) == 4 and all(z.dtype == np.int8 and not z.any() for z in zero_points)  # symmetric int8
    assert result.argmax_agreement >= 0.95
    with pytest.raises(kerasdist.KerasdistError, match="NVIDIA GPU"):
        kerasdist.export(model, str(tmp_path / "m.engine"), format="tensorrt", precision="int8")


def test_conv1d_einsum_dense_and_softmax_train_and_export_to_litert_int8_and_onnx(tmp_path):
    """Conv1D and EinsumDense kernels per tensor (the converter moves their channel axis), softmax with a
    quantizer before and after it: both files agree with the Keras fake-quant model."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16, 3)), keras.layers.Conv1D(8, 3, activation="relu"),
                              keras.layers.Flatten(),
                              keras.layers.EinsumDense("ab,bc->ac", output_shape=6, bias_axes="c", activation="relu"),
                              keras.layers.Dense(4, activation="softmax")])
    x = np.random.default_rng(0).normal(size=(64, 16, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 4, 64)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd", distribute=kerasdist.quantize())
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    plans = [layer.quantization_plan for layer in model.layers if hasattr(layer, "quantization_plan")]
    assert [p.per_channel for p in plans] == [False, False, False] and plans[-1].pre_activation
    # Random labels leave near-tied softmax outputs (top-two gaps down to ~1e-4), whose argmax an int8 rounding
    # may flip on one Keras/CPU and not on another; an argmax can flip only where the gap is <= 2 max|diff|.
    top2 = np.sort(model.predict(x, verbose=0), axis=-1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    for format, path in (("litert-int8", "m.tflite"), ("onnx", "m.onnx")):
        result = kerasdist.export(model, str(tmp_path / path), format=format, verify_with=x)
        assert result.max_abs_diff <= 0.02, result  # a few int8 steps of a softmax output (1/256 each)
        assert result.argmax_agreement >= np.mean(gap > 2 * result.max_abs_diff), (result, np.sort(gap)[:8])
