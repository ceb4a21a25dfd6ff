"""Sparse gradients over 2 workers: the strategy-free step (slices gathered over the TCP ring) against
MultiWorkerMirroredStrategy's step (KERASDIST_STRATEGY_FREE=off: TensorFlow's collectives gather them), same run.

    python bench/bench_sparse.py [--batch 1024] [--vocab 1000,100000] [--steps 20] [--warmup 3] [--rounds 3]

Model (DCN-like, Embedding-heavy): 8 categorical features, one id each per row (Zipf-skewed, so ids repeat), each
its own Embedding(vocab, 16); their concatenation -> Dense(64, relu) -> Dense(1); Adam, MSE. Per-worker
batch ``--batch`` rows; each process 1 intra-op and 1 inter-op thread. For each vocabulary size (the dense sum of an
Embedding's gradient grows with the vocabulary, the gathered slices with the batch) prints the median step time of
each configuration over the interleaved rounds and the ratio MWMS / strategy-free (> 1: strategy-free is faster).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (cpu_description, free_ports, interleaved_rounds, median, print_result,  # noqa: E402
                     results, run_processes, step_clock)

HERE = os.path.abspath(__file__)
FEATURES, DIM = 8, 16


def worker(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import kerasdist  # noqa: F401  joins the cluster before any op
    import keras
    import numpy as np

    cluster = kerasdist.detect_cluster()
    global_batch = args.batch * cluster.num_workers
    keras.utils.set_random_seed(0)
    ids = keras.Input((FEATURES,), dtype="int32")
    columns = [keras.layers.Embedding(args.vocab, DIM)(ids[:, i]) for i in range(FEATURES)]
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(columns))
    model = keras.Model(ids, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse",
                  distribute=None if cluster.is_local else "multiworker")
    rng = np.random.default_rng(0)
    x = rng.zipf(1.3, (global_batch, FEATURES)) % args.vocab  # skewed ids: repeated within a batch, as in logs
    y = rng.random((global_batch, 1)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x.astype("int32"), y)).batch(global_batch).cache().repeat()
    times = []
    model.fit(data, steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0,
              callbacks=[step_clock(args.warmup, times)])
    if cluster.is_local or cluster.is_chief:
        from kerasdist_plugins.multiworker import gradient_transport

        times = times[args.warmup - 1:]
        print_result({"step_s": median([b - a for a, b in zip(times, times[1:])]),
                      "transport": None if cluster.is_local else gradient_transport()})


CONFIGS = [  # (name, workers, environment)
    ("1 process, plain Keras fit", 1, {}),
    ("2 workers, multiworker strategy-free (TCP ring)", 2,
     {"KERASDIST_STRATEGY_FREE": "on", "KERASDIST_COMMUNICATION": "tcp"}),
    ("2 workers, multiworker KERASDIST_STRATEGY_FREE=off (MWMS)", 2, {"KERASDIST_STRATEGY_FREE": "off"}),
]


def run_config(workers, env_extra, vocab, args):
    ports = free_ports(workers)
    environments = []
    for index in range(workers):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("KERASDIST_")}
        env.update(TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   KERASDIST_TRANSPORT_PROBE="off", **env_extra)
        if workers > 1:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": index}})
        environments.append(env)
    command = [sys.executable, HERE, "--role", "worker", "--vocab", str(vocab), "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    found = results(run_processes([command] * workers, environments, args.timeout, f"x{workers} {env_extra}"))
    return found[0]["step_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", choices=("driver", "worker"))
    parser.add_argument("--batch", type=int, default=1024, help="per-worker batch size")
    parser.add_argument("--vocab", default="1000,100000", help="vocabulary sizes (driver: a comma-separated list)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.role == "worker":
        args.vocab = int(args.vocab)
        return worker(args)
    print(f"CPU: {cpu_description()}; load average at start {os.getloadavg()[0]:.2f}")
    print(f"{FEATURES} Embedding(vocab, {DIM}) features -> Dense(64) -> Dense(1), Adam; per-worker batch {args.batch};"
          f" {args.steps} timed steps after {args.warmup} warm-up; {args.rounds} interleaved round(s)")
    started = time.monotonic()
    for vocab in (int(v) for v in args.vocab.split(",")):
        print(f"\nvocabulary {vocab}:")
        steps = interleaved_rounds(CONFIGS, args.rounds, lambda c, vocab=vocab: run_config(*c[1:], vocab, args))
        for name, _, _ in CONFIGS:
            print(f"  {name:<58} median step {median(steps[name]) * 1000:8.1f} ms")
        ratio = median(steps[CONFIGS[2][0]]) / median(steps[CONFIGS[1][0]])
        print(f"  step time, MWMS / strategy-free: {ratio:.3f} (> 1: strategy-free is faster)")
    print(f"\n{time.monotonic() - started:.0f} s; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
