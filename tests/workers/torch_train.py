"""A torch data_parallel job for tests/test_torch*.py: trains a small model, saves weights/logs per rank.

Usage: torch_train.py OUT_DIR [--epochs N] [--batch B] [--rows R] [--distribute WORD|none] [--input arrays|
dataloader|pydataset|tfdata] [--policy P] [--accumulate K] [--bn] [--sync-bn] [--backup DIR]
[--checkpoint] [--no-metrics] [--custom-step] [--recompile] [--loss-reduction R] [--guide NAME]; TORCH_TEST_KILL_AT=E SIGKILLs rank 1 in epoch E
(1-based). Writes OUT_DIR/rank{r}.npz (weights, history, each batch's logs and all-reduce count, evaluate,
predict).
``main(argv)`` runs one job in this process (tests/workers/torch_cases.py runs several in turn).
"""

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import kerasdist  # noqa: E402,F401
import keras  # noqa: E402
from kerasdist_plugins.torch_distributed import allocator  # noqa: E402


def arguments(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--distribute", default="data_parallel")
    parser.add_argument("--input", default="arrays")
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--accumulate", type=int, default=None)
    parser.add_argument("--bn", action="store_true")
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--backup", default=None)
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--unbuilt", action="store_true", help="no Input: the model is built by fit")
    parser.add_argument("--seed", type=int, default=1, help="rank 0's weight seed (rank r: seed + r)")
    parser.add_argument("--no-metrics", action="store_true", help="compile without metrics=")
    parser.add_argument("--custom-step", action="store_true", help="a model class with its own train_step")
    parser.add_argument("--loss-reduction", default=None, help="mse with this reduction (default: Keras's)")
    parser.add_argument("--guide", default=None, help="a keras.io custom-step model (tests/workers/torch_guides.py)")
    parser.add_argument("--added-losses", action="store_true",
                        help="a kernel regularizer, and add_loss of a mean over rows and of a keras.losses.Loss")
    parser.add_argument("--shuffle", default="false", choices=["false", "true", "batch"], help="fit's shuffle=")
    parser.add_argument("--fit-seed", type=int, default=None, help="keras.utils.set_random_seed(N) before fit")
    parser.add_argument("--rank-seeds", action="store_true",
                        help="before fit, each rank seeds torch and Python's random on its own (states differ)")
    parser.add_argument("--recompile", action="store_true",
                        help="first compile without metrics and fit an epoch, then compile again (a new optimizer)")
    return parser.parse_args(argv)


def data(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(rows, 1))).astype("float32")
    return x, y


class OwnStep(keras.Sequential):
    """A user's train_step (here Keras's, called through super()): kerasdist cannot know its order."""

    def train_step(self, data):
        return super().train_step(data)


class AddedLosses(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(keras.ops.square(x)) * 0.1)
        self.add_loss(keras.losses.MeanSquaredError()(keras.ops.zeros_like(x), x))
        return x


def model(bn, unbuilt=False, seed=1, custom_step=False, added_losses=False):
    keras.utils.set_random_seed(seed)
    layers = [] if unbuilt else [keras.Input((8,))]
    regularizer = keras.regularizers.L2(0.05) if added_losses else None
    layers += [keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer)]
    layers += [AddedLosses()] if added_losses else []
    if bn:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(1))
    return (OwnStep if custom_step else keras.Sequential)(layers)


class BatchLogs(keras.callbacks.Callback):
    """Every training batch's logs (all-reduced: each rank must log the global batch's figures) and how many
    ``torch.distributed.all_reduce`` calls it made."""

    def __init__(self):
        super().__init__()
        self.rows, self.all_reduces = [], []
        _count_all_reduces()

    def on_train_batch_begin(self, batch, logs=None):
        ALL_REDUCES[0] = 0

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append([float(v) for k in sorted(logs) for v in keras.tree.flatten(logs[k])])

        self.all_reduces.append(ALL_REDUCES[0])


ALL_REDUCES = [0]


def _count_all_reduces():
    """Count ``torch.distributed.all_reduce`` calls (installed once per process)."""
    import torch.distributed as dist

    if getattr(dist.all_reduce, "counted", False):
        return
    original = dist.all_reduce

    def all_reduce(*args, **kwargs):
        ALL_REDUCES[0] += 1
        return original(*args, **kwargs)

    all_reduce.counted = True
    dist.all_reduce = all_reduce


