"""distribute="mirrored" vs hand-written `with strategy.scope()` code, in one run.

Prints the step-time ratio (hand-written / kerasdist; 1.0 = same speed, goal >= 0.99) and the extra
wall time of compile(distribute="mirrored") on a ResNet50 built outside any scope, next to the floor
(copying every weight once per replica).

    KERASDIST_CPU_REPLICAS=2 .venv/bin/python bench/bench_mirrored.py [--rounds 7] [--steps 40]
"""

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("KERASDIST_CPU_REPLICAS", "2")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasdist  # noqa: E402
from kerasdist.devices import local_replica_devices  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def mlp():
    return keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])


def compile_args():
    return dict(optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def step_times(args):
    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    data = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(n, 512)).astype("float32"), rng.integers(0, 10, n).astype("int32"))
    ).batch(args.batch).cache()

    keras.utils.set_random_seed(0)
    ours = mlp()
    ours.compile(**compile_args(), distribute="mirrored")

    strategy = tf.distribute.MirroredStrategy(local_replica_devices())
    with strategy.scope():  # the hand-written equivalent
        keras.utils.set_random_seed(0)
        theirs = mlp()
        theirs.compile(**compile_args())

    medians = {"kerasdist": [], "hand_written": []}
    for model in (ours, theirs):  # warm-up: tracing
        model.fit(data, epochs=1, verbose=0)
    pair = [("kerasdist", ours), ("hand_written", theirs)]
    for round_index in range(args.rounds):  # interleaved, alternating who goes first
        for name, model in (pair if round_index % 2 == 0 else pair[::-1]):
            timer = StepTimer()
            model.fit(data, epochs=1, verbose=0, callbacks=[timer])
            medians[name].append(statistics.median(timer.times[2:]))
    ours_s, theirs_s = statistics.median(medians["kerasdist"]), statistics.median(medians["hand_written"])
    return {"replicas": ours.distribute_strategy.num_replicas_in_sync, "global_batch": args.batch,
            "step_s_kerasdist": ours_s, "step_s_hand_written": theirs_s, "ratio": theirs_s / ours_s}


def compile_overhead(args):
    def resnet():
        return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)

    kerasdist.mirrored()  # plugins loaded and strategy spec ready: measure compile, not start-up
    results = {"plain": [], "distributed": [], "floor": []}
    devices = local_replica_devices()
    for _ in range(args.compile_rounds):
        model = resnet()
        start = time.perf_counter()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        results["plain"].append(time.perf_counter() - start)

        model = resnet()
        start = time.perf_counter()
        for device in devices:
            with tf.device(device):
                copies = [tf.identity(v.value) for v in model.variables]
            copies[-1].numpy()
        results["floor"].append(time.perf_counter() - start)

        start = time.perf_counter()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", distribute="mirrored")
        results["distributed"].append(time.perf_counter() - start)
    plain, dist = statistics.median(results["plain"]), statistics.median(results["distributed"])
    return {"resnet50_variables": len(model.variables), "compile_s_plain": plain,
            "compile_s_distribute_mirrored": dist, "extra_s": dist - plain,
            "floor_copy_once_per_replica_s": statistics.median(results["floor"])}


def plain_keras_overhead(args):
    """distribute=None: Keras's own compile+fit with kerasdist's wrappers installed vs removed."""
    from kerasdist import integration

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(2048, 32)).astype("float32"), rng.normal(size=(2048, 1)).astype("float32")

    def once():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(1)])
        start = time.perf_counter()
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=256, epochs=1, verbose=0)
        model.evaluate(x, y, batch_size=256, verbose=0)
        return time.perf_counter() - start

    def without():
        integration.uninstall()
        try:
            return once()
        finally:
            integration.install()

    runs = {"with_kerasdist": once, "without": without}
    times = {name: [] for name in runs}
    once()
    without()
    for round_ in range(args.rounds):  # alternating who goes first, as step_times does
        for name in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
            times[name].append(runs[name]())
    with_s, without_s = statistics.median(times["with_kerasdist"]), statistics.median(times["without"])
    return {"plain_compile_fit_evaluate_s_with_kerasdist": with_s, "plain_compile_fit_evaluate_s_without": without_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--compile-rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "tensorflow": tf.__version__,
              "keras": keras.__version__, **step_times(args), **compile_overhead(args),
              **plain_keras_overhead(args)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"machine: {result['machine']}; tensorflow {result['tensorflow']}, keras {result['keras']}")
    print(f"step time, MLP 512-1024-1024-10, {result['replicas']} replicas, global batch {args.batch}: "
          f"kerasdist {result['step_s_kerasdist'] * 1e3:.2f} ms, hand-written "
          f"{result['step_s_hand_written'] * 1e3:.2f} ms, ratio {result['ratio']:.3f} (goal >= 0.99)")
    print(f"compile on ResNet50 ({result['resnet50_variables']} variables): plain "
          f"{result['compile_s_plain']:.3f} s, distribute='mirrored' {result['compile_s_distribute_mirrored']:.3f} s, "
          f"extra {result['extra_s']:.3f} s (goal <= 0.1); floor (copy once per replica) "
          f"{result['floor_copy_once_per_replica_s']:.3f} s")
    print(f"distribute=None (plain Keras compile+fit+evaluate, small MLP): with kerasdist imported "
          f"{result['plain_compile_fit_evaluate_s_with_kerasdist'] * 1e3:.1f} ms, without its wrappers "
          f"{result['plain_compile_fit_evaluate_s_without'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
