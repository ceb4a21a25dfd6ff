"""Multi-worker scaling and overhead, measured in one run on this machine.

    python bench/bench_multiworker.py [--batch 4096] [--steps 12] [--warmup 3] [--rounds 3] [--full]

Model: a 512-1024-10 MLP, SGD, per-worker batch 4096 (``--batch``), each process limited to
1 intra-op and 1 inter-op thread. Prints, for each configuration, the step
time and examples/s (global examples per second), then the ratios:

- scaling: 2 workers with ``distribute="multiworker"`` vs 1 process (plain Keras fit),
  with the default (communication "auto": the TCP ring or TensorFlow's collectives, whichever its
  probe at the first compile measures faster; on the ring each worker trains strategy-free, one ring message a
  step; the choice and the probe's medians are printed), with TensorFlow's gRPC collectives, and with
  ``KERASDIST_STRATEGY_FREE=off`` (MultiWorkerMirroredStrategy's step over the ring: the default before issue 22)
  (``--full``: also the ring without the probe, and gradient packing);
- overhead: ``distribute="multiworker"`` step time vs a hand-written
  MultiWorkerMirroredStrategy custom loop (tf.function + strategy.run) on the same model.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (cpu_description, free_ports, interleaved_rounds, median, print_result,  # noqa: E402
                     print_summary, results, run_processes, step_clock)

HERE = os.path.abspath(__file__)
PER_WORKER_BATCH = 4096  # --batch (the driver passes it to every worker)


# -- inside a worker process ------------------------------------------------------------

def limit_threads():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def make_data(global_batch):
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(0)
    x = rng.rand(global_batch, 512).astype("float32")
    y = rng.randint(0, 10, size=(global_batch,)).astype("int32")
    # One global batch, batched once and cached: the benchmark measures training steps, not a
    # per-element input pipeline on one thread (which costs more per worker as workers are added).
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).cache().repeat()


def make_model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(10)])


def worker_keras(args):
    """Keras fit: plain (1 process) or distribute="multiworker"."""
    limit_threads()
    import kerasdist  # noqa: F401  joins the cluster (when TF_CONFIG is set) before any op
    import keras

    cluster = kerasdist.detect_cluster()
    global_batch = PER_WORKER_BATCH * cluster.num_workers
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute=None if cluster.is_local else "multiworker")
    times = []
    model.fit(make_data(global_batch), steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0,
              callbacks=[step_clock(args.warmup, times)])
    report(times[args.warmup - 1:], global_batch, cluster, transport=None if cluster.is_local else chosen_transport())


def chosen_transport():
    """How this worker's gradients travelled, and what communication "auto"'s probe measured (None: no probe)."""
    from kerasdist_plugins.multiworker import gradient_transport
    from kerasdist_plugins.multiworker.probe import last_probe

    probe = last_probe()
    return {"transport": gradient_transport(), "probe": probe and dataclasses.asdict(probe)}


def worker_custom_loop(args):
    """The hand-written equivalent: MultiWorkerMirroredStrategy + tf.function + strategy.run."""
    limit_threads()
    import tensorflow as tf

    communication = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                     "ring": tf.distribute.experimental.CommunicationImplementation.RING}[
        os.environ.get("KERASDIST_COMMUNICATION", "auto")]
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=communication, bytes_per_pack=int(os.environ.get("KERASDIST_BYTES_PER_PACK", "0")))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    import keras

    global_batch = PER_WORKER_BATCH * strategy.num_replicas_in_sync
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.01)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    iterator = iter(strategy.experimental_distribute_dataset(make_data(global_batch)))

    @tf.function
    def train_step(iterator):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)),
                                                  global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(step, args=next(iterator))
        return strategy.reduce("SUM", losses, axis=None)

    times = []
    for _ in range(args.warmup + args.steps):
        train_step(iterator).numpy()
        times.append(time.perf_counter())
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    report(times[args.warmup - 1:], global_batch, None, chief=resolver.task_id == 0)


def report(times, global_batch, cluster, chief=None, transport=None):
    chief = cluster.is_local or cluster.is_chief if chief is None else chief
    if chief or os.environ.get("BENCH_BARRIER_DIR"):
        step = (times[-1] - times[0]) / (len(times) - 1)
        print_result({"step_s": step, "examples_per_s": global_batch / step} | (transport or {}))


# -- the driver ------------------------------------------------------------------------------

def run_config(kind, workers, env_extra, args):
    """Run one configuration; returns the slowest reporting process's result (synchronous training
    goes at the pace of the slowest worker)."""
    ports = free_ports(workers)
    independent = bool(env_extra.get("BENCH_INDEPENDENT"))
    environments = []
    for index in range(workers):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update(TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_extra)
        if workers > 1 and not independent:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": index}})
        environments.append(env)
    command = [sys.executable, HERE, "--role", kind, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch)]
    outputs = run_processes([command] * workers, environments, args.timeout, f"{kind} x{workers} {env_extra}",
                            independent=independent)
    found = results(outputs)
    for result in found:
        if result.get("transport"):
            PROBES.append(result)
            print(f"    gradients over {describe_transport(result)}", flush=True)
    return max(found, key=lambda r: r["step_s"])


PROBES = []  # the chief's {"transport", "probe"} of every multiworker run


def describe_transport(result):
    probe = result["probe"]
    name = {"tcp": "the TCP ring", "tensorflow": "TensorFlow's collectives"}[result["transport"]]
    if not probe:
        return f"{name} (no probe)"
    return (f"{name}: auto's probe, median of {probe['rounds']} all-reduces of {probe['parameters']} float32: "
            f"TCP ring {probe['ring_ms']:.2f} ms, TensorFlow's collectives {probe['tensorflow_ms']:.2f} ms; "
            f"the probe took {probe['seconds']:.2f} s")


CONFIGS = [  # (name, role, workers, environment)
    ("1 process, plain Keras fit", "keras", 1, {}),
    ("2 independent processes, no communication (ceiling)", "keras", 2, {"BENCH_INDEPENDENT": "1"}),
    ("2 workers, multiworker (default: auto, measured)", "keras", 2, {}),
    ("2 workers, hand-written MWMS loop (TF defaults)", "custom", 2, {}),
    ("2 workers, multiworker, communication=ring (TF gRPC)", "keras", 2, {"KERASDIST_COMMUNICATION": "ring"}),
    ("2 workers, multiworker, KERASDIST_STRATEGY_FREE=off (MWMS step)", "keras", 2,
     {"KERASDIST_STRATEGY_FREE": "off"}),  # the default before issue 22's strategy-free step
]
FULL_CONFIGS = [
    ("2 workers, multiworker, communication=tcp (ring, no probe)", "keras", 2, {"KERASDIST_COMMUNICATION": "tcp"}),
    ("2 workers, multiworker, ring, bytes_per_pack=1 MiB", "keras", 2,
     {"KERASDIST_COMMUNICATION": "ring", "KERASDIST_BYTES_PER_PACK": str(1 << 20)}),
    ("2 workers, multiworker, ring, bytes_per_pack=256 KiB", "keras", 2,
     {"KERASDIST_COMMUNICATION": "ring", "KERASDIST_BYTES_PER_PACK": str(1 << 18)}),
]


def main():
    global PER_WORKER_BATCH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", choices=("driver", "keras", "custom"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are reported")
    parser.add_argument("--full", action="store_true", help="also gradient packing with TF's collectives")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--batch", type=int, default=PER_WORKER_BATCH, help="per-worker batch size")
    args = parser.parse_args()
    PER_WORKER_BATCH = args.batch
    if args.role == "keras":
        return worker_keras(args)
    if args.role == "custom":
        return worker_custom_loop(args)

    configs = CONFIGS + (FULL_CONFIGS if args.full else [])
    print(f"CPU: {cpu_description()}")
    print(f"per-worker batch {PER_WORKER_BATCH}, 512-1024-10 MLP, SGD, 1 intra/1 inter-op thread per process; "
          f"{args.steps} timed steps after {args.warmup} warm-up; {args.rounds} round(s); {os.cpu_count()} CPUs; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    steps = interleaved_rounds(configs, args.rounds, lambda c: run_config(*c[1:], args)["step_s"])
    print_summary(steps, configs, lambda workers: PER_WORKER_BATCH * workers, "multiworker",
                  "hand-written MWMS loop", ceiling_pace=True)
    probed = [r for r in PROBES if r["probe"]]
    if probed:
        chose = [r["probe"]["choice"] for r in probed]
        print(f"\ncommunication auto chose: {', '.join(f'{c} {chose.count(c)}x' for c in sorted(set(chose)))} "
              f"of {len(chose)} runs; probe medians over the runs: TCP ring "
              f"{median([r['probe']['ring_ms'] for r in probed]):.2f} ms, TensorFlow's collectives "
              f"{median([r['probe']['tensorflow_ms'] for r in probed]):.2f} ms "
              f"({probed[0]['probe']['parameters']} float32 per all-reduce; the probe took "
              f"{median([r['probe']['seconds'] for r in probed]):.2f} s)")


if __name__ == "__main__":
    sys.exit(main())