def as_input(kind, x, y, batch):
    if kind == "arrays":
        return dict(x=x, y=y, batch_size=batch)
    if kind == "dataloader":
        import torch

        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return dict(x=torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False))
    if kind == "dataloader_shuffled":  # shuffled by a sampler drawing from torch's global generator
        import torch

        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return dict(x=torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True))
    if kind == "pydataset":
        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return -(-len(x) // batch)

            def __getitem__(self, i):
                return x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]

        return dict(x=Batches())
    if kind == "pydataset_reordered":  # keras.io's pattern: on_epoch_end reorders the rows (NumPy's global state)
        class Reordered(keras.utils.PyDataset):
            order = np.arange(len(x))

            def __len__(self):
                return -(-len(x) // batch)

            def __getitem__(self, i):
                rows = self.order[i * batch:(i + 1) * batch]
                return x[rows], y[rows]

            def on_epoch_end(self):
                self.order = np.random.permutation(len(x))

        return dict(x=Reordered())
    import tensorflow as tf

    return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))


class KillInEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch + 1 == self.epoch and batch == 1 and os.environ.get("RANK") == "1":
            print(f"rank 1: SIGKILL in epoch {self.epoch} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def main(argv=None):
    args = arguments(argv)
    keras.mixed_precision.set_global_policy(args.policy)
    distribute = None if args.distribute == "none" else (
        kerasdist.spec(args.distribute, sync_batch_norm=True) if args.sync_bn else args.distribute)
    if args.guide:
        import torch_guides

        return torch_guides.main(args, distribute, BatchLogs())
    x, y = data(args.rows)
    # each rank draws other initial weights: rank 0's must reach every rank (one process: rank 0's seed)
    net = model(args.bn, args.unbuilt, args.seed + int(os.environ.get("RANK", "0")), args.custom_step,
                args.added_losses)
    if args.recompile:  # a user's first stage (e.g. a frozen base), then the model compiled again
        net.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", distribute=distribute)
        net.fit(**as_input(args.input, x, y, args.batch), epochs=1, shuffle=False, verbose=0)
    optimizer = keras.optimizers.SGD(0.05, gradient_accumulation_steps=args.accumulate)
    loss = keras.losses.MeanSquaredError(reduction=args.loss_reduction) if args.loss_reduction else "mse"
    net.compile(optimizer=optimizer, loss=loss, metrics=None if args.no_metrics else ["mae"],
                distribute=distribute)
    batch_logs = BatchLogs()
    callbacks = [batch_logs]
    if args.backup:
        callbacks.append(keras.callbacks.BackupAndRestore(args.backup))
    if os.environ.get("TORCH_TEST_KILL_AT"):  # not an argument: the relaunched job is the same job
        callbacks.append(KillInEpoch(int(os.environ["TORCH_TEST_KILL_AT"])))
    if args.checkpoint:
        callbacks.append(keras.callbacks.CSVLogger(os.path.join(args.out, f"log-{os.environ.get('RANK', '0')}.csv")))
    if args.fit_seed is not None:  # every process: the same random state (the model's seed is rank 0's + rank)
        keras.utils.set_random_seed(args.fit_seed)
    if args.rank_seeds:
        import random

        import torch

        random.seed(100 + int(os.environ.get("RANK", "0")))
        torch.manual_seed(100 + int(os.environ.get("RANK", "0")))
        from kerasdist_plugins.torch_distributed import keras_order

        states_seen_same = [keras_order.python_state_same_everywhere(), keras_order.torch_state_same_everywhere()]
    shuffle = {"false": False, "true": True, "batch": "batch"}[args.shuffle]
    history = net.fit(**as_input(args.input, x, y, args.batch), epochs=args.epochs, shuffle=shuffle, verbose=0,
                      callbacks=callbacks)
    evaluated = net.evaluate(x, y, batch_size=args.batch, verbose=0, return_dict=True)
    predicted = net.predict(x, batch_size=args.batch, verbose=0)
    rank = int(os.environ.get("RANK", "0"))
    later = keras.layers.Dense(3)  # seeded from Python's random, as Keras seeds every unseeded initializer
    later.build((None, 4))
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), *[np.asarray(w, dtype="float64") for w in net.get_weights()],
             loss=np.asarray(history.history["loss"]), mae=np.asarray(history.history.get("mae", [])),
             batch_logs=np.asarray(batch_logs.rows), all_reduces=np.asarray(batch_logs.all_reduces),
             evaluate=np.asarray([evaluated["loss"], evaluated.get("mae", 0.0)]),
             predict=np.asarray(predicted, "float64"), later_init=np.asarray(later.kernel, "float64"),
             epochs_run=np.asarray(len(history.history["loss"])), allocator=np.asarray(allocator.status()),
             states_seen_same=np.asarray(states_seen_same if args.rank_seeds else []))
    print(f"rank {rank} done: loss {history.history['loss']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
