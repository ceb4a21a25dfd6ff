"""Quantization-aware training cost and what it buys, in one run.

Step time of ``["mirrored", quantize()]`` over ``"mirrored"`` alone (2 CPU replicas, the same conv net
and batches, alternating rounds, median step), the accuracy table of tests/workers/qat_digits.py
(float / post-training int8 / QAT int8, the int8 numbers from the LiteRT files) and the file sizes.

    KERASDIST_CPU_REPLICAS=2 .venv/bin/python bench/bench_qat.py [--rounds 5] [--steps 40] [--json out.json]
"""

import argparse
import os
import platform
import statistics
import sys

os.environ.setdefault("KERASDIST_CPU_REPLICAS", "2")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "workers"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist  # noqa: E402
from bench_mirrored import StepTimer  # noqa: E402
import qat_digits  # noqa: E402


def net():
    """A conv net big enough that a step is not all overhead: 32x32x3 -> conv-BN-ReLU x3 -> dense."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for filters in (32, 64, 64):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def median_step(plan, x, y, args):
    model = net()
    model.compile(optimizer=keras.optimizers.SGD(0.01), distribute=plan,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:args.batch * 3], y[:args.batch * 3], batch_size=args.batch, epochs=1, verbose=0)  # trace
    timer = StepTimer()
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, callbacks=[timer], shuffle=False)
    return statistics.median(timer.times[2:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    x, y = rng.normal(size=(n, 32, 32, 3)).astype("float32"), rng.integers(0, 10, n).astype("int32")
    float_times, qat_times = [], []
    for _ in range(args.rounds):
        float_times.append(median_step(["mirrored"], x, y, args))
        qat_times.append(median_step(["mirrored", kerasdist.quantize()], x, y, args))
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "float_step_ms": 1000 * statistics.median(float_times),
        "qat_step_ms": 1000 * statistics.median(qat_times),
    }
    report["qat_over_float"] = report["qat_step_ms"] / report["float_step_ms"]
    report["digits_per_channel"] = qat_digits.run("per_channel")
    report["digits_per_tensor_imbalanced"] = qat_digits.run("per_tensor", imbalanced=True, qat_epochs=20,
                                                            qat_learning_rate=0.002)
    qat_digits.report(report, args.json)


if __name__ == "__main__":
    main()
