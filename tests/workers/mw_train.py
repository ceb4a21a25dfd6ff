"""A tiny multi-worker training script used by the tests (and runnable by hand).

    python tests/workers/mw_train.py --out DIR [--distribute multiworker|none] [--epochs N]
        [--crash-in-epoch E --crash-marker FILE] [--shuffle] [--examples N] [--batch B]

Saves the final weights to DIR/weights-<task>.npz; the chief prints one line per
epoch begun ("EPOCH_BEGIN <n>", 1-based) and "FINAL <json logs>".
"""

import kerasdist  # noqa: I001  first: joins the cluster before any TensorFlow op

import argparse
import json
import os
import sys

import keras
import numpy as np


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--distribute", default="multiworker")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--dataset", action="store_true", help="feed a tf.data.Dataset")
    parser.add_argument("--crash-in-epoch", type=int, default=0, help="worker 1 dies in this epoch (1-based)")
    parser.add_argument("--crash-marker", default="", help="crash only if this file does not exist yet")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--write-dir", default="", help="add ModelCheckpoint, TensorBoard and CSVLogger here")
    parser.add_argument("--verbose", type=int, default=0)
    parser.add_argument("--jit-compile", action="store_true", help="compile with jit_compile=True (XLA)")
    parser.add_argument("--refit-alone", action="store_true",
                        help="then worker 1 exits and the chief fits the checkpoint of --write-dir loaded again")
    return parser.parse_args()


class Report(keras.callbacks.Callback):
    def __init__(self, args, task, chief):
        super().__init__()
        self.args, self.task, self.chief = args, task, chief
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch + 1
        if self.chief:
            print(f"EPOCH_BEGIN {epoch + 1}", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        a = self.args
        if self.args.step_sleep:
            import time
            time.sleep(self.args.step_sleep)
        if a.crash_in_epoch and self.epoch == a.crash_in_epoch and self.task == 1 and batch == 1 \
                and not os.path.exists(a.crash_marker):
            open(a.crash_marker, "w").close()
            print(f"CRASHING in epoch {self.epoch}", flush=True)
            os._exit(3)


def main():
    args = parse()
    cluster = kerasdist.detect_cluster()
    task = cluster.task_index if not cluster.is_local else 0
    keras.utils.set_random_seed(7)
    rng = np.random.RandomState(0)
    x = rng.rand(args.examples, 6).astype("float32")
    y = (x @ rng.rand(6, 2) + 0.1).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)])
    distribute = None if args.distribute == "none" else args.distribute
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], distribute=distribute,
                  **({"jit_compile": True} if args.jit_compile else {}))
    chief = cluster.is_local or cluster.is_chief
    data = dict(x=x, y=y, batch_size=args.batch)
    if args.dataset:
        import tensorflow as tf
        data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch))
    callbacks = [Report(args, task, chief)]
    if args.write_dir:
        callbacks += [keras.callbacks.ModelCheckpoint(os.path.join(args.write_dir, "model.keras")),
                      keras.callbacks.TensorBoard(os.path.join(args.write_dir, "tb")),
                      keras.callbacks.CSVLogger(os.path.join(args.write_dir, "log.csv"))]
    history = model.fit(**data, epochs=args.epochs, shuffle=args.shuffle, callbacks=callbacks,
                        verbose=args.verbose)
    if args.write_dir:
        assert callbacks[1].filepath == os.path.join(args.write_dir, "model.keras"), "paths given back"
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"weights-{task}.npz"), *model.get_weights())
    if not cluster.is_local:
        from kerasdist_plugins.multiworker import gradient_transport
        print(f"TRANSPORT {gradient_transport()}", flush=True)
        print(f"REPLICAS {model.distribute_strategy.num_replicas_in_sync}", flush=True)  # 1: strategy-free
    if chief:
        print("FINAL " + json.dumps({k: v[-1] for k, v in history.history.items()}
                                    | {"epochs_run": len(history.epoch)}), flush=True)
    if args.refit_alone and chief:
        refit_alone(os.path.join(args.write_dir, "model.keras"), data)
    return 0


def refit_alone(path, data):
    """TF's multi-worker tutorial: the chief fits its restored checkpoint after worker 1 has exited."""
    restored = keras.models.load_model(path)
    print(f"RESTORED {type(kerasdist.strategy_of(restored)).__name__}", flush=True)
    try:
        restored.fit(**data, epochs=1, verbose=0)
    except Exception as exc:  # the one error, whatever TensorFlow wrapped it in
        print("REFIT_ERROR " + " ".join(str(exc).split()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
