"""distribute="multiworker" with real worker processes talking gRPC collectives on 127.0.0.1.

Every test starts its own processes with a timeout (tests/helpers.run kills the
whole process group) and checks that none is left behind.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from tests.helpers import ROOT, child_env, finish, free_port, kill_group, max_diff, python, run, start, weights

pytestmark = [pytest.mark.slow]

KERASDIST = os.path.join(os.path.dirname(sys.executable), "kerasdist")
EXAMPLE = os.path.join(ROOT, "examples", "multiworker", "train.py")
WORKER = os.path.join(ROOT, "tests", "workers", "mw_train.py")
EXAMPLE_ARGS = ["--epochs", "2", "--examples", "256", "--batch-size", "64"]


def tf_config(ports, index):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def left_behind(marker):
    """Processes whose command line mentions ``marker`` (nothing may survive a test)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(cmdline)
    return found


@pytest.fixture(scope="module")
def hand_set_run(tmp_path_factory):
    """The example run by hand: two processes with TF_CONFIG set, plus one single process."""
    out = tmp_path_factory.mktemp("handset")
    ports = [free_port(), free_port()]
    procs = [start(python(EXAMPLE, *EXAMPLE_ARGS, "--save-weights", str(out / "mw")),
                   TF_CONFIG=tf_config(ports, i), KERASDIST_JOIN_TIMEOUT=60) for i in range(2)]
    procs.append(start(python(EXAMPLE, *EXAMPLE_ARGS, "--save-weights", str(out / "single"))))
    results = finish(procs, timeout=150)
    for code, output in results:
        assert code == 0, output[-4000:]
    return out, results


@pytest.mark.timeout(180)
def test_two_workers_match_each_other_and_single_process_training(hand_set_run):
    out, results = hand_set_run
    w0, w1, single = weights(out / "mw", 0), weights(out / "mw", 1), weights(out / "single", 0)
    between, to_single = max_diff(w0, w1), max_diff(w0, single)
    print(f"max |w0 - w1| = {between:.3g}; max |w0 - single process| = {to_single:.3g}")
    assert between == 0.0
    assert to_single <= 1e-5
    assert "on 2 worker(s)" in results[0][1] and "final loss" not in results[1][1]  # chief-only print


@pytest.mark.timeout(180)
def test_launch_runs_the_same_example_to_the_same_weights(hand_set_run, tmp_path):
    out, _ = hand_set_run
    result = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", EXAMPLE, *EXAMPLE_ARGS,
                  "--save-weights", str(tmp_path)], timeout=150)
    assert max_diff(weights(tmp_path, 0), weights(tmp_path, 1)) == 0.0
    diff = max_diff(weights(tmp_path, 0), weights(out / "mw", 0))
    print(f"max |launch - hand-set TF_CONFIG| = {diff:.3g}")
    assert diff <= 1e-6
    lines = result.stdout.splitlines()
    assert any(line.startswith("[0] final loss") for line in lines)
    assert any(line.startswith("[0] Epoch 2/2") for line in lines)
    assert not any(line.startswith("[1] Epoch") or line.startswith("[1] final") for line in lines)


@pytest.mark.timeout(240)
def test_worker_killed_in_epoch_3_of_5_resumes_with_epochs_3_to_5(tmp_path):
    common = [WORKER, "--epochs", "5", "--examples", "128", "--batch", "16"]
    env = child_env(KERASDIST_BACKUP_DIR=str(tmp_path / "backup"), KERASDIST_JOIN_TIMEOUT=60)
    launch = [KERASDIST, "launch", "-n", "2", "--grace", "3"]
    crash = ["--crash-in-epoch", "3", "--crash-marker", str(tmp_path / "crashed"), "--out", str(tmp_path / "mw")]
    reference = start(python(WORKER, "--epochs", "5", "--examples", "128", "--batch", "16", "--distribute",
                             "none", "--out", str(tmp_path / "single")))

    first = run(launch + common + crash, timeout=150, env=env, check=False)
    assert first.returncode != 0, first.stdout[-3000:]
    begun = [line for line in first.stdout.splitlines() if "EPOCH_BEGIN" in line]
    assert begun == ["[0] EPOCH_BEGIN 1", "[0] EPOCH_BEGIN 2", "[0] EPOCH_BEGIN 3"], first.stdout[-3000:]
    assert "[1] CRASHING in epoch 3" in first.stdout
    assert not left_behind(str(tmp_path)), "workers survived the launcher"

    second = run(launch + common + crash, timeout=150, env=env)
    resumed = [line for line in second.stdout.splitlines() if "kerasdist: resuming" in line]
    assert len(resumed) == 1 and resumed[0].startswith("[0] kerasdist: resuming at epoch 3 from this job's backup")
    begun = [line for line in second.stdout.splitlines() if "EPOCH_BEGIN" in line]
    assert begun == ["[0] EPOCH_BEGIN 3", "[0] EPOCH_BEGIN 4", "[0] EPOCH_BEGIN 5"], second.stdout[-3000:]
    final = _final_logs(second.stdout)
    print("resumed run's final metrics:", final)
    assert final["epochs_run"] == 3 and np.isfinite(final["loss"])
    assert os.listdir(tmp_path / "backup") == [], "backup removed after a completed fit"

    (code, output), = finish([reference], timeout=120)
    assert code == 0, output[-3000:]
    diff = max_diff(weights(tmp_path / "mw", 0), weights(tmp_path / "single", 0))
    print(f"max |resumed 2-worker - uninterrupted single process| = {diff:.3g}")
    assert diff <= 1e-5  # no completed epoch lost or repeated


