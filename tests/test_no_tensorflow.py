"""A JAX-only install (TensorFlow not installed): every ``kerasdist`` command works, and each TensorFlow
plugin says TensorFlow is missing and how to install it. The install is a venv holding this one's
packages minus tensorflow*, so ``import tensorflow`` really finds nothing, in launched workers too."""

import importlib.util
import json
import os
import subprocess
import sysconfig
import venv

import numpy as np
import pytest

from tests.helpers import ROOT, child_env, run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                reason="needs jax: pip install 'kerasdist[jax]' (make test installs it)")
INSTALL = "pip install 'kerasdist[cpu]'"


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """The Python of a venv with every package of this one except tensorflow*."""
    home = tmp_path_factory.mktemp("jax_only")
    venv.create(home, with_pip=False, symlinks=True)
    ours = sysconfig.get_paths()["purelib"]
    theirs = sysconfig.get_paths(vars={"base": str(home), "platbase": str(home)})["purelib"]
    for name in os.listdir(ours):
        if not name.lower().startswith("tensorflow"):
            os.symlink(os.path.join(ours, name), os.path.join(theirs, name))
    return os.path.join(home, "bin", "python")


def kerasdist_cli(python, *args, **env):
    result = subprocess.run([python, "-m", "kerasdist.cli", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=child_env(**{"KERAS_BACKEND": "jax", **env}))
    assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout


def test_the_venv_really_lacks_tensorflow_and_has_jax(python):
    code = "import jax, kerasdist\ntry:\n import tensorflow\nexcept ModuleNotFoundError as e:\n print(e)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, env=child_env()).stdout
    assert "No module named 'tensorflow'" in out


def test_env_works_and_lists_the_jax_devices(python):
    info = json.loads(kerasdist_cli(python, "env", "--json", XLA_FLAGS="--xla_force_host_platform_device_count=3"))
    assert info["keras_backend"] == "jax" and info["auto_strategy"] == "data_parallel"
    assert info["local_devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert "local_devices:" in kerasdist_cli(python, "env")
    missing = json.loads(kerasdist_cli(python, "env", "--json", KERAS_BACKEND="tensorflow"))["local_devices"]
    assert "'tensorflow' is not installed" in missing and INSTALL in missing


def test_plugins_name_the_missing_tensorflow_and_its_install_command(python):
    listed = json.loads(kerasdist_cli(python, "plugins", "--json"))
    # A word implemented for several backends has one row per implementation: key by the first backend.
    rows = {(r["kind"], r["name"]): r for r in reversed(listed)}
    by_backend = {(r["name"], b): r for r in listed for b in r.get("backends") or ()}
    mirrored = rows["strategy", "mirrored"]
    assert not mirrored["available"] and "tensorflow, which is not installed" in mirrored["reason"]
    assert INSTALL in mirrored["reason"] and INSTALL in mirrored["install"]
    litert = rows["export", "litert"]
    assert INSTALL in litert["install"] and "kerasdist[litert]" in litert["install"]
    assert rows["strategy", "hybrid"]["available"] and by_backend["data_parallel", "jax"]["available"]
    assert not by_backend["data_parallel", "torch"]["available"]  # the JAX backend runs here
    table = kerasdist_cli(python, "plugins", "-v")
    assert f"install: {INSTALL}" in table
    assert "mirrored" in kerasdist_cli(python, "plugins", "--kind", "strategy")


def test_env_in_a_tf_config_worker_reads_the_cluster(python):
    tf_config = {"cluster": {"worker": ["127.0.0.1:2001", "127.0.0.1:2002"]}, "task": {"type": "worker", "index": 1}}
    info = json.loads(kerasdist_cli(python, "env", "--json", TF_CONFIG=json.dumps(tf_config)))
    assert info["cluster"]["cluster"] == tf_config["cluster"] and not info["is_chief"] and info["num_workers"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_trains_one_model_on_two_jax_processes(python, tmp_path):
    train = os.path.join(ROOT, "tests", "workers", "jax_train.py")
    plain, launched = str(tmp_path / "plain.npz"), str(tmp_path / "launched.npz")
    run([python, train, "plain", plain], timeout=120, env=child_env(KERAS_BACKEND="jax"))
    env = child_env(KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run([python, "-m", "kerasdist.cli", "launch", "-n", "2", train, "hybrid", launched, "mesh=2x4"], timeout=240, env=env)
    one, two = np.load(plain), np.load(launched)
    diff = max(float(np.max(np.abs(one[k] - two[k]))) for k in one.files)
    print(f"JAX-only install, kerasdist launch -n 2 (global 2x4 mesh) vs one device: max |dw| = {diff:.3g}")
    assert diff <= 1e-5
