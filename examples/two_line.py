"""The two-line change: `import kerasdist` and `distribute=` in compile.

Runs on the embedded default: KERASDIST_CPU_REPLICAS=2 (set by `make demo`) splits the CPU
into 2 logical devices, so "mirrored" trains 2 real replicas. The data is generated here:
no download. Pass another strategy name as the first argument to try it.
"""

import sys

import numpy as np
import keras

import kerasdist  # line 1


def small_dataset(n=2048, seed=0):
    """A 10-class problem on 8x8 'images': class k has a bright k-th stripe plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    images = rng.normal(0.0, 0.3, size=(n, 8, 8, 1)).astype("float32")
    for k in range(10):
        images[labels == k, k % 8, :, 0] += 1.0 + (k // 8)
        images[labels == k, :, (k * 3) % 8, 0] += 0.5
    return images, labels.astype("int32")


def build_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])


def main(distribute="mirrored"):
    keras.utils.set_random_seed(0)
    x, y = small_dataset()
    model = build_model()                                   # built anywhere, no scope
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
                  distribute=distribute)                    # line 2
    strategy = model.distribute_strategy
    print(f"distribute={distribute!r}: {type(strategy).__name__} with "
          f"{strategy.num_replicas_in_sync} replica(s) in sync")
    model.fit(x[:1536], y[:1536], batch_size=64, epochs=3, verbose=2)
    loss, accuracy = model.evaluate(x[1536:], y[1536:], batch_size=64, verbose=0)
    print(f"evaluation: loss={loss:.4f} accuracy={accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    accuracy = main(*sys.argv[1:2])
    sys.exit(0 if accuracy > 0.5 else 1)
