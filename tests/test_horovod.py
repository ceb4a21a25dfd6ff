"""distribute="horovod" under real `horovodrun -np 2 --gloo` on loopback, and its bad-input errors.

One horovodrun job ("suite") runs every numerical check; the error cases each get a job.
The tests that need the built horovod skip only when it is not installed (`make test` builds it).
"""

import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from helpers import PYTHON, ROOT, child_env, processes_with, run

sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
import hvd_common as common  # noqa: E402

from kerasdist_plugins import horovod as plugin  # noqa: E402
from runif import HOROVODRUN, run_if  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "hvd_train.py")
needs_horovod = run_if(horovod=True)


def horovodrun(mode, outdir, timeout, check=True):
    """Run the worker on 2 ranks; returns (CompletedProcess, seconds); asserts nothing is left running."""
    token = f"kerasdist-test-{uuid.uuid4().hex}"
    cmd = [HOROVODRUN, "-np", "2", "--gloo", "-H", "localhost:2", "--network-interfaces", "lo",
           "--gloo-timeout-seconds", "30", PYTHON, WORKER, mode, str(outdir), token]
    start = time.monotonic()
    try:
        result = run(cmd, timeout=timeout, env=child_env(TF_CPP_MIN_LOG_LEVEL=3), check=check)
    finally:
        left = processes_with(token)
        for pid in left:
            os.kill(pid, 9)
    assert not left, f"processes left behind by {mode}: {left}"
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("hvd_suite")
    result, _ = horovodrun("suite", outdir, timeout=240)
    ranks = [dict(np.load(outdir / f"rank{r}.npz")) for r in range(2)]
    return ranks, result.stdout, outdir


@pytest.fixture(scope="module")
def issue35_one_process():
    return common.issue35_cases(None)


def flat(arrays):
    return np.concatenate([np.ravel(a) for a in arrays])


def single_process_reference():
    """Plain Keras on one process, the global batch (2 x BATCH), same initial weights, SGD."""
    import keras

    x, y = common.data(batches=8)
    model = common.build_model()
    model.set_weights(common.initial_weights(0))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=2 * common.BATCH, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=common.BATCH, verbose=0)
    return flat(model.get_weights()), history.history, np.array(evaluation)


# -- Must show 1: weights identical on ranks, equal to single-process training -----------

