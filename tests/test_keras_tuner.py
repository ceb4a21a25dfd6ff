"""A KerasTuner search under a word runs as in one process (issue 35 item 2): every rank makes the same trials with
the same scores, KerasTuner's files are written by the chief only (before: every rank wrote each trial's
``checkpoint.weights.h5``; HDF5's file lock failed the trial on one rank, which went on to the next trial while the
others trained the last: gloo aborted under torch, multiworker stopped with the agreement error), and the best
model comes back with one process's weights. tests/workers/keras_tuner_search.py: keras.io's getting-started
RandomSearch, two trials of two epochs."""

import json
import os

import numpy as np
import pytest

from helpers import PYTHON, ROOT, child_env, run

keras_tuner = pytest.importorskip("keras_tuner")

SCRIPT = os.path.join(ROOT, "tests", "workers", "keras_tuner_search.py")
KERASDIST = os.path.join(os.path.dirname(PYTHON), "kerasdist")
#: backend -> the word its tuner runs under two processes of `kerasdist launch`
WORDS = {"torch": "data_parallel", "tensorflow": "multiworker", "jax": "data_parallel"}


def _results(output, prefix):
    return [json.loads(line[len(prefix) + len("RESULT "):]) for line in output.splitlines()
            if line.startswith(prefix + "RESULT ")]


def test_every_word_finds_the_callbacks_that_write_kerastuners_among_them(tmp_path):
    """One table (kerasdist/chief_writes.py) tells every word which callbacks write where: Keras's and KerasTuner's
    (its class is not exported: a KerasTuner that moves it fails here), subclasses included."""
    import keras
    from keras_tuner.src.engine.tuner_utils import SaveBestEpoch

    from kerasdist.plugin_tools import redirect_writes, restore_writes, writes_files

    class Mine(keras.callbacks.ModelCheckpoint):
        pass

    path = os.path.join("trials", "trial_0", "checkpoint.weights.h5")
    save_best = SaveBestEpoch(keras_tuner.Objective("val_loss", "min"), path)
    callbacks = [keras.callbacks.EarlyStopping(), save_best, Mine("m.keras"), keras.callbacks.CSVLogger("log.csv")]
    assert [writes_files(c) for c in callbacks] == [False, True, True, True]
    changed = redirect_writes(callbacks, str(tmp_path))
    assert save_best.filepath == str(tmp_path / "1-SaveBestEpoch" / "checkpoint.weights.h5")
    assert (os.stat(tmp_path / "1-SaveBestEpoch").st_mode & 0o777) == 0o700
    restore_writes(changed)
    assert [save_best.filepath, callbacks[2].filepath, callbacks[3].filename] == [path, "m.keras", "log.csv"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", list(WORDS))
def test_a_tuner_searches_under_launch_as_in_one_process(tmp_path, backend):
    env = dict(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL=3, OMP_NUM_THREADS=1)
    single = run([PYTHON, SCRIPT, "none", str(tmp_path / "one")], timeout=180, env=child_env(**env)).stdout
    launched = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", SCRIPT, WORDS[backend],
                    str(tmp_path / "two")], timeout=300, env=child_env(**env)).stdout
    (want,) = _results(single, "")
    assert [t[3] for t in want["trials"].values()] == ["COMPLETED"] * 2, want
    for rank in (0, 1):
        (got,) = _results(launched, f"[{rank}] ")
        assert sorted(got["trials"]) == sorted(want["trials"]), (rank, got["trials"], want["trials"])
        for trial, (units, lr, score, status) in got["trials"].items():
            assert [units, lr, status] == want["trials"][trial][:2] + [want["trials"][trial][3]], (rank, trial)
            assert score == pytest.approx(want["trials"][trial][2], abs=1e-5), (rank, trial)
        np.testing.assert_allclose(got["best"], want["best"], atol=1e-5, err_msg=f"rank {rank}")
        assert got["evaluate"] == pytest.approx(want["evaluate"], abs=1e-5)
    checkpoints = sorted(path for path, _, files in os.walk(tmp_path / "two") for name in files
                         if name == "checkpoint.weights.h5")
    assert len(checkpoints) == 2, checkpoints  # one per trial, in the user's folder (the chief's)