@pytest.mark.timeout(120)
def test_a_worker_that_never_joins_times_out_with_a_clear_message():
    ports = [free_port(), free_port()]
    started = time.monotonic()
    (code, output), = finish([start(python(WORKER, "--out", "/nonexistent"), TF_CONFIG=tf_config(ports, 0),
                                    KERASDIST_JOIN_TIMEOUT=3)], timeout=90)
    assert code != 0, output[-3000:]
    assert "the cluster did not come up within 3 s" in output
    assert f"not reachable: worker 1 (127.0.0.1:{ports[1]})" in output
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_port_in_use_fails_at_start_naming_the_port():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (code, output), = finish([start(python(WORKER, "--out", "/nonexistent"),
                                        TF_CONFIG=tf_config([port, free_port()], 0))], timeout=90)
    assert code != 0
    assert f"Port {port} of worker 0 (127.0.0.1:{port}) is already in use" in output


@pytest.mark.timeout(120)
def test_importing_kerasdist_after_a_tensorflow_op_is_a_clear_error():
    script = ("import tensorflow as tf; tf.constant(1.0) + 1\n"
              "import kerasdist, keras\n"
              "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
              "m.compile(loss='mse', distribute='multiworker')\n")
    (code, output), = finish([start(python("-c", script), TF_CONFIG=tf_config([free_port(), free_port()], 0))],
                             timeout=90)
    assert code != 0 and "Put `import kerasdist` before any TensorFlow/Keras code" in output, output[-3000:]


@pytest.mark.timeout(180)
def test_uneven_shuffled_numpy_data_and_only_the_chief_writes(tmp_path):
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    result = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", WORKER, "--examples", "37", "--batch",
                  "8", "--shuffle", "--verbose", "2", "--write-dir", str(tmp_path / "w"), "--out",
                  str(tmp_path / "mw"), "--epochs", "2", "--refit-alone"], timeout=150,
                 env=child_env(TMPDIR=str(scratch_root), KERASDIST_BACKUP_DIR=str(tmp_path / "backup")))
    assert max_diff(weights(tmp_path / "mw", 0), weights(tmp_path / "mw", 1)) == 0.0
    assert sorted(os.listdir(tmp_path / "w")) == ["log.csv", "model.keras", "tb"]
    assert len(open(tmp_path / "w" / "log.csv").read().splitlines()) == 3  # header + 2 epochs, one writer
    lines = result.stdout.splitlines()
    assert any(line.startswith("[0] Epoch 2/2") for line in lines)
    assert any(line.startswith("[0] 5/5") for line in lines), result.stdout[-2000:]  # ceil(37 / 8) steps
    assert not any(line.startswith("[1] Epoch") for line in lines)
    assert not [p for p in scratch_root.rglob("*") if "kerasdist-worker" in str(p)], "scratch left behind"
    # then the chief fits its checkpoint, restored with distribute="multiworker", after worker 1 exited: the
    # error says what to do (issue 29 item 8)
    refit = next(line for line in lines if line.startswith("[0] REFIT_ERROR"))
    assert "rank 1 closed the connection (it exited)" in refit and "kerasdist.load_plain(path)" in refit
    assert "distribute=None" in refit and "same fit/evaluate calls" in refit


@pytest.mark.timeout(240)
def test_tf_data_input_is_sharded_and_equals_single_process_on_the_global_batch(tmp_path):
    """A tf.data.Dataset of global batches: each worker trains on its shard, the result is the same
    as one process on the global batch (auto-shard DATA splits every global batch between workers)."""
    common = [WORKER, "--dataset", "--epochs", "2", "--examples", "96", "--batch", "16"]
    result = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", *common, "--out", str(tmp_path / "mw")],
                 timeout=180)
    run(python(*common, "--distribute", "none", "--out", str(tmp_path / "single")), timeout=120)
    w0, w1, single = weights(tmp_path / "mw", 0), weights(tmp_path / "mw", 1), weights(tmp_path / "single", 0)
    print(f"tf.data: max |w0 - w1| = {max_diff(w0, w1):.3g}; max |w0 - single| = {max_diff(w0, single):.3g}")
    assert "[0] TRANSPORT tcp" in result.stdout and "[1] TRANSPORT tcp" in result.stdout  # auto, probe off: the ring
    assert max_diff(w0, w1) == 0.0
    assert max_diff(w0, single) <= 1e-5
    assert max_diff(w0, _initial()) > 1e-3  # training moved the weights: the comparison can fail


