"""distribute="multiworker" strategy-free (issue 22; the default on CPU workers, KERASDIST_STRATEGY_FREE=on forces it):
plain Keras in each worker under the default strategy, gradients x rows, rows and loss over the TCP ring in one
message per step; and KERASDIST_STRATEGY_FREE=off, MultiWorkerMirroredStrategy's step. Real worker processes on
127.0.0.1 (kerasdist launch, timeouts); the broadcast of rank 0's state over a real two-rank ring in threads."""

import json
import os
import threading
import time

import numpy as np
import pytest

from kerasdist.plugin_tools import keras_shuffles_by_epoch
from tests.helpers import ROOT, child_env, python, run
from tests.test_multiworker import KERASDIST, WORKER, _initial, max_diff, weights

CUSTOM_STEP = os.path.join(ROOT, "tests", "workers", "mw_custom_step.py")
INPUTS = os.path.join(ROOT, "tests", "workers", "mw_inputs.py")


def _final_logs(output):
    return json.loads(next(line for line in output.splitlines() if "FINAL " in line).split("FINAL ", 1)[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("data", [["--dataset", "--examples", "96", "--batch", "16"],
                                  ["--examples", "100", "--batch", "15"]], ids=["dataset", "uneven-arrays"])
def test_strategy_free_training_equals_one_process_on_the_global_batch(tmp_path, data):
    common = [WORKER, *data, "--epochs", "2"]
    result = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", *common, "--out", str(tmp_path / "mw")],
                 timeout=200, env=child_env(KERASDIST_STRATEGY_FREE="on",
                                            KERASDIST_BACKUP_DIR=str(tmp_path / "backup")))
    single = run(python(*common, "--distribute", "none", "--out", str(tmp_path / "single")), timeout=120)
    w0, w1, one = weights(tmp_path / "mw", 0), weights(tmp_path / "mw", 1), weights(tmp_path / "single", 0)
    logs, single_logs = _final_logs(result.stdout), _final_logs(single.stdout)
    print(f"max |w0 - w1| = {max_diff(w0, w1):.3g}; max |w0 - single| = {max_diff(w0, one):.3g}; "
          f"logs {logs} vs single {single_logs}")
    assert "[0] TRANSPORT tcp" in result.stdout and "[1] TRANSPORT tcp" in result.stdout
    assert "[0] REPLICAS 1" in result.stdout and "[1] REPLICAS 1" in result.stdout  # the default strategy
    assert NOTICE in result.stdout and "[1] kerasdist: multiworker trains strategy-free" not in result.stdout
    assert max_diff(w0, w1) == 0.0 and max_diff(w0, one) <= 1e-5
    assert max_diff(w0, _initial()) > 1e-3  # training moved the weights: the comparison can fail
    for key in ("loss", "mae"):  # the loss in the gradients' message, mae's state summed: the global batch's
        assert abs(logs[key] - single_logs[key]) <= 1e-5


CUSTOM_VARIANTS = ("first", "lower", "two", "vae")
SPARSE_VARIANTS = ("sparse_sgd", "sparse_adam", "sparse_adamw", "sparse_adagrad", "sparse_rmsprop", "sparse_shared",
                   "sparse_mixed")  # tests/workers/mw_sparse.py
#: Keras 3.16 (the nightly) draws each epoch's shuffle from its number: one process's order whatever the seeds
EPOCH_KEYED = keras_shuffles_by_epoch()
INPUT_CASES = ("py_dataset", "py_dataset_shuffled", "generator", "sum_loss", "empty_share", "sparse_dataset",
               "shuffled_dataset", "py_dataset_threaded", "arrays_shuffled", "transfer", "added_losses",
               "data_loader", "tensors", "dict_inputs", "arrays_shuffled_rank_seeds", "jit_compile", "diverged")  # diverged: last


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_custom_train_steps_equal_one_process_weights_and_logs():
    """keras.io's custom ``train_step`` models (compute_loss or the model's own loss function and trackers; a
    second optimizer the model holds, a log no metric backs), trained one after the other in one process: weights
    and every epoch's logs equal plain Keras on the global batch. Before: "None values not supported" (no
    compute_loss), each worker logging its own loss, a second optimizer's gradients never summed. Issue 35 item 7:
    keras.io's VAE (its log ``loss`` is the ``total_loss`` tracker's result; trackers fed one scalar per step; an
    uneven last batch) logged the workers' average of their own results (per batch and epoch). Item 1: an
    Embedding's sparse gradients were summed dense, and adaptive optimizers then trained another model:
    SPARSE_VARIANTS, within 1e-6 (float16 compute: 1e-4)."""
    launched, single = _both(CUSTOM_STEP, ("in_dict", "per_row", *CUSTOM_VARIANTS, *SPARSE_VARIANTS), timeout=400)
    for variant in CUSTOM_VARIANTS + SPARSE_VARIANTS:
        atol = 1e-5 if variant in CUSTOM_VARIANTS else 1e-4 if variant == "sparse_mixed" else 1e-6
        for rank in (0, 1):
            _assert_same(launched[rank][variant], single[variant], f"{variant} rank {rank}", atol)
    for rank in (0, 1):  # an optimizer kept in a dict applied each worker's own gradients, silently
        raised = str(launched[rank]["in_dict"]["error"])
        assert "dense_1/kernel" in raised and "self.d_optimizer" in raised, raised
        raised = str(launched[rank]["per_row"]["error"])  # before: kept per worker, silently
        assert "['y_pred']" in raised and "scalars" in raised, raised


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_other_inputs_and_losses_equal_one_process():
    """A PyDataset and a generator of global batches are split per worker (before: every worker took whole
    batches); fit's shuffle of a PyDataset takes one order on every worker; a loss with reduction "sum" sums the
    workers' gradients (before: averaged, half the gradient); a batch smaller than the workers (one share empty)
    with BatchNormalization stays finite (before: NaN weights). Issue 29: a reshuffling tf.data pipeline, a threaded
    PyDataset and shuffled arrays train in one process's order (before: an extra iterator of the data before epoch 1
    shifted the first two, its pipeline made 256 elements for 192; the arrays took kerasdist's own seeded order);
    keras.io's transfer-learning flow (freeze, compile, fit, unfreeze, compile, fit) moves the base as one process
    does; add_loss of a mean and of a Loss, and a kernel regularizer, as one process (docs/equivalence.md).
    Issue 29 item 4: a PyDataset and a generator as validation_data (before: unpacked as (x, y, sample_weight), a
    ValueError at the first validation step); tensors (torch x, tf.Tensor y, JAX sample_weight), dict inputs of a
    tensor and an array with class_weight, scipy sparse validation data, torch DataLoaders (before: never split,
    every worker trained every row: the summed ``rows`` metric counted each twice; a shuffling DataLoader in each
    worker's own order, weights 0.035 off). jit_compile=True refused at compile in every worker. One process trains
    them in turn."""
    launched, single = _both(INPUTS, INPUT_CASES)
    _assert_diverged_ranks_stop_naming_both(launched, single)
    _assert_xla_refused_in_every_worker(launched, single)
    for case in INPUT_CASES[:-2]:
        for rank in (0, 1):
            got = launched[rank][case]
            for key in got:
                assert np.all(np.isfinite(got[key])), f"{case} {key} rank {rank}: {got[key]}"
            if case == "py_dataset_shuffled" or (case == "arrays_shuffled_rank_seeds" and not EPOCH_KEYED):
                _assert_same(got, launched[1][case], f"{case} rank {rank}")  # the workers' shared seeded order
            elif case != "empty_share":  # local BatchNormalization: per-worker batch moments, not one device's
                _assert_same(got, single[case], f"{case} rank {rank}")


def _assert_diverged_ranks_stop_naming_both(launched, single):
    """Issue 35 item 2: rank 1 left trial 1's fit (a failed checkpoint write) for trial 2's model of the same shapes
    while rank 0 still trained trial 1 (before: their steps paired across the two models, then a hang)."""
    assert single["diverged"]["errors"].size == 0
    want = ("rank 1 is in fit #1 of model 'trial_2' (its start)", "rank 0 in fit #1 of model 'trial_1' (epoch 1)")
    for rank in (0, 1):
        raised = str(launched[rank]["diverged"]["errors"][-1])
        assert raised.startswith("KerasdistError: distribute='multiworker'") and all(w in raised for w in want), raised


def _assert_xla_refused_in_every_worker(launched, single):
    """Neither step can run XLA across CPU workers (the ring cannot be called from XLA; TensorFlow's XLA has no CPU
    collectives: "Collectives are not yet implemented for CPU devices when compiling with XLA"): compile says so
    in every worker, before any step; one process compiles."""
    assert str(single["jit_compile"]["error"]) == ""
    for rank in (0, 1):
        raised = str(launched[rank]["jit_compile"]["error"])
        assert raised.startswith("KerasdistError: distribute='multiworker' on CPU workers cannot train with "
                                 "jit_compile=True") and "Pass jit_compile=False or 'auto'" in raised, raised


def _both(script, names, timeout=240):
    """Each name's RESULT per rank under `kerasdist launch -n 2`, and in one plain process."""
    launched = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", script, ",".join(names), "multiworker"],
                   timeout=timeout).stdout
    single = run(python(script, ",".join(names), "none"), timeout=timeout * 3 // 4).stdout
    return [_results(launched, f"[{rank}] ") for rank in (0, 1)], _results(single, "")


def _results(output, prefix):
    found = {}
    for line in output.splitlines():
        if line.startswith(prefix + "RESULT "):
            name, text = line[len(prefix + "RESULT "):].split(" ", 1)
            found[name] = {k: np.asarray(v) for k, v in json.loads(text).items()}
    return found


def _assert_same(got, want, where, atol=1e-5):
    assert sorted(got) == sorted(want) and len(got) >= 2, where
    for key in got:  # the weights, then every logged value of every epoch
        np.testing.assert_allclose(got[key], want[key], atol=atol, err_msg=f"{where}: {key}")


@pytest.mark.timeout(60)
def test_rank_zeros_weights_and_optimizer_state_reach_every_rank():
    import keras

    from kerasdist_plugins.multiworker.strategy_free import broadcast_state
    from tests.test_sparse_gradients import two_rings

    rings = two_rings()
    models = []
    for seed in (1, 2):  # different initial weights and optimizer state on each rank
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        model.fit(np.random.rand(8, 3), np.random.rand(8, 2), epochs=seed, verbose=0)
        models.append(model)
    expected = [v.numpy() for v in models[0].weights + models[0].optimizer.variables]
    assert max_diff(expected, [v.numpy() for v in models[1].weights + models[1].optimizer.variables]) > 1e-3
    try:
        threads = [threading.Thread(target=broadcast_state, args=(models[r], rings[r])) for r in range(2)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
    finally:
        [ring.close() for ring in rings if ring is not None]
    for model in models:
        got = [v.numpy() for v in model.weights + model.optimizer.variables]
        assert max_diff(expected, got) == 0.0
    assert int(models[1].optimizer.iterations.numpy()) == int(models[0].optimizer.iterations.numpy())


def test_a_bad_strategy_free_setting_names_the_valid_ones():
    import kerasdist
    from kerasdist_plugins.multiworker.strategy_free import setting

    assert setting({}) == "auto" and setting({"KERASDIST_STRATEGY_FREE": " ON"}) == "on"
    with pytest.raises(kerasdist.KerasdistError, match=r"KERASDIST_STRATEGY_FREE='yes' is not valid; choose auto"):
        setting({"KERASDIST_STRATEGY_FREE": "yes"})


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("settings", ["on,off", "auto,of"])  # "of": a typo in one worker, named beside the other
def test_workers_with_different_strategy_free_settings_fail_at_compile_naming_each(settings):
    """Before, the workers took different steps (or one probed and one did not) and waited on each other."""
    started = time.monotonic()
    failed = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", INPUTS, "py_dataset", "multiworker"],
                 timeout=150, check=False, env=child_env(TEST_STRATEGY_FREE_BY_WORKER=settings))
    first, second = settings.split(",")
    message = (f"ClusterConfigError: KERASDIST_STRATEGY_FREE differs between the workers (worker 0: {first}, "
               f"worker 1: {second})")  # kerasdist launch: tasks worker 0 and worker 1
    assert failed.returncode != 0 and "RESULT" not in failed.stdout, failed.stdout[-3000:]
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}] ") and message in line for line in failed.stdout.splitlines()), \
            failed.stdout[-3000:]
    assert time.monotonic() - started < 120


