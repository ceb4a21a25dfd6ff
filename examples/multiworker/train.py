"""Multi-worker training with Keras 3: one word in compile, the cluster comes from the environment.

Run it on this machine with two workers:

    kerasdist launch -n 2 examples/multiworker/train.py --epochs 3

or set TF_CONFIG by hand in each process (Kubernetes, Ray and Slurm set it for you):

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]},
                "task": {"type": "worker", "index": 0}}' python examples/multiworker/train.py
    TF_CONFIG='{... "index": 1}}' python examples/multiworker/train.py
"""

import kerasdist  # noqa: I001  first: joins the cluster before TensorFlow runs any op

import argparse
import os

import keras
import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split across workers")
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--save-weights", default="", help="directory for weights-<task>.npz (tests)")
    parser.add_argument("--checkpoint", default="", help="ModelCheckpoint path (written by the chief only)")
    parser.add_argument("--save", default="", help="path of the trained model (.keras), written by the chief")
    args = parser.parse_args()

    keras.utils.set_random_seed(42)
    rng = np.random.RandomState(0)
    x = rng.rand(args.examples, 8).astype("float32")
    y = (x @ rng.rand(8, 1) > 2.0).astype("float32")

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy", metrics=["accuracy"],
                  distribute="auto")  # multiworker when a cluster is detected, mirrored otherwise

    callbacks = [keras.callbacks.ModelCheckpoint(args.checkpoint)] if args.checkpoint else []
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, callbacks=callbacks,
              verbose=2)

    cluster = kerasdist.detect_cluster()
    if args.save_weights:
        os.makedirs(args.save_weights, exist_ok=True)
        np.savez(os.path.join(args.save_weights, f"weights-{cluster.task_index}.npz"), *model.get_weights())
    loss, accuracy = model.evaluate(x, y, batch_size=args.batch_size, verbose=0)  # every worker takes part
    if kerasdist.is_chief():  # one writer: every worker holds the same weights
        if args.save:
            model.save(args.save)
        print(f"final loss {loss:.4f} accuracy {accuracy:.4f} on {cluster.num_workers} worker(s)")


if __name__ == "__main__":
    main()
