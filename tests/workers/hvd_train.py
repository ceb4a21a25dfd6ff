"""A training script for tests/test_horovod.py, run under `horovodrun -np 2 --gloo` (or alone).

    hvd_train.py MODE OUTDIR

MODE "suite" runs every numerical check in one job (one start-up for all of them) and writes
each rank's results to OUTDIR/rank<R>.npz; "mismatch" builds a different model on rank 1;
"crash" makes rank 1 raise in the middle of fit; "single" trains without horovodrun;
"diverged" and "data_loader" run one of the suite's cases alone (to measure it).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import kerasdist  # noqa: E402  (first: hvd.init() at import under horovodrun)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_common as common  # noqa: E402
from equivalence_script import CountSteps  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


GLOBAL = 2 * common.BATCH  # batch_size is the global batch: each of the 2 ranks takes BATCH of it


def rank_and_size():
    import horovod.tensorflow as hvd

    return hvd.rank(), hvd.size()


def compiled(weights, optimizer, hidden=common.HIDDEN, **options):
    model = common.build_model(hidden)
    model.set_weights(weights)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], distribute=kerasdist.horovod(**options))
    return model


class Record(keras.callbacks.Callback):
    """Weights, optimizer state and learning rate as seen at the start of each batch."""

    def __init__(self):
        super().__init__()
        self.lrs, self.weights, self.optimizer_state = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))
        self.weights.append([w.numpy() for w in self.model.weights])
        self.optimizer_state.append([v.numpy() for v in self.model.optimizer.variables])


def suite(outdir):
    rank, size = rank_and_size()
    out = {}
    x, y = common.data(batches=8)

    # 1. Equivalence: rank-dependent initial weights (rank 0's win through the broadcast).
    model = compiled(common.initial_weights(0 if rank == 0 else 100 + rank), keras.optimizers.SGD(0.1))
    history = model.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    out["equivalence_weights"] = model.get_weights()
    out["equivalence_loss"] = np.array(history.history["loss"])
    out["equivalence_mae"] = np.array(history.history["mae"])
    out["evaluate"] = np.array(model.evaluate(x, y, batch_size=GLOBAL, verbose=0))

    # 2. fp16 compression: one step, each rank on its own batch (shard=False: batches are as given), lr 1.
    local_x, local_y = common.batch(x, y, rank)
    w0 = common.initial_weights(1)
    model = compiled(w0, keras.optimizers.SGD(1.0), compression="fp16", shard=False)
    model.fit(local_x, local_y, batch_size=common.BATCH, epochs=1, shuffle=False, verbose=0)
    out["fp16_weights"] = model.get_weights()

    # 3. backward_passes_per_step=2: 4 local steps, 2 updates; with and without averaging.
    for average in (False, True):
        record = Record()
        model = compiled(common.initial_weights(2), keras.optimizers.SGD(0.05), backward_passes_per_step=2,
                         average_aggregated_gradients=average)
        model.fit(x, y, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0, callbacks=[record])
        out[f"passes_average{average}_weights"] = model.get_weights()
        out[f"passes_average{average}_seen"] = record.weights
        out[f"passes_average{average}_iterations"] = int(model.optimizer.iterations.numpy())

    # 4. A model trained before (rank-dependent Adam state), then distributed: rank 0's state everywhere.
    model = common.build_model()
    model.set_weights(common.initial_weights(10 + rank))
    optimizer = keras.optimizers.Adam(0.01)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*common.batch(x, y, rank), batch_size=common.BATCH, epochs=2 + rank, verbose=0)
    out["pretrained_before"] = [v.numpy() for v in model.weights] + [v.numpy() for v in optimizer.variables]
    model.compile(optimizer=optimizer, loss="mse", distribute="horovod")
    record = Record()
    model.fit(x, y, batch_size=GLOBAL, epochs=1, verbose=0, callbacks=[record])
    out["pretrained_at_start"] = record.weights[0] + record.optimizer_state[0]

    # 5. LR scaling by the world size and warm-up over 2 epochs (2 steps per epoch).
    record = Record()
    model = compiled(common.initial_weights(3), keras.optimizers.SGD(0.1), scale_learning_rate=True,
                     warmup_epochs=2)
    model.fit(x[:4 * common.BATCH], y[:4 * common.BATCH], batch_size=GLOBAL, epochs=3, verbose=0,
              callbacks=[record])
    out["warmup_lrs"] = np.array(record.lrs)

    # 6. Chief-only callbacks and progress: every rank asks for files named after its rank.
    model = compiled(common.initial_weights(4), keras.optimizers.SGD(0.1))
    model.fit(x, y, batch_size=GLOBAL, epochs=1, verbose=2, callbacks=[
        keras.callbacks.ModelCheckpoint(os.path.join(outdir, f"checkpoint_rank{rank}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.CSVLogger(os.path.join(outdir, f"log_rank{rank}.csv"))])

    # 7. Adasum on this Gloo-only build: a clear error at compile, before any collective.
    try:
        compiled(common.initial_weights(5), keras.optimizers.SGD(0.1), op="adasum")
        out["adasum_error"] = ""
    except kerasdist.KerasdistError as exc:
        out["adasum_error"] = str(exc)

    # 8. batch_size_per_worker=True: Horovod's semantics, batch_size per rank (global = BATCH x 2).
    model = compiled(common.initial_weights(0), keras.optimizers.SGD(0.1), batch_size_per_worker=True)
    steps = CountSteps()
    model.fit(x, y, batch_size=common.BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[steps])
    out["per_worker_weights"] = model.get_weights()
    out["per_worker_steps"] = np.array(steps.steps)

    # 9. add_loss of a mean and of a Loss, and a kernel regularizer: as one process.
    model = common.build_added_losses_model()
    model.set_weights(common.initial_weights(6))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute="horovod")
    history = model.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    out["added_losses_weights"] = model.get_weights()
    out["added_losses_loss"] = np.array(history.history["loss"])

    # 10. fit(shuffle=True) of arrays after keras.utils.set_random_seed: one process's permutation on every rank.
    model = compiled(common.initial_weights(7), keras.optimizers.SGD(0.1))
    keras.utils.set_random_seed(11)
    history = model.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=True, verbose=0)
    out["seeded_shuffle_weights"] = model.get_weights()
    out["seeded_shuffle_loss"] = np.array(history.history["loss"])

    # 11. Uneven shares (issue 29): evaluate 7 rows in global batches of 4 (rows 2+2, then 1+2) as every input
    # kind; fit on 9 rows (the last batch: 0+1) validating on 7 rows every 2nd epoch. Logs as one process's.
    for name, value in common.uneven_logs(compiled).items():
        out[f"uneven_{name}"] = value

    # 12. Issue 35: per-batch logs, an Embedding's sparse gradients (Adam, Adagrad), a custom step's ops.mean loss.
    for name, value in common.issue35_cases("horovod").items():
        out[f"issue35_{name}"] = value

    # 13. Issue 35 item 10: a shuffling torch DataLoader after torch.manual_seed: one process's order.
    for name, value in common.data_loader_case("horovod").items():
        out[f"data_loader_{name}"] = value

    # 14. Issue 35 item 2, last (the ranks' counts of calls differ after it): rank 1 leaves a fit for the next one.
    out["diverged_errors"] = np.array(diverged(outdir))

    np.savez(os.path.join(outdir, f"rank{rank}.npz"), **{k: _array(v) for k, v in out.items()})
    print(f"rank {rank}/{size}: suite done", flush=True)


def _array(value):
    if isinstance(value, list) and value and isinstance(value[0], list):
        return np.array([np.concatenate([np.ravel(a) for a in item]) for item in value])
    if isinstance(value, list):
        return np.concatenate([np.ravel(a) for a in value])
    return np.asarray(value)


def mismatch(outdir):
    rank, _ = rank_and_size()
    hidden = common.HIDDEN + 4 * rank
    model = compiled(common.initial_weights(0, hidden), keras.optimizers.SGD(0.1), hidden=hidden)
    x, y = common.data(batches=4)
    model.fit(x, y, batch_size=common.BATCH, epochs=1, verbose=0)
    print("mismatch: fit returned", flush=True)


def diverged(outdir):
    """Issue 35 item 2, as KerasTuner does it: a trial's fit fails on rank 1 only (its checkpoint write), which goes
    on to the next trial's model, of the same shapes, while rank 0 still trains the first (before: rank 1's next fit
    waited on collectives rank 0 never makes: a hang, killed after 200 s). Every rank raises one error naming both sides. Returns the
    errors each rank saw, in order."""
    rank, _ = rank_and_size()
    x, y = common.data(batches=4)

    class FailsOnRankOne(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if rank == 1:
                raise OSError("unable to lock file (simulated)")

    errors = []
    for trial in (1, 2):
        model = common.build_model(name=f"trial_{trial}")
        model.set_weights(common.initial_weights(20 + trial))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute="horovod")
        try:
            model.fit(x, y, batch_size=GLOBAL, epochs=3, verbose=0, callbacks=[FailsOnRankOne()])
        except OSError as exc:  # KerasTuner marks the trial failed and goes on
            errors.append(f"{type(exc).__name__}: {exc}")
        except kerasdist.KerasdistError as exc:  # the ranks are out of step for good: the suite's last case
            errors.append(f"{type(exc).__name__}: {exc}")
            break
    print(f"rank {rank}: diverged: {errors}", flush=True)
    return errors


def data_loader(outdir):
    """Suite case 13 alone (to measure it): writes OUTDIR/data_loader_rank<R>.npz."""
    rank, _ = rank_and_size()
    np.savez(os.path.join(outdir, f"data_loader_rank{rank}.npz"), **common.data_loader_case("horovod"))


def crash(outdir):
    rank, _ = rank_and_size()

    class CrashOnRank1(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if rank == 1 and batch == 2:
                raise RuntimeError("simulated crash of rank 1")

    model = compiled(common.initial_weights(0), keras.optimizers.SGD(0.1))
    x, y = common.data(batches=40)
    model.fit(x, y, batch_size=common.BATCH, epochs=50, verbose=0, callbacks=[CrashOnRank1()])
    print("crash: fit returned", flush=True)


def single(outdir):
    x, y = common.data(batches=8)
    model = compiled(common.initial_weights(0), keras.optimizers.SGD(0.1))
    history = model.fit(x, y, batch_size=common.BATCH, epochs=3, shuffle=False, verbose=0)
    print(f"single: loss {history.history['loss'][0]:.5f} -> {history.history['loss'][-1]:.5f}", flush=True)
    np.save(os.path.join(outdir, "single_loss.npy"), np.array(history.history["loss"]))


if __name__ == "__main__":
    mode, outdir = sys.argv[1], sys.argv[2]
    {"suite": suite, "mismatch": mismatch, "crash": crash, "single": single, "diverged": diverged,
     "data_loader": data_loader}[mode](outdir)