NOTICE = "[0] kerasdist: multiworker trains strategy-free (KERASDIST_STRATEGY_FREE=on)"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loss_scale_overflow_on_one_worker_is_skipped_by_every_worker_strategy_free(tmp_path):
    from tests import test_equivalence as eq

    result = eq.overflow_run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", "--communication", "tcp",
                              eq.OVERFLOW, "multiworker", str(tmp_path)], tmp_path, KERASDIST_STRATEGY_FREE="on",
                             OVERFLOW_SHARD_POLICY="auto")  # off keeps the strategy
    assert NOTICE in result.stdout, result.stdout[-3000:]


def test_a_process_group_needs_a_size_and_a_rank_in_it():
    import kerasdist
    from kerasdist.plugin_tools import process_group_size, set_process_group

    for size, rank in ((0, 0), (2, 2), (2, -1), ("2", 0)):
        with pytest.raises(kerasdist.KerasdistError, match=r"set_process_group: size=.*give an int size >= 1"):
            set_process_group(size, rank, None)
    assert process_group_size() == 1


def test_gather_across_processes_stacks_each_ranks_value_and_sums_their_gradients():
    """Two ranks in threads, each with a stand-in for the ring's sum (a real two-party barrier and sum): the
    forward gives both values in rank order, the backward each rank the sum of both ranks' gradients for its
    own value (tf.distribute's all_gather's gradient)."""
    import tensorflow as tf

    from kerasdist import process_group

    barrier, posted, results = threading.Barrier(2, timeout=20), [None, None], [None, None]

    def sums_for(rank):
        def sum_tensors(tensors):
            posted[rank] = tensors[0].numpy()
            barrier.wait()
            total = posted[0] + posted[1]
            barrier.wait()
            return [tf.constant(total)]
        return sum_tensors

    def each(rank):
        group_of_thread[threading.get_ident()] = {"size": 2, "rank": rank, "sum_tensors": sums_for(rank)}
        x = tf.Variable(3.0 + rank)
        with tf.GradientTape() as tape:
            gathered = process_group.gather_across_processes(x * 1.0)
            loss = (rank + 1.0) * gathered[0] + 10.0 * gathered[1]  # each rank weighs both slots its own way
        results[rank] = (gathered.numpy().tolist(), float(tape.gradient(loss, x)))

    group_of_thread = {}
    real = process_group._group
    process_group._group = lambda: group_of_thread[threading.get_ident()]
    try:
        threads = [threading.Thread(target=each, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
    finally:
        process_group._group = real
    assert results[0][0] == results[1][0] == [3.0, 4.0]
    assert results[0][1] == 1.0 + 2.0  # slot 0's gradients: rank 0 weighs it 1, rank 1 weighs it 2
    assert results[1][1] == 10.0 + 10.0  # slot 1's: 10 on both ranks