@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_ranks_identical_and_equal_to_single_process_on_global_batch(suite):
    ranks, _, _ = suite
    np.testing.assert_array_equal(ranks[0]["equivalence_weights"], ranks[1]["equivalence_weights"])
    weights, history, evaluation = single_process_reference()
    assert np.abs(ranks[0]["equivalence_weights"] - weights).max() <= 1e-5
    # Rank 1 started from other weights: only rank 0's broadcast makes it match.
    assert np.abs(ranks[0]["equivalence_weights"] - flat(common.initial_weights(0))).max() > 1e-3
    # Epoch logs and evaluate() are averaged across ranks: they equal the single-process ones.
    for rank in ranks:
        np.testing.assert_allclose(rank["equivalence_loss"], history["loss"], atol=1e-5)
        np.testing.assert_allclose(rank["equivalence_mae"], history["mae"], atol=1e-5)
        np.testing.assert_allclose(rank["evaluate"], evaluation, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_added_losses_and_a_regularizer_equal_single_process(suite):
    """docs/equivalence.md, "add_loss": a mean over rows, a keras.losses.Loss and a kernel regularizer."""
    import keras

    ranks, _, _ = suite
    model = common.build_added_losses_model()
    model.set_weights(common.initial_weights(6))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = common.data(batches=8)
    history = model.fit(x, y, batch_size=2 * common.BATCH, epochs=2, shuffle=False, verbose=0)
    for rank in ranks:
        assert np.abs(rank["added_losses_weights"] - flat(model.get_weights())).max() <= 1e-5
        np.testing.assert_allclose(rank["added_losses_loss"], history.history["loss"], atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_shuffled_arrays_after_set_random_seed_train_in_one_processs_order(suite):
    """Issue 29 item 4: with keras.utils.set_random_seed(s) on every rank, fit(shuffle=True) of arrays draws one
    process's permutation on every rank, each taking its part of every global batch (before: a seed shared by the
    ranks gave another order)."""
    import keras

    ranks, _, _ = suite
    x, y = common.data(batches=8)
    model = common.build_model()
    model.set_weights(common.initial_weights(7))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    keras.utils.set_random_seed(11)
    history = model.fit(x, y, batch_size=2 * common.BATCH, epochs=2, shuffle=True, verbose=0)
    for rank in ranks:
        difference = np.abs(rank["seeded_shuffle_weights"] - flat(model.get_weights())).max()
        print(f"max |w_rank - w_one_process| after 2 shuffled epochs: {difference:.3g}")
        assert difference <= 1e-5
        np.testing.assert_allclose(rank["seeded_shuffle_loss"], history.history["loss"], atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_batch_size_per_worker_gives_horovods_semantics_and_says_so_once(suite):
    """batch_size_per_worker=True: batch_size=16 per rank, so a step trains on 16 x 2 = 32 examples,
    the same training as the default run given batch_size=32 (the global batch)."""
    ranks, stdout, _ = suite
    weights, _, _ = single_process_reference()
    for rank in ranks:
        assert list(rank["per_worker_steps"]) == [4, 4]  # 128 examples / (16 x 2)
        assert np.abs(rank["per_worker_weights"] - weights).max() <= 1e-5
    notice = ("kerasdist: horovod batch_size_per_worker=True: batch_size=16 is each rank's batch: the global "
              "batch is 32 (16 x 2 ranks), as in Horovod.")
    assert stdout.count(notice) == 1, stdout[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_uneven_shares_log_as_one_process(suite):
    """Issue 29: a global batch whose rows split unevenly (7 rows in batches of 4: 2+2 then 1+2; 9 rows: 0+1 last)
    was logged as the unweighted mean of the ranks' results: evaluate's loss 1.8447 for one process's 1.8223 (every
    input kind), fit's loss/val_loss off by up to 0.02. Now each metric's state is summed over the ranks first."""
    ranks, _, _ = suite

    def compile_model(weights, optimizer):
        model = common.build_model()
        model.set_weights(weights)
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
        return model

    expected = common.uneven_logs(compile_model)
    assert sorted(expected) == sorted(k[len("uneven_"):] for k in ranks[0] if k.startswith("uneven_"))
    for rank in ranks:
        for name, value in expected.items():
            np.testing.assert_allclose(rank[f"uneven_{name}"], value, rtol=1e-6, atol=1e-6, err_msg=name)
    assert len(expected["fit_val_loss"]) == 1  # validated once: epoch 1 had none


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
@pytest.mark.parametrize("case", ["batch_logs", "sparse_adam", "sparse_adagrad", "mean_loss_step"])
def test_batch_logs_sparse_gradients_and_an_ops_mean_step_as_one_process(suite, issue35_one_process, case):
    """Issue 35 (21 rows in global batches of 8: the last splits 3 + 2). batch_logs: every train, validation and
    evaluate batch's logs as a callback sees them, the same on every rank and one process's running values (each
    rank saw its own, 0.14-0.30 apart in keras.io's callbacks guide). sparse_*: an Embedding with repeated ids under
    Adam and Adagrad, its IndexedSlices gathered in one process's order. mean_loss_step: a custom train_step whose
    loss is an ops.mean (no compute_loss), its tracker "total_loss" logged as "loss": weights, epoch and batch
    logs."""
    ranks, _, _ = suite
    expected = {k: v for k, v in issue35_one_process.items() if k.startswith(case)}
    assert expected
    for rank in ranks:
        for name, value in expected.items():
            got = rank[f"issue35_{name}"]
            print(f"{name} rank: largest difference {np.abs(got - value).max():.2g}")
            np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_shuffling_torch_data_loader_after_manual_seed_trains_as_one_process(suite):
    """Issue 35 item 10: DataLoader(shuffle=True) after torch.manual_seed(0) on every rank draws one process's order,
    each rank taking its part of every global batch (before: always seeded with a shared seed of horovod's own,
    another order: max |w_rank - w_one_process| 0.0169 after 2 epochs; now 1.2e-7)."""
    ranks, _, _ = suite
    one = common.data_loader_case(None)
    for rank in ranks:
        difference = np.abs(rank["data_loader_weights"] - one["weights"]).max()
        print(f"DataLoader(shuffle=True): max |w_rank - w_one_process| = {difference:.3g}")
        assert difference <= 1e-5
        np.testing.assert_allclose(rank["data_loader_loss"], one["loss"], atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_ranks_in_different_fits_stop_with_one_error_naming_both(suite):
    """Issue 35 item 2: rank 1 left trial 1's fit (a failed checkpoint write) for trial 2's model of the same shapes
    while rank 0 still trained trial 1 (before: rank 1's next fit waited on collectives rank 0 never made: a hang,
    hvd_train.py diverged killed after 200 s). Now both ranks raise the ranks' agreement error, naming both sides."""
    ranks, _, _ = suite
    want = ("rank 1 is in fit #1 of model 'trial_2' (its start)", "rank 0 in fit #1 of model 'trial_1' (epoch 1)")
    assert str(ranks[1]["diverged_errors"][0]) == "OSError: unable to lock file (simulated)"
    for rank in ranks:
        raised = str(rank["diverged_errors"][-1])
        assert raised.startswith("KerasdistError: distribute='horovod': the ranks are not in the same call: ")
        assert all(w in raised for w in want), raised


def test_metric_states_are_summed_and_other_scalars_averaged_over_ranks():
    """combine_over_ranks without processes (rank 0 of 2, rank 1's message replayed): a metric's log is the result
    of the summed state (3 rows + 1 row: one process's 4), a scalar no metric backs is the ranks' mean."""
    import keras
    import tensorflow as tf

    from kerasdist_plugins.horovod.metric_sums import combine_over_ranks

    class Ranks:
        Sum = "sum"

        def __init__(self, other=None):
            self.other, self.sent = other, None

        def size(self):
            return 2

        def allreduce(self, tensor, op, name):
            self.sent = tensor.numpy()
            return tf.constant(self.sent + (self.sent if self.other is None else self.other))

    x, y = common.data(batches=1)

    def evaluated(rows, custom):
        model = common.build_model()
        model.set_weights(common.initial_weights(9))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"], run_eagerly=True)  # no tracing: faster
        return model, dict(model.evaluate(x[rows], y[rows], verbose=0, return_dict=True), custom=custom)

    one_model, one = evaluated(slice(0, 4), 0.0)
    model1, logs1 = evaluated(slice(3, 4), 3.0)
    rank1 = Ranks()
    combine_over_ranks(rank1, model1, logs1)
    model0, logs0 = evaluated(slice(0, 3), 1.0)
    before = logs0["loss"]
    combine_over_ranks(Ranks(other=rank1.sent), model0, logs0)
    assert abs(before - one["loss"]) > 1e-3
    assert logs0["custom"] == 2.0
    for name in ("loss", "mae"):
        assert abs(logs0[name] - one[name]) <= 1e-6
    assert abs(float(model0.get_metrics_result()["loss"]) - one["loss"]) <= 1e-6  # the state is the sum


# -- Must show 2: fp16 compression and backward_passes_per_step ---------------------------

@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_fp16_compression_averages_float16_gradients(suite):
    """Definition: each rank's gradient is cast to float16, summed and averaged in float16, cast back."""
    ranks, _, _ = suite
    x, y = common.data(batches=8)
    w0 = flat(common.initial_weights(1))
    g0, g1 = (flat(common.gradients(common.initial_weights(1), *common.batch(x, y, r))) for r in range(2))
    half = [g.astype(np.float16).astype(np.float32) for g in (g0, g1)]
    average16 = ((half[0] + half[1]).astype(np.float16) * np.float16(0.5)).astype(np.float32)
    average32 = (g0 + g1) / 2
    for rank in ranks:  # SGD(1.0): new weights = w0 - averaged gradient
        assert np.abs(rank["fp16_weights"] - (w0 - average16)).max() <= 1e-6
        assert np.abs(rank["fp16_weights"] - (w0 - average32)).max() > 1e-5  # really went through float16


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
@pytest.mark.parametrize("average", [False, True])
def test_backward_passes_per_step_accumulates_then_reduces_once(suite, average):
    """Definition (passes=2): sum each rank's gradients of 2 local batches at the same weights,
    average that sum over ranks, divide by 2 if average_aggregated_gradients, apply once."""
    ranks, _, _ = suite
    x, y = common.data(batches=8)
    weights = common.initial_weights(2)
    seen_expected = []
    for update in range(2):
        local_sums = []
        for rank in range(2):
            steps = [common.gradients(weights, *common.batch(x, y, 2 * step + rank))
                     for step in (2 * update, 2 * update + 1)]
            local_sums.append([a + b for a, b in zip(*steps)])
        gradient = [(a + b) / 2 / (2 if average else 1) for a, b in zip(*local_sums)]
        seen_expected += [flat(weights)] * 2
        weights = [w - 0.05 * g for w, g in zip(weights, gradient)]
    for rank in ranks:
        np.testing.assert_allclose(rank[f"passes_average{average}_weights"], flat(weights), atol=1e-5)
        np.testing.assert_allclose(rank[f"passes_average{average}_seen"], np.array(seen_expected), atol=1e-5)
        assert int(rank[f"passes_average{average}_iterations"]) == 4  # every backward pass counts


# -- broadcast, LR scaling and warm-up, chief-only, Adasum --------------------------------

@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_pretrained_model_and_optimizer_state_broadcast_from_rank0(suite):
    ranks, _, _ = suite
    before0, before1 = ranks[0]["pretrained_before"], ranks[1]["pretrained_before"]
    assert np.abs(before0 - before1).max() > 1e-3  # trained differently before distribution
    for rank in ranks:
        np.testing.assert_array_equal(rank["pretrained_at_start"], before0)


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_learning_rate_scaled_by_world_size_and_warmed_up(suite):
    ranks, _, _ = suite
    target, size, warmup, steps = 0.1 * 2, 2, 2, 2
    expected = []
    for epoch in range(3):
        for batch in range(steps):
            e = epoch + batch / steps + 1 / steps
            expected.append(target / size * (e * (size - 1) / warmup + 1) if epoch < warmup else target)
    for rank in ranks:
        np.testing.assert_allclose(rank["warmup_lrs"], expected, rtol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_checkpoints_logs_and_progress_on_rank0_only(suite):
    _, output, outdir = suite
    assert (outdir / "checkpoint_rank0.weights.h5").exists() and (outdir / "log_rank0.csv").exists()
    assert not (outdir / "checkpoint_rank1.weights.h5").exists() and not (outdir / "log_rank1.csv").exists()
    assert "[0]<stdout>:4/4" in output and "[1]<stdout>:4/4" not in output


@pytest.mark.timeout(300)
@pytest.mark.slow
@needs_horovod
def test_adasum_without_mpi_is_a_clear_error(suite):
    ranks, _, _ = suite
    message = str(ranks[0]["adasum_error"])
    assert "op='adasum' needs Horovod's MPI controller" in message and "op='average'" in message


# -- failures end the job: no hang, nothing left behind ------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.slow
@needs_horovod
@pytest.mark.parametrize("mode,message", [
    ("mismatch", "(the model (its layers or variable shapes) differ)"),  # the agreement error: no hang
    ("crash", "simulated crash of rank 1"),  # a rank crashing ends the job
])
def test_failures_end_the_job_fast(tmp_path, mode, message):
    result, seconds = horovodrun(mode, tmp_path, timeout=120, check=False)
    assert result.returncode != 0
    assert message in result.stdout
    assert "fit returned" not in result.stdout
    assert seconds < 90


# -- without horovodrun, the install check, availability -----------------------------------

@pytest.mark.timeout(120)
@pytest.mark.slow
@needs_horovod
def test_without_horovodrun_trains_one_process_with_warning(tmp_path):
    result = run([PYTHON, WORKER, "single", str(tmp_path)], timeout=100, env=child_env(TF_CPP_MIN_LOG_LEVEL=3))
    assert "not started by horovodrun: training on this one process" in result.stdout
    loss = np.load(tmp_path / "single_loss.npy")
    assert loss[-1] < loss[0]


@pytest.mark.timeout(200)
@needs_horovod
def test_check_build_shows_tensorflow_and_gloo():
    out = subprocess.run([HOROVODRUN, "--check-build"], capture_output=True, text=True, timeout=180,
                         env=child_env(TF_CPP_MIN_LOG_LEVEL=3)).stdout
    assert "[X] TensorFlow" in out and "[X] Gloo" in out




@pytest.mark.timeout(120)
@needs_horovod
def test_warmup_with_a_learning_rate_schedule_is_refused_at_compile():
    code = ("import keras, kerasdist\n"
            "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
            "lr = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)\n"
            "try:\n"
            "    m.compile(loss='mse', optimizer=keras.optimizers.SGD(lr), distribute=kerasdist.horovod(warmup_epochs=2))\n"
            "except kerasdist.KerasdistError as e:\n    print('REFUSED', e)\n")
    out = run([PYTHON, "-c", code], timeout=100, env=child_env(TF_CPP_MIN_LOG_LEVEL=3)).stdout
    assert "REFUSED horovod: warmup_epochs=2 needs a constant (float) learning rate" in out
