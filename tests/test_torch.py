"""distribute="data_parallel" on the PyTorch backend (plugins/torch_distributed), in real processes.

Every torch process is a child (KERAS_BACKEND is fixed per process and this pytest process runs
TensorFlow); loopback only, each run with a timeout, no process left behind. Runtimes on 2 CPU cores are
in the report of the change that added them (about 2.5 min for the file).
"""

import os
import re
import socket
import time

import numpy as np
import pytest

from tests.helpers import ROOT, child_env, processes_with, python, run

pytest.importorskip("torch")

WORKER = os.path.join("tests", "workers", "torch_train.py")
KERASDIST = os.path.join(os.path.dirname(python()[0]), "kerasdist")
TORCHRUN = os.path.join(os.path.dirname(python()[0]), "torchrun")
TIMEOUT = 240


def _env(**extra):
    return child_env(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", **extra)


def _single(out, *args):
    run(python(WORKER, str(out), "--distribute", "none", *args), timeout=TIMEOUT, env=_env())
    return np.load(os.path.join(out, "rank0.npz"))


def _launch(out, *args, check=True, **env):
    env.setdefault("KERASDIST_BACKUP_DIR", f"{out}-backups")  # kerasdist's private backups, kept out of ~/.cache
    result = run([KERASDIST, "launch", "-n", "2", "--", WORKER, str(out), *args], timeout=TIMEOUT,
                 env=_env(**env), check=check)
    if not check:
        return result
    return [np.load(os.path.join(out, f"rank{r}.npz")) for r in range(2)]


def _weights(npz):
    return [npz[k] for k in sorted((k for k in npz.files if k.startswith("arr_")), key=lambda k: int(k[4:]))]


def _assert_like_one_process(ranks, single, atol):
    for rank in ranks:
        for got, want in zip(_weights(rank), _weights(single)):
            np.testing.assert_allclose(got, want, atol=atol, rtol=0)
        np.testing.assert_allclose(rank["loss"], single["loss"], atol=atol, rtol=1e-6)  # all-reduced logs
    first, second = ranks
    np.testing.assert_array_equal(first["evaluate"], second["evaluate"])  # every rank: the same metrics
    np.testing.assert_array_equal(first["predict"], second["predict"])  # every rank: every prediction
    np.testing.assert_allclose(first["evaluate"], single["evaluate"], atol=atol, rtol=1e-6)
    np.testing.assert_allclose(first["predict"], single["predict"], atol=atol, rtol=1e-6)


def _no_process_left(token):
    time.sleep(0.5)
    assert not processes_with(token), f"processes left behind: {processes_with(token)}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The model trained in one process on the same global batches (SGD, same seed, 2 epochs)."""
    return _single(tmp_path_factory.mktemp("single"))


# -- Must show 1 -----------------------------------------------------------------------------------

def test_kerasdist_launch_two_ranks_train_like_one_process(tmp_path, one_process):
    """Model built before compile, each rank seeding other weights (rank 0's reach every rank)."""
    ranks = _launch(tmp_path)
    _assert_like_one_process(ranks, one_process, atol=1e-5)
    _no_process_left(str(tmp_path))


def test_torchrun_two_ranks_train_like_one_process(tmp_path, one_process):
    run([TORCHRUN, "--standalone", "--nproc-per-node", "2", WORKER, str(tmp_path)], timeout=TIMEOUT, env=_env())
    ranks = [np.load(os.path.join(tmp_path, f"rank{r}.npz")) for r in range(2)]
    _assert_like_one_process(ranks, one_process, atol=1e-5)
    _no_process_left(str(tmp_path))


def test_a_model_built_by_fit_trains_like_one_process(tmp_path):
    """No Input: fit builds the model (kerasdist builds it from this rank's first batch, then every rank takes
    rank 0's weights: each rank seeds its own)."""
    single = _single(tmp_path / "single", "--unbuilt")
    ranks = _launch(tmp_path / "two", "--unbuilt")
    _assert_like_one_process(ranks, single, atol=1e-5)


def test_uneven_and_empty_shares_train_like_one_process(tmp_path):
    """46 rows in global batches of 15: shares of 7 and 8, and a last batch of 1 row (one rank's share is
    empty) train as one device does."""
    single = _single(tmp_path / "single", "--rows", "46", "--batch", "15")
    ranks = _launch(tmp_path / "two", "--rows", "46", "--batch", "15")
    _assert_like_one_process(ranks, single, atol=1e-5)


# -- Must show 3, and a rank that dies ---------------------------------------------------------------

def test_sigkilled_worker_job_ends_then_resumes_from_the_backup(tmp_path):
    """Rank 1 SIGKILLed in epoch 3: the job ends non-zero within 30 s, no process left; relaunched unchanged,
    it resumes at epoch 3 from kerasdist's private backup (rank 0 wrote it) and ends with the weights of an
    uninterrupted run (within 1e-6)."""
    backups = str(tmp_path / "backups")
    uninterrupted = _launch(tmp_path / "whole", "--epochs", "4", KERASDIST_BACKUP_DIR=str(tmp_path / "other"))[0]
    killed = _launch(tmp_path / "job", "--epochs", "4", check=False, TORCH_TEST_KILL_AT="3",
                     KERASDIST_BACKUP_DIR=backups)
    ended, output = time.time(), killed.stdout
    found = re.search(r"rank 1: SIGKILL in epoch 3 at ([0-9.]+)", output)
    assert killed.returncode != 0 and found, output[-3000:]
    assert ended - float(found.group(1)) < 30  # measured: 0.5 s (gloo's peer reset, then the launcher)
    _no_process_left(str(tmp_path / "job"))
    resumed = run([KERASDIST, "launch", "-n", "2", "--", WORKER, str(tmp_path / "job"), "--epochs", "4"],
                  timeout=TIMEOUT, env=_env(KERASDIST_BACKUP_DIR=backups)).stdout
    assert "[0] kerasdist: resuming at epoch 3 from this job's backup" in resumed, resumed[-3000:]
    for rank in (np.load(os.path.join(tmp_path / "job", f"rank{r}.npz")) for r in range(2)):
        assert int(rank["epochs_run"]) == 2  # epochs 3 and 4 only
        for got, want in zip(_weights(rank), _weights(uninterrupted)):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


# -- bad input -------------------------------------------------------------------------------------

def _torch_snippet(code, **env):
    return run(python("-c", code), timeout=120, env=_env(**env), check=False)


MODEL = ("import kerasdist, keras\n"
         "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n")


def test_a_tensorflow_only_word_on_torch_names_the_words_that_work_there():
    result = _torch_snippet(MODEL + "model.compile(loss='mse', distribute='mirrored')")
    assert result.returncode != 0
    assert "BackendError" in result.stdout and "'mirrored'" in result.stdout
    assert "work on 'torch'" in result.stdout and "data_parallel" in result.stdout, result.stdout[-2000:]


def test_torch_not_installed_gives_the_install_command():
    code = ("import sys\nsys.modules['torch'] = None  # as if torch were not installed\n"
            "import kerasdist\n"
            "row = [r for r in kerasdist.list_plugins() if r['name'] == 'data_parallel' and 'torch' in r['backends']][0]\n"
            "print('REASON', row['reason'])\nprint('INSTALL', row['install'])")
    out = _torch_snippet(code).stdout
    assert "pip install 'kerasdist[torch]'" in out and "REASON None" not in out, out[-2000:]


def test_keras_distribution_together_with_distribute_is_refused():
    code = ("import keras\nkeras.distribution.set_distribution(keras.distribution.DataParallel(devices=['cpu:0']))\n"
            + MODEL + "model.compile(loss='mse', distribute='data_parallel')")
    result = _torch_snippet(code)
    assert result.returncode != 0 and "KerasdistError" in result.stdout
    assert "set_distribution" in result.stdout and "remove" in result.stdout, result.stdout[-2000:]


def test_a_rendezvous_port_in_use_is_named_with_the_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = _torch_snippet(MODEL + "model.compile(loss='mse', distribute='ddp')", RANK="0", WORLD_SIZE="2",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert result.returncode != 0 and "ClusterConfigError" in result.stdout
    assert f"port {port}" in result.stdout and "already in use" in result.stdout, result.stdout[-2000:]


def _cuda_devices():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 NVIDIA GPUs (NCCL, one process per GPU)")
def test_two_gpus_with_nccl_train_like_one_process(tmp_path, one_process):
    """One process per GPU (LOCAL_RANK picks it), NCCL: the same weights as one process."""
    ranks = _launch(tmp_path)
    _assert_like_one_process(ranks, one_process, atol=1e-5)
