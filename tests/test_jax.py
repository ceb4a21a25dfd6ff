"""The JAX backend through keras.distribution: data_parallel and hybrid, each run in its own process
(the Keras backend is fixed per process) with 8 host CPU devices."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

import kerasdist
from tests.helpers import ROOT, child_env, python, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                reason="needs jax: pip install 'kerasdist[jax]' (make test installs it)")
TRAIN = os.path.join(ROOT, "tests", "workers", "jax_train.py")
CHECKS = os.path.join(ROOT, "tests", "workers", "jax_checks.py")
JAX_ENV = {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def _train(mode, tmp_path, *options):
    out = str(tmp_path / f"{mode}.npz")
    stdout = run(python(TRAIN, mode, out, *options), timeout=240, env=child_env(**JAX_ENV)).stdout
    with open(out + ".json") as f:
        info = json.load(f)
    weights = np.load(out)
    return [weights[k] for k in weights.files], info, stdout


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _train("plain", tmp_path_factory.mktemp("plain"))


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.timeout(300)
def test_data_parallel_on_8_devices_equals_one_device(plain, tmp_path):
    weights, info, _ = _train("data_parallel", tmp_path)
    diff = _max_diff(weights, plain[0])
    print(f"data_parallel (8 CPU devices) vs one device, SGD, global batch 32: max |dw| = {diff:.3g}")
    assert info["devices"] == 8 and diff <= 1e-5
    assert all(len(f) == 8 and set(f) == {1.0} for f in info["fractions"].values())  # replicated on all 8
    assert len(plain[1]["fractions"]["sequential/d1/kernel"]) == 1  # the reference really is one device


@pytest.mark.timeout(300)
def test_hybrid_2x4_shards_each_dense_kernel_in_quarters_and_trains_the_same(plain, tmp_path):
    weights, info, stdout = _train("hybrid", tmp_path, "mesh=2x4")
    diff = _max_diff(weights, plain[0])
    print(f"hybrid 2x4 vs one device: max |dw| = {diff:.3g}")
    assert diff <= 1e-4
    for path, fractions in info["fractions"].items():
        if path.endswith("kernel"):
            assert len(fractions) == 8 and set(fractions) == {0.25}, (path, fractions)
            assert info["specs"][path] == "P(None, 'model')"
    assert "sequential/d1/kernel  (16, 64)          (None, 'model')       1024" in stdout  # show_layout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_launch_2_processes_of_4_devices_train_one_model_on_a_global_2x4_mesh(tmp_path):
    single, single_info, _ = _train("hybrid", tmp_path, "mesh=2x4")
    kerasdist_command = os.path.join(os.path.dirname(sys.executable), "kerasdist")
    out = str(tmp_path / "launched.npz")
    env = child_env(KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run([kerasdist_command, "launch", "-n", "2", TRAIN, "hybrid", out, "mesh=2x4"], timeout=300, env=env)
    launched = np.load(out)
    with open(out + ".json") as f:
        info = json.load(f)
    diff = _max_diff([launched[k] for k in launched.files], single)
    print(f"kerasdist launch -n 2 (2 x 4 devices, global 2x4 mesh) vs one process of 8 devices: max |dw| = {diff:.3g}")
    assert info["processes"] == 2 and info["devices"] == 8 and diff <= 1e-5
    assert single_info["processes"] == 1
    crashed = run([kerasdist_command, "launch", "-n", "2", TRAIN, "hybrid", str(tmp_path / "c.npz"), "crash=1"],
                  timeout=300, env=env, check=False)
    assert crashed.returncode != 0 and "[1] CRASHING" in crashed.stdout
    assert "worker 1 exited with exit code 3" in crashed.stdout


@pytest.mark.timeout(300)
def test_bad_input_save_load_auto_and_own_layouts(tmp_path):
    out = tmp_path / "checks.json"
    run(python(CHECKS, str(out)), timeout=240, env=child_env(**JAX_ENV))
    results = json.loads(out.read_text())
    expected = {
        "mesh_size": ("KerasdistError", ["mesh={'batch': 2, 'model': 3} has 6 devices but there are 8"]),
        "unknown_axis": ("KerasdistError", ["names the axis 'tensor'", "lacks"]),
        "not_divisible": ("KerasdistError", ["d1/kernel of shape (16, 30)", "axis 'model'", "axis size 4"]),
        "batch_not_divisible": ("KerasdistError", ["batch_size=7", "axis 'batch' of size 2"]),
        "unbuilt_hybrid": ("KerasdistError", ["hybrid: the model is not built", "keras.Input(shape)",
                                              "model.build(input_shape)"]),
        "tf_only_mirrored": ("BackendError", ["'mirrored'", "'jax'", "work on 'jax': data_parallel, hybrid"]),
        "tf_only_horovod": ("BackendError", ["'horovod'", "'jax'"]),
        "tf_only_ps": ("BackendError", ["'ps'", "'jax'"]),
    }
    for case, (error, words) in expected.items():
        result = results[case]
        assert not result["ok"] and result["type"] == error, (case, result)
        assert all(word in result["message"] for word in words), (case, result["message"])
        assert result["seconds"] < 5, case
    assert any("['nothing/kernel'] match no variable" in w and "d1/kernel" in w
               for w in results["unused_rule"]["warnings"])
    assert results["auto"] == "DataParallel"
    save = results["save_load"]
    print("save sharded, load plain / sharded: max |prediction diff| =", save["plain_diff"], save["sharded_diff"])
    assert save["plain_diff"] <= 1e-6 and save["sharded_diff"] <= 1e-6
    assert save["sharded_spec"] == save["reloaded_spec"] == "P(None, 'model')"
    assert results["own_layout"] == "P('model', None)"  # built under the user's distribution: kept
    late = results["unbuilt_late_build"]  # built after compile by model.build: replicated on all 8, saved, loaded
    assert late["spec"] == "P(None, None)" and late["devices"] == 8 and late["reload_diff"] <= 1e-6, late


def test_hybrid_on_tensorflow_names_the_backend_and_what_works():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    with pytest.raises(kerasdist.BackendError) as info:
        model.compile(loss="mse", distribute=kerasdist.hybrid(mesh={"batch": 1, "model": 2}))
    message = str(info.value)
    assert "needs the Keras backend jax" in message and "KERAS_BACKEND=jax" in message
    assert "work on 'tensorflow'" in message and "mirrored" in message and "data_parallel" in message


def test_data_parallel_on_tensorflow_is_mirrored():
    import keras
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    model.compile(loss="mse", distribute="data_parallel")
    assert isinstance(model.distribute_strategy, tf.distribute.MirroredStrategy)
    assert model.distribute_strategy.num_replicas_in_sync == 2
