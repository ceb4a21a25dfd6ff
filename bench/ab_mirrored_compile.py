"""Interleaved A/B of compile(distribute="mirrored")'s extra time on ResNet50: how variables were moved before
issue 22 (two new tf.Variables per variable), "reuse only" (the old variable as replica 0's component, replica 1
through TensorFlow's creator) and the current code (reuse, and replica 1 as UninitializedVariable + assign).

    KERASDIST_CPU_REPLICAS=2 .venv/bin/python bench/ab_mirrored_compile.py [--rounds 9]

Each round compiles a fresh ResNet50 (64x64x3, 10 classes) plain and with each variant, the order alternating;
prints the medians of each variant minus the plain compile, with the load average.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERASDIST_CPU_REPLICAS", "2")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.ops import resource_variable_ops  # noqa: E402

import kerasdist  # noqa: E402
from kerasdist._keras_internals import strategy_binding  # noqa: E402

CURRENT_MOVE, CURRENT_COPY = strategy_binding._move_variables, strategy_binding._copy_on_this_device


def move_before_issue_22(variables, strategy):
    with strategy.scope():
        for variable in variables:
            if getattr(variable, "_value", None) is None:
                continue
            current = variable._value
            if strategy_binding._belongs_to(current, strategy):
                continue
            variable._initialize(tf.convert_to_tensor(current.read_value()))


def copy_through_tensorflow(variable, kwargs):
    """Replica 1's component as TensorFlow's default creator makes it (the "reuse only" variant)."""
    wanted = ("initial_value", "trainable", "name", "dtype", "synchronization", "aggregation", "shape")
    return resource_variable_ops.ResourceVariable(**{k: v for k, v in kwargs.items() if k in wanted})


VARIANTS = {"plain": (CURRENT_MOVE, CURRENT_COPY), "before": (move_before_issue_22, CURRENT_COPY),
            "reuse only": (CURRENT_MOVE, copy_through_tensorflow), "current": (CURRENT_MOVE, CURRENT_COPY)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    kerasdist.mirrored()  # plugins loaded: measure compile, not start-up
    times = {name: [] for name in VARIANTS}
    load_start = os.getloadavg()[0]
    try:
        for round_number in range(args.rounds):
            order = list(VARIANTS) if round_number % 2 == 0 else list(VARIANTS)[::-1]
            for name in order:
                model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
                strategy_binding._move_variables, strategy_binding._copy_on_this_device = VARIANTS[name]
                start = time.perf_counter()
                model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                              distribute=None if name == "plain" else "mirrored")
                times[name].append(time.perf_counter() - start)
    finally:
        strategy_binding._move_variables, strategy_binding._copy_on_this_device = CURRENT_MOVE, CURRENT_COPY
    plain = statistics.median(times["plain"])
    print(f"{args.rounds} interleaved rounds, load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} "
          f"at end; plain compile {plain:.3f} s; extra time of compile(distribute='mirrored'):")
    for name in list(VARIANTS)[1:]:
        print(f"  {name:<11} {statistics.median(times[name]) - plain:.3f} s")


if __name__ == "__main__":
    main()
