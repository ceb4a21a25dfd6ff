"""``kerasdist launch -n 2`` against ``torchrun --nproc-per-node 2``, and each backend's workers with and
without the launcher's thread settings, on keras.io's functional-API "ticket" model (guide
"The Functional API": title + body through Embedding and LSTM, tags; priority and department heads).

    python bench/launch_threads.py --compare torch [--rounds 3] [--steps 30] [--warmup 5]
    python bench/launch_threads.py --compare tf      # multiworker
    python bench/launch_threads.py --compare jax     # data_parallel

Arms run one after another, interleaved (the order reverses every round), and each prints its slowest
worker's median step time; then the medians per arm and the load average. The machine may be shared: read
the load average beside the figures. Inside a worker (``--worker WORD``) the script trains the model.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_description, interleaved_rounds, median, print_result, results, run_processes  # noqa: E402

HERE = os.path.abspath(__file__)
BIN = os.path.dirname(sys.executable)
NUM_TAGS, NUM_WORDS, NUM_DEPARTMENTS, ROWS = 12, 10000, 4, 1280


def ticket_model():
    """keras.io's functional-API guide model, as written there."""
    import keras
    from keras import layers

    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(NUM_TAGS,), name="tags")
    title_features = layers.LSTM(128)(layers.Embedding(NUM_WORDS, 64)(title_input))
    body_features = layers.LSTM(32)(layers.Embedding(NUM_WORDS, 64)(body_input))
    x = layers.concatenate([title_features, body_features, tags_input])
    priority_pred = layers.Dense(1, name="priority")(x)
    department_pred = layers.Dense(NUM_DEPARTMENTS, name="department")(x)
    return keras.Model(inputs=[title_input, body_input, tags_input],
                       outputs={"priority": priority_pred, "department": department_pred})


def worker(word, steps, warmup, batch):
    import keras
    import numpy as np

    import kerasdist  # noqa: F401  (compile(distribute=...))

    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    model = ticket_model()
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                  loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                        "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
                  loss_weights={"priority": 1.0, "department": 0.2}, distribute=word)
    rows = batch * (steps + warmup)
    x = {"title": rng.integers(NUM_WORDS, size=(rows, 10)), "body": rng.integers(NUM_WORDS, size=(rows, 100)),
         "tags": rng.integers(2, size=(rows, NUM_TAGS)).astype("float32")}
    y = {"priority": rng.random(size=(rows, 1)).astype("float32"),
         "department": rng.integers(2, size=(rows, NUM_DEPARTMENTS)).astype("float32")}
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            times.append(time.perf_counter())

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
    deltas = [b - a for a, b in zip(times[warmup - 1:], times[warmup:])]
    print_result({"step_s": median(deltas), "omp": os.environ.get("OMP_NUM_THREADS"),
                  "xla": os.environ.get("XLA_FLAGS"), "tf_intra": os.environ.get("TF_NUM_INTRAOP_THREADS")})


ARMS = {
    # name: (backend, word, launcher command prefix, extra environment)
    "torch": [
        ("kerasdist launch -n 2", "torch", "data_parallel", [f"{BIN}/kerasdist", "launch", "-n", "2"], {}),
        ("torchrun --nproc-per-node 2", "torch", "data_parallel",
         [f"{BIN}/torchrun", "--standalone", "--nproc-per-node", "2"], {}),
        ("launch --threads off (as before)", "torch", "data_parallel",
         [f"{BIN}/kerasdist", "launch", "-n", "2", "--threads", "off"], {}),
    ],
    # the variables measured and not set by the launcher (pick arms with --arms)
    "tf": [
        ("launch (thread settings)", "tensorflow", "multiworker", [f"{BIN}/kerasdist", "launch", "-n", "2"], {}),
        ("launch --threads off (as before)", "tensorflow", "multiworker",
         [f"{BIN}/kerasdist", "launch", "-n", "2", "--threads", "off"], {}),
        ("thread settings + TF_NUM_INTRAOP_THREADS=1", "tensorflow", "multiworker",
         [f"{BIN}/kerasdist", "launch", "-n", "2"], {"TF_NUM_INTRAOP_THREADS": "1"}),
        ("thread settings + TF_NUM_INTEROP_THREADS=1", "tensorflow", "multiworker",
         [f"{BIN}/kerasdist", "launch", "-n", "2"], {"TF_NUM_INTEROP_THREADS": "1"}),
        ("thread settings + XLA's Eigen pool off", "tensorflow", "multiworker",
         [f"{BIN}/kerasdist", "launch", "-n", "2"], {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}),
    ],
    "jax": [
        ("launch (thread settings)", "jax", "data_parallel", [f"{BIN}/kerasdist", "launch", "-n", "2"], {}),
        ("launch --threads off (as before)", "jax", "data_parallel",
         [f"{BIN}/kerasdist", "launch", "-n", "2", "--threads", "off"], {}),
        ("thread settings + XLA's Eigen pool off", "jax", "data_parallel", [f"{BIN}/kerasdist", "launch", "-n", "2"],
         {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}),
    ],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=sorted(ARMS))
    parser.add_argument("--worker", metavar="WORD", help="(inside a worker) train with distribute=WORD")
    parser.add_argument("--arms", default="", help="comma-separated arm numbers to run (default all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="global batch (keras.io's guide: 32)")
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.batch)
    arms = ARMS[args.compare]
    if args.arms:
        arms = [arms[int(i)] for i in args.arms.split(",")]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "XLA_FLAGS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")}
    print(f"{cpu_description()}; load average {os.getloadavg()[0]:.2f}; {args.steps} steps of {args.batch}")

    def run(arm):
        name, backend, word, prefix, extra = arm
        command = [*prefix, HERE, "--worker", word, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--batch", str(args.batch)]
        out = run_processes([command], [dict(env, KERAS_BACKEND=backend, **extra)], args.timeout, name)
        found = results(out)
        return max(r["step_s"] for r in found)

    loads = [os.getloadavg()[0]]
    steps = interleaved_rounds(arms, args.rounds, run)
    loads.append(os.getloadavg()[0])
    print(f"\nmedians over {args.rounds} rounds (load average {loads[0]:.2f} -> {loads[1]:.2f}):")
    for arm in arms:
        print(f"  {arm[0]:<40} {median(steps[arm[0]]) * 1000:8.1f} ms  (rounds: "
              + ", ".join(f"{s * 1000:.1f}" for s in steps[arm[0]]) + ")")
    if len(arms) == 2:
        first, second = (median(steps[arm[0]]) for arm in arms)
        print(f"step time, {arms[1][0]} / {arms[0][0]}: {second / first:.3f}")


if __name__ == "__main__":
    main()