@pytest.mark.timeout(240)
@pytest.mark.parametrize("communication, transport", [("tcp", "tcp"), ("ring", "tensorflow")])
def test_both_gradient_transports_equal_single_process_training(tmp_path, communication, transport):
    """kerasdist's TCP ring and TensorFlow's gRPC collectives give the same training and the same logs."""
    common = [WORKER, "--dataset", "--epochs", "2", "--examples", "96", "--batch", "16"]
    result = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", "--communication", communication,
                  *common, "--out", str(tmp_path / "mw")], timeout=180)
    single = run(python(*common, "--distribute", "none", "--out", str(tmp_path / "single")), timeout=120)
    assert f"[0] TRANSPORT {transport}" in result.stdout and f"[1] TRANSPORT {transport}" in result.stdout
    w0, w1 = weights(tmp_path / "mw", 0), weights(tmp_path / "mw", 1)
    to_single = max_diff(w0, weights(tmp_path / "single", 0))
    logs, single_logs = _final_logs(result.stdout), _final_logs(single.stdout)
    print(f"{communication}: max |w0 - w1| = {max_diff(w0, w1):.3g}; max |w0 - single| = {to_single:.3g}; "
          f"logs {logs} vs single {single_logs}")
    assert max_diff(w0, w1) == 0.0 and to_single <= 1e-5
    for key in ("loss", "mae"):  # per-step logs averaged over the workers = the global batch's
        assert abs(logs[key] - single_logs[key]) <= 1e-5


def _final_logs(output):
    return json.loads(next(line for line in output.splitlines() if "FINAL " in line).split("FINAL ", 1)[1])


@pytest.mark.timeout(120)
def test_workers_disagreeing_on_the_tcp_ring_stop_with_a_clear_error():
    ports = [free_port(), free_port()]
    procs = [start(python(WORKER, "--out", "/nonexistent"), TF_CONFIG=tf_config(ports, i),
                   KERASDIST_JOIN_TIMEOUT=60, KERASDIST_COMMUNICATION=setting)
             for i, setting in enumerate(("tcp", "ring"))]
    for code, output in finish(procs, timeout=100):
        assert code != 0, output[-3000:]
        assert ("KERASDIST_COMMUNICATION=tcp (worker 0) asks for the TCP gradient ring, which cannot run "
                "(worker 1: KERASDIST_COMMUNICATION=ring)") in output, output[-3000:]


def _initial():
    import keras

    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)])
    return model.get_weights()


def test_shuffled_multi_input_multi_output_arrays_keep_their_structure():
    from kerasdist_plugins.multiworker import workers

    rng = np.random.default_rng(0)
    a, b = rng.random((10, 3), dtype="float32"), rng.random((10, 5), dtype="float32")
    y1, y2 = rng.random((10, 1), dtype="float32"), rng.random((10, 2), dtype="float32")
    call_kwargs = {"x": [a, b], "y": [y1, y2], "batch_size": 4, "shuffle": True}
    workers.shuffle_arrays_alike(call_kwargs, seed=3)
    (xa, xb), (t1, t2) = next(iter(call_kwargs["x"]))
    assert (xa.shape, xb.shape, t1.shape, t2.shape) == ((4, 3), (4, 5), (4, 1), (4, 2))
    rows = [int(np.flatnonzero(np.all(a == row, axis=1))[0]) for row in xa.numpy()]
    np.testing.assert_array_equal(xb.numpy(), b[rows])  # shuffled together: rows still aligned
    np.testing.assert_array_equal(t2.numpy(), y2[rows])


GUIDE_VARIANTS = ("true_positives", "loaded", "shuffled_arrays")


@pytest.mark.timeout(300)
def test_built_in_methods_guide_under_the_strategy_step_equals_one_process_on_every_rank(tmp_path):
    """keras.io "Training & evaluation with the built-in methods" with KERASDIST_STRATEGY_FREE=off
    (MultiWorkerMirroredStrategy's step), each variant's weights and every epoch's logs (fit, validation, a reload's
    fit, evaluate) equal one process's on both ranks. Before (issue 29 item 4): its CategoricalTruePositives crashed
    ("'str' object has no attribute 'is_floating'"), load_model failed ("colocate_vars_with" in
    compile_from_config), epoch logs were each rank's own share's (14 and 10 true positives for one process's 24),
    shuffled arrays trained in kerasdist's seeded order (6.8e-3 off)."""
    from tests.test_multiworker_strategy_free import CUSTOM_STEP, _assert_same, _results

    names = ",".join(GUIDE_VARIANTS)
    launched = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", CUSTOM_STEP, names, "multiworker"],
                   timeout=240, env=child_env(KERASDIST_STRATEGY_FREE="off", TEST_SAVE_DIR=str(tmp_path))).stdout
    single = run(python(CUSTOM_STEP, names, "none"), timeout=180, env=child_env(TEST_SAVE_DIR=str(tmp_path))).stdout
    assert "[0] kerasdist: multiworker trains strategy-free" not in launched
    launched, single = [_results(launched, f"[{rank}] ") for rank in (0, 1)], _results(single, "")
    for variant in GUIDE_VARIANTS:
        for rank in (0, 1):
            _assert_same(launched[rank][variant], single[variant], f"{variant} rank {rank}")
