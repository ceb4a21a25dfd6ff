"""distribute="data_parallel" on the PyTorch backend (plugins/torch_distributed), in real processes.

Every torch process is a child (KERAS_BACKEND is fixed per process and this pytest process runs
TensorFlow); loopback only, each run with a timeout, no process left behind. Runtimes on 2 CPU cores are
in the report of the change that added them; the scenarios that only check training share one launch
(and one plain process for their references) to spare a torch start-up and a rendezvous each.
"""

import glob
import json
import os
import re
import socket
import time

import numpy as np
import pytest

from helpers import ROOT, child_env, processes_with, python, run
from kerasdist_plugins.torch_distributed import allocator

pytest.importorskip("torch")

WORKER = os.path.join("tests", "workers", "torch_train.py")
CASES = os.path.join("tests", "workers", "torch_cases.py")
KERASDIST = os.path.join(os.path.dirname(python()[0]), "kerasdist")
TORCHRUN = os.path.join(os.path.dirname(python()[0]), "torchrun")
TIMEOUT = 240


def _env(**extra):
    return child_env(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", **extra)


def _launch(out, *args, check=True, **env):
    env.setdefault("KERASDIST_BACKUP_DIR", f"{out}-backups")  # kerasdist's private backups, kept out of ~/.cache
    result = run([KERASDIST, "launch", "-n", "2", "--", WORKER, str(out), *args], timeout=TIMEOUT,
                 env=_env(**env), check=check)
    if not check:
        return result
    return [np.load(os.path.join(out, f"rank{r}.npz")) for r in range(2)]


#: scenario -> torch_train.py switches. All of them train in ONE `kerasdist launch -n 2` and their references
#: in ONE plain process (tests/workers/torch_cases.py runs them in turn): one start-up and rendezvous for all.
SCENARIOS = {"built": [], "unbuilt": ["--unbuilt"], "uneven": ["--rows", "46", "--batch", "15"],
             "no_metrics": ["--no-metrics", "--rows", "46", "--batch", "15"],
             "own_step": ["--custom-step", "--rows", "46", "--batch", "15"],
             "recompile": ["--recompile", "--rows", "46", "--batch", "15"],
             "added_losses": ["--added-losses", "--rows", "46", "--batch", "15"]}
#: keras.io "Customizing what happens in fit() with PyTorch" (tests/workers/torch_guides.py), none of whose steps calls
#: scale_loss: 11 rows in batches of 4 (a last batch of 3: shares of 1 and 2 rows), 9 rows (a last batch of 1: one
#: rank's share empty; with synchronized BatchNormalization that rank's moving statistics move with the global
#: batch's). Also scenarios of the shared launch, and of the torchrun test.
GUIDES = {"guide_first": ["--guide", "first", "--rows", "11", "--batch", "4"],
          "guide_first_sync_bn": ["--guide", "first_bn", "--sync-bn", "--rows", "11", "--batch", "4"],
          "guide_sync_bn_empty_share": ["--guide", "first_bn", "--sync-bn", "--rows", "9", "--batch", "4"],
          "guide_lower": ["--guide", "lower", "--rows", "9", "--batch", "4"],
          "guide_sample_weight": ["--guide", "sample_weight", "--rows", "11", "--batch", "4"],
          "guide_test_step": ["--guide", "test_step", "--rows", "9", "--batch", "4"],
          "guide_gan_data_noise": ["--guide", "gan_data_noise", "--rows", "11", "--batch", "4"],
          "guide_gan": ["--guide", "gan", "--rows", "9", "--batch", "4"]}
SCENARIOS.update(GUIDES)
#: fit(shuffle=...) after keras.utils.set_random_seed: the ranks draw one process's order (keras_order.py): arrays
#: (a model fit builds; shuffle="batch"), a PyDataset (workers=1) and a DataLoader whose sampler draws from torch's
#: global generator
SHUFFLED = {"shuffled_arrays_unbuilt": ["--unbuilt", "--shuffle", "true"],
            "shuffled_batches": ["--shuffle", "batch"],
            "shuffled_py_dataset": ["--input", "pydataset", "--shuffle", "true"],
            "reordered_py_dataset": ["--input", "pydataset_reordered", "--epochs", "3"],
            "shuffling_loader": ["--input", "dataloader_shuffled"]}
SHUFFLED = {name: [*argv, "--fit-seed", "7", "--rows", "46", "--batch", "15"] for name, argv in SHUFFLED.items()}
SCENARIOS.update(SHUFFLED)
#: run only under the launch: a loss summed over rows (refused), the SIGKILL test's uninterrupted 4-epoch run
#: a custom step's logs: backed by a metric on one rank only, inf with an empty share (9 rows), per row (refused);
#: a custom step applying an optimizer kept in a dict (refused)
LAUNCH_ONLY = {"sum_loss": ["--loss-reduction", "sum"], "uninterrupted": ["--epochs", "4"],
               "tracked_on_one_rank": ["--guide", "tracked_on_one_rank", "--rows", "9", "--batch", "4"],
               "per_row_log": ["--guide", "per_row_log", "--rows", "11", "--batch", "4"],
               "optimizer_in_dict": ["--guide", "optimizer_in_dict", "--rows", "11", "--batch", "4", "--epochs", "1"],
               "shuffled_unseeded": ["--shuffle", "true", "--rank-seeds", "--rows", "46", "--batch", "15"]}


def _run_scenarios(out, scenarios, command, **env):
    cases = json.dumps([{"name": name, "argv": [os.path.join(out, name), *argv]} for name, argv in scenarios.items()])
    result = run([*command, CASES, WORKER, str(out), cases], timeout=TIMEOUT, env=_env(**env), check=False)
    return str(out), result.stdout, result.returncode


def _scenario(runs, name, ranks=(0, 1)):
    """The saved results of one scenario of a shared run (its own error if it raised)."""
    out, output, _ = runs
    errors = [open(path).read() for path in sorted(glob.glob(os.path.join(out, f"{name}.error-rank*.txt")))]
    missing = [r for r in ranks if not os.path.exists(os.path.join(out, name, f"rank{r}.npz"))]
    assert not errors and not missing, f"{name}: {errors or f'no results of ranks {missing}'}\n{output[-4000:]}"
    return [np.load(os.path.join(out, name, f"rank{r}.npz")) for r in ranks]


def _weights(npz):
    return [npz[k] for k in sorted((k for k in npz.files if k.startswith("arr_")), key=lambda k: int(k[4:]))]


def _assert_like_one_process(ranks, single, atol):
    for rank in ranks:
        for got, want in zip(_weights(rank), _weights(single)):
            np.testing.assert_allclose(got, want, atol=atol, rtol=0)
        np.testing.assert_allclose(rank["loss"], single["loss"], atol=atol, rtol=1e-6)  # all-reduced logs
        np.testing.assert_allclose(rank["batch_logs"], single["batch_logs"], atol=atol, rtol=1e-6)  # each batch's
    first, second = ranks
    np.testing.assert_array_equal(first["batch_logs"], second["batch_logs"])
    np.testing.assert_array_equal(first["evaluate"], second["evaluate"])  # every rank: the same metrics
    np.testing.assert_array_equal(first["predict"], second["predict"])  # every rank: every prediction
    np.testing.assert_allclose(first["evaluate"], single["evaluate"], atol=atol, rtol=1e-6)
    np.testing.assert_allclose(first["predict"], single["predict"], atol=atol, rtol=1e-6)


def _no_process_left(token):
    time.sleep(0.5)
    assert not processes_with(token), f"processes left behind: {processes_with(token)}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each scenario trained in one process on the same global batches (SGD, same seed, 2 epochs)."""
    return _run_scenarios(tmp_path_factory.mktemp("single"), {name: [*argv, "--distribute", "none"]
                                                              for name, argv in SCENARIOS.items()}, python())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each scenario (and the SIGKILL test's uninterrupted run) trained by one `kerasdist launch -n 2`."""
    out = tmp_path_factory.mktemp("launch")
    return _run_scenarios(out, {**SCENARIOS, **LAUNCH_ONLY}, [KERASDIST, "launch", "-n", "2", "--"],
                          KERASDIST_BACKUP_DIR=f"{out}-backups")  # kerasdist's private backups, not in ~/.cache


# -- Must show 1 -----------------------------------------------------------------------------------

def test_kerasdist_launch_two_ranks_train_like_one_process(two_ranks, one_process):
    """Model built before compile, each rank seeding other weights (rank 0's reach every rank)."""
    ranks = _scenario(two_ranks, "built")
    _assert_like_one_process(ranks, _scenario(one_process, "built", [0])[0], atol=1e-5)
    kept = allocator._why_not(os.environ) or "kept"  # keep_freed_memory=True on CPU, unless this machine chose
    assert [str(rank["allocator"]) for rank in ranks] == [kept, kept]
    out, output, returncode = two_ranks
    assert returncode == 0 or glob.glob(os.path.join(out, "*.error-rank*")), output[-3000:]  # else: exits cleanly
    _no_process_left(out)


def test_a_model_built_after_fit_starts_from_one_processs_weights(two_ranks, one_process):
    """fit's symbolic build (meta tensors) ran kerasdist's metric all-reduce, whose meta kernel draws from Python's
    random, which Keras seeds every unseeded initializer from: models built later started elsewhere (0.96 off)."""
    rank0 = _scenario(two_ranks, "built")[0]
    assert np.array_equal(rank0["later_init"], _scenario(one_process, "built", [0])[0]["later_init"])


#: the torchrun test's keras.io custom steps in `make test` (all of GUIDES run under the shared launch; the extended
#: tier runs all of them under torchrun too)
TORCHRUN_GUIDES = ("guide_first", "guide_sync_bn_empty_share")


def test_torchrun_two_ranks_train_like_one_process(tmp_path, one_process):
    """The default model and keras.io's custom steps, under torchrun (one start-up for all)."""
    _torchrun(tmp_path, one_process, TORCHRUN_GUIDES)


def test_torchrun_trains_every_keras_io_custom_step_like_one_process(tmp_path, one_process):
    _torchrun(tmp_path, one_process, [name for name in GUIDES if name not in TORCHRUN_GUIDES])


def _torchrun(out, one_process, guides):
    runs = _run_scenarios(out, {name: SCENARIOS[name] for name in ("built", *guides)},
                          [TORCHRUN, "--standalone", "--nproc-per-node", "2"])
    _assert_like_one_process(_scenario(runs, "built"), _scenario(one_process, "built", [0])[0], atol=1e-5)
    for name in guides:
        _assert_guide_step(runs, one_process, name)
    _no_process_left(str(out))


def _assert_guide_step(runs, one_process, name):
    """Both ranks hold the same weights and log the same figures, those of one process (within 1e-5) where the
    step's randomness is the same (the guide's GAN draws its latent vectors per rank: ranks identical only)."""
    first, second = ranks = _scenario(runs, name)
    for got, other in zip(_weights(first), _weights(second)):
        np.testing.assert_array_equal(got, other, err_msg=name)
    logs = ["batch_logs", "evaluate", *(k for k in first.files if k.startswith("history_"))]
    for key in logs:
        np.testing.assert_array_equal(first[key], second[key], err_msg=f"{name}: {key}")
    if name == "guide_gan":
        return
    single = _scenario(one_process, name, [0])[0]
    assert sorted(k for k in single.files if k.startswith("history_")) == sorted(logs[2:]), name
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(_weights(first), _weights(single)))
    print(f"{name}: max|w - w_one_process| {worst:.2g}")  # pytest -s shows each model's figure
    for rank in ranks:
        for got, want in zip(_weights(rank), _weights(single)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)
        for key in logs:
            np.testing.assert_allclose(rank[key], single[key], atol=1e-5, rtol=1e-6, err_msg=f"{name}: {key}")


@pytest.mark.parametrize("name", list(GUIDES))
def test_keras_io_custom_steps_train_like_one_process(two_ranks, one_process, name):
    """keras.io's torch custom steps (no scale_loss: each rank's gradient weighted by its rows in apply; with
    synchronized BatchNormalization also in its backward all-reduce), a step's own logs
    (``{m.name: m.result()}``, trackers made in ``__init__``) the global batch's in every rank, a custom
    ``test_step`` in ``evaluate``, both optimizers of a GAN averaged (its ranks identical), an empty share."""
    _assert_guide_step(two_ranks, one_process, name)


def test_a_model_built_by_fit_trains_like_one_process(two_ranks, one_process):
    """No Input: fit builds the model (kerasdist builds it from this rank's first batch, then every rank takes
    rank 0's weights: each rank seeds its own)."""
    _assert_like_one_process(_scenario(two_ranks, "unbuilt"), _scenario(one_process, "unbuilt", [0])[0], atol=1e-5)


@pytest.mark.parametrize("name", SHUFFLED)
def test_a_shuffled_fit_after_set_random_seed_trains_in_one_processs_order(two_ranks, one_process, name):
    _assert_like_one_process(_scenario(two_ranks, name), _scenario(one_process, name, [0])[0], atol=1e-5)


def test_a_shuffled_fit_without_a_common_random_state_trains_alike_in_every_rank(two_ranks):
    """Each rank's torch and Python random states differ: one order from a seed rank 0 chose, the same everywhere."""
    first, second = _scenario(two_ranks, "shuffled_unseeded")
    assert not first["states_seen_same"].any() and not second["states_seen_same"].any()  # Python's, torch's
    for mine, theirs in zip(_weights(first), _weights(second)):
        np.testing.assert_array_equal(mine, theirs)


def test_uneven_and_empty_shares_train_like_one_process(two_ranks, one_process):
    """46 rows in global batches of 15: shares of 7 and 8, and a last batch of 1 row (one rank's share is
    empty) train as one device does."""
    _assert_like_one_process(_scenario(two_ranks, "uneven"), _scenario(one_process, "uneven", [0])[0], atol=1e-5)


def test_added_losses_and_a_regularizer_train_like_one_process(two_ranks, one_process):
    """docs/equivalence.md, "add_loss": a mean over rows, a keras.losses.Loss and a kernel regularizer, uneven
    shares and an empty one included."""
    _assert_like_one_process(_scenario(two_ranks, "added_losses"), _scenario(one_process, "added_losses", [0])[0],
                             atol=1e-5)


# -- Must show 3, and a rank that dies ---------------------------------------------------------------

def test_batch_logs_take_one_all_reduce_a_step_without_metrics_and_are_the_global_batch_s(two_ranks, one_process):
    """Keras's own step: the loss tracker's states travel in the gradients' all-reduce (no metrics: one
    all-reduce a step; compiled metrics: one more); a model class with its own train_step: every state summed
    when the logs are read; a model compiled again (new optimizer, now with metrics) after a first fit."""
    expected = {"no_metrics": 1, "built": 2, "own_step": 2, "recompile": 2}
    for name, count in expected.items():
        ranks = _scenario(two_ranks, name)
        _assert_like_one_process(ranks, _scenario(one_process, name, [0])[0], atol=1e-5)
        for rank in ranks:  # the first step also agrees on the largest share
            assert set(rank["all_reduces"][1:].tolist()) == {count}, (name, rank["all_reduces"])


def test_sigkilled_worker_job_ends_then_resumes_from_the_backup(tmp_path, two_ranks):
    """Rank 1 SIGKILLed in epoch 3: the job ends non-zero within 30 s, no process left; relaunched unchanged,
    it resumes at epoch 3 from kerasdist's private backup (rank 0 wrote it) and ends with the weights of an
    uninterrupted run (within 1e-6; that run is a scenario of the shared launch)."""
    backups = str(tmp_path / "backups")
    uninterrupted = _scenario(two_ranks, "uninterrupted")[0]
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

def _raised_in_every_rank(two_ranks, case):
    """The error text case ``case`` of the shared launch wrote in each rank (both must have written one)."""
    out, output, _ = two_ranks
    texts = []
    for rank in (0, 1):
        path = os.path.join(out, f"{case}.error-rank{rank}.txt")
        assert os.path.exists(path), output[-3000:]
        texts.append(open(path).read())
    return texts


def test_a_loss_summed_over_rows_is_refused_at_compile_in_every_rank(two_ranks):
    """reduction="sum" trained 3.7e-2 off one process (each rank's gradient was weighted as a mean's), silently."""
    for raised in _raised_in_every_rank(two_ranks, "sum_loss"):
        assert raised.startswith("KerasdistError") and "reduction 'sum'" in raised, raised
        assert "sum_over_batch_size" in raised and "scale the learning rate" in raised, raised


def test_custom_steps_logs_reduce_alike_in_every_rank_and_per_row_logs_are_refused(two_ranks):
    """A log that is a metric's result on one rank only, and a log inf on a rank with an empty share: before, the
    ranks sent all-reduces of different lengths (gloo: "Connection reset by peer") and inf * 0 = NaN; a per-row
    tensor log (each rank: its share's rows) failed in a TypeError (or a size mismatch)."""
    first, second = _scenario(two_ranks, "tracked_on_one_rank")
    for key in ("batch_logs", *(k for k in first.files if k.startswith("history_"))):
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    assert np.all(np.isinf(first["history_overflow"])), first["history_overflow"]
    assert np.all(np.isfinite(first["history_batch_loss"])) and np.all(np.isfinite(first["history_loss"]))
    for raised in _raised_in_every_rank(two_ranks, "per_row_log"):
        assert raised.startswith("KerasdistError") and "['y_pred']" in raised and "scalars" in raised, raised


def test_custom_steps_optimizer_kerasdist_cannot_see_is_refused_at_the_first_step_in_every_rank(two_ranks):
    """An optimizer kept in a dict applied each rank's own gradients: the ranks drifted apart, silently."""
    for raised in _raised_in_every_rank(two_ranks, "optimizer_in_dict"):
        assert raised.startswith("KerasdistError") and "/kernel" in raised and "self.d_optimizer" in raised, raised


def _torch_snippet(code, **env):
    return run(python("-c", code), timeout=120, env=_env(**env), check=False)


MODEL = ("import kerasdist, keras\n"
         "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n")


#: independent bad-input checks that share one torch process: each builds its own model and must raise its own error
SHARED_CHECKS = {
    "mirrored": MODEL + "model.compile(loss='mse', distribute='mirrored')",
    "set_distribution": "import keras\nkeras.distribution.set_distribution(keras.distribution.DataParallel("
                        "devices=['cpu:0']))\n" + MODEL + "model.compile(loss='mse', distribute='data_parallel')",
}
RUN_CHECKS = """
import json, sys
for name, code in json.loads(sys.argv[1]).items():
    try:
        exec(code, {})
    except Exception as exc:
        print(f"CHECK {name} RAISED {type(exc).__module__}.{type(exc).__qualname__}: {exc}", flush=True)
    else:
        print(f"CHECK {name} RAISED nothing", flush=True)
"""


@pytest.fixture(scope="module")
def shared_checks():
    """name -> what that check printed (its error's full class name and message)."""
    output = run(python("-c", RUN_CHECKS, json.dumps(SHARED_CHECKS)), timeout=120, env=_env()).stdout
    found = dict(re.findall(r"^CHECK (\S+) RAISED (.*(?:\n(?!CHECK ).*)*)", output, re.M))
    assert set(found) == set(SHARED_CHECKS), output[-3000:]
    return found


def test_a_tensorflow_only_word_on_torch_names_the_words_that_work_there(shared_checks):
    raised = shared_checks["mirrored"]
    assert "BackendError" in raised and "'mirrored'" in raised
    assert "work on 'torch'" in raised and "data_parallel" in raised, raised[-2000:]


def test_torch_not_installed_gives_the_install_command():
    code = ("import sys\nsys.modules['torch'] = None  # as if torch were not installed\n"
            "import kerasdist\n"
            "row = [r for r in kerasdist.list_plugins() if r['name'] == 'data_parallel' and 'torch' in r['backends']][0]\n"
            "print('REASON', row['reason'])\nprint('INSTALL', row['install'])")
    out = _torch_snippet(code).stdout
    assert "pip install 'kerasdist[torch]'" in out and "REASON None" not in out, out[-2000:]


def test_keras_distribution_together_with_distribute_is_refused(shared_checks):
    raised = shared_checks["set_distribution"]
    assert "KerasdistError" in raised
    assert "set_distribution" in raised and "remove" in raised, raised[-2000:]


def test_a_rendezvous_port_in_use_is_named_with_the_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = _torch_snippet(MODEL + "model.compile(loss='mse', distribute='ddp')", RANK="0", WORLD_SIZE="2",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert result.returncode != 0 and "ClusterConfigError" in result.stdout
    assert f"port {port}" in result.stdout and "already in use" in result.stdout, result.stdout[-2000:]


def test_each_ranks_rows_reach_keras_as_tensors_on_the_arrays_memory():
    """bench/bench_torch.py, issue 20: Keras's conversion copies each NumPy batch (np.array); a rank's rows go to
    Keras as torch tensors on the arrays' memory instead; a read-only array stays NumPy (Keras copies it)."""
    code = ("import numpy as np\nfrom kerasdist_plugins.torch_distributed import data\n"
            "x = np.arange(40, dtype='float32').reshape(10, 4)\ny = np.arange(10)\n"
            "x_part, y_part = data.from_arrays(x, y, None, 4, False, 1, 2)[1]  # batch 1: rows 4..7; rank 1: 6, 7\n"
            "print('SHARED', type(x_part).__name__, x_part.data_ptr() == x[6:].ctypes.data, y_part.tolist())\n"
            "y.flags.writeable = False\n"
            "print('READ-ONLY', type(data.from_arrays(x, y, None, 4, False, 1, 2)[1][1]).__name__)")
    out = _torch_snippet(code).stdout
    assert "SHARED Tensor True [6, 7]" in out and "READ-ONLY ndarray" in out, out[-2000:]


def _cuda_devices():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 NVIDIA GPUs (NCCL, one process per GPU)")
def test_two_gpus_with_nccl_train_like_one_process(tmp_path, one_process):
    """One process per GPU (LOCAL_RANK picks it), NCCL: the same weights as one process."""
    ranks = _launch(tmp_path)
    _assert_like_one_process(ranks, _scenario(one_process, "built", [0])[0], atol=1e-5)
