"""The next Keras as a gate of ``make test``: the locked keras-nightly (requirements/keras-nightly.txt), installed
by the set-up beside the venv (``.venv/keras-nightly``, never into it), is first on PYTHONPATH in a few child
processes that train with every strategy word that runs here: compile with the word, fit one epoch (weights equal
one process), evaluate, save + load_model (the word restored), predict (tests/workers/keras_words.py).

- TensorFlow, one process over 2 CPU replicas: mirrored, central_storage, data_parallel, auto;
- TensorFlow, ``kerasdist launch -n 2``: multiworker strategy-free (KERASDIST_STRATEGY_FREE=on) and on
  MultiWorkerMirroredStrategy's step (``sync_batch_norm=True`` keeps it);
- JAX, one process over 2 CPU devices: data_parallel, hybrid;
- torch, 2 ranks (torchrun's variables): data_parallel, and keras.io's lower-level custom step with synchronized
  BatchNormalization and an empty share; fsdp is refused with one error on Keras 3.16.

Not here (each needs processes or hardware this check does not start): ps, horovod, tpu.
"""

import os
import re
import sys

import pytest

from tests.helpers import PYTHON, ROOT, child_env, run, torchrun_two

pytestmark = pytest.mark.slow

NIGHTLY_DIR = os.path.join(sys.prefix, "keras-nightly")
WORKER = os.path.join(ROOT, "tests", "workers", "keras_words.py")
KERASDIST = os.path.join(os.path.dirname(PYTHON), "kerasdist")


def locked_nightly():
    with open(os.path.join(ROOT, "requirements", "keras-nightly.txt"), encoding="utf-8") as f:
        return re.search(r"^keras-nightly==(\S+)", f.read(), re.M).group(1)


def nightly_env(**extra):
    return child_env(PYTHONPATH=os.pathsep.join(filter(None, [NIGHTLY_DIR, os.environ.get("PYTHONPATH")])), **extra)


@pytest.fixture(scope="module")
def nightly():
    from kerasdist._keras_internals.versions import installed_keras_version

    running = installed_keras_version() or ""
    if ".dev" in running:
        pytest.skip(f"this suite already runs on keras-nightly {running} (make test-keras-nightly)")
    version = locked_nightly()
    if not os.path.isfile(os.path.join(NIGHTLY_DIR, "keras", "__init__.py")):
        pytest.fail(f"keras-nightly {version} is not installed beside this venv ({NIGHTLY_DIR}): run `make venv` "
                    "(the set-up runs pip install --no-deps --require-hashes --target .venv/keras-nightly "
                    "-r requirements/keras-nightly.txt)", pytrace=False)
    return version


def test_the_locked_nightly_is_the_checked_one():
    """Moving the lock moves versions.CHECKED_KERAS_VERSIONS (and the README) with it."""
    from kerasdist._keras_internals import versions

    assert locked_nightly() in versions.CHECKED_KERAS_VERSIONS, (locked_nightly(), versions.CHECKED_KERAS_VERSIONS)
    assert versions.keras_line(locked_nightly()) is not None


def _words_ok(output, words, processes=1):
    for word in words:
        assert output.count(f"WORD OK {word} ") == processes, f"{word}:\n{output[-6000:]}"


@pytest.mark.timeout(300)
def test_tensorflow_words_in_one_process_on_the_next_keras(nightly, tmp_path):
    words = ["mirrored", "central_storage", "data_parallel", "auto"]
    out = run([PYTHON, WORKER, str(tmp_path), nightly, ",".join(words)], timeout=240,
              env=nightly_env(KERASDIST_CPU_REPLICAS=2)).stdout
    _words_ok(out, words)
    assert f"KERAS {nightly} tensorflow" in out, out[-3000:]


@pytest.mark.timeout(300)
def test_multiworker_both_steps_under_launch_on_the_next_keras(nightly, tmp_path):
    words = ["multiworker", "multiworker:sync_batch_norm=True"]
    out = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", WORKER, str(tmp_path), nightly, ",".join(words)],
              timeout=240, env=nightly_env(KERASDIST_STRATEGY_FREE="on")).stdout
    assert "trains strategy-free" in out, out[-6000:]
    _words_ok(out, words, processes=2)


@pytest.mark.timeout(300)
def test_jax_words_on_the_next_keras(nightly, tmp_path):
    words = ["data_parallel", "hybrid"]
    out = run([PYTHON, WORKER, str(tmp_path), nightly, ",".join(words)], timeout=240,
              env=nightly_env(KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=2")).stdout
    _words_ok(out, words)
    assert f"KERAS {nightly} jax" in out, out[-3000:]


@pytest.mark.timeout(300)
def test_torch_words_on_two_ranks_on_the_next_keras(nightly, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("PYTHONPATH", nightly_env()["PYTHONPATH"])  # torchrun_two's children inherit it
    words = ["data_parallel", "custom:data_parallel:sync_batch_norm=True"]
    results = torchrun_two([WORKER, str(tmp_path), nightly, ",".join(words + ["refused:fsdp"])], timeout=240)
    for code, out in results:
        assert code == 0, out[-6000:]
        _words_ok(out, words)
        assert "WORD REFUSED refused:fsdp" in out and f"KERAS {nightly} torch" in out, out[-3000:]
