"""distribute="horovod" vs the hand-written Horovod TF2 loop, and Horovod's CPU settings.

    python bench/bench_horovod.py              # the main configurations, twice (about 6 minutes on 2 cores)
    python bench/bench_horovod.py --full       # also cycle time 0.1/20 ms, fusion off, cache off
    python bench/bench_horovod.py --quick      # the 1-process baseline and the plugin's defaults

Model and data as in issue 4: the 512-1024-10 MLP, per-worker batch 4096 (synthetic, one
cached batch, so no input pipeline is measured), SGD, one TensorFlow thread per process.
Each configuration is one `horovodrun -np N --gloo` job on loopback that times, in the same
processes and interleaved over several rounds,

- keras:     ``model.fit`` after ``compile(distribute=kerasdist.horovod(...))``;
- canonical: the Horovod TF2 example: ``@tf.function`` step with ``hvd.DistributedGradientTape``.

It prints median step times, the keras/canonical ratio, scaling (N x 1-process step time /
N-process step time, i.e. throughput), and CPU seconds per step per process. Results also go
to bench/out/horovod.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_TAG = "BENCH_RESULT "

#: Horovod 0.28.1's own defaults, set explicitly so the plugin's defaults do not apply.
HOROVOD_DEFAULTS = {"HOROVOD_CYCLE_TIME": "1", "HOROVOD_FUSION_THRESHOLD": str(128 * 1024 * 1024),
                    "HOROVOD_CACHE_CAPACITY": "1024"}


def configurations(quick, full):
    """(label, processes, environment, plugin/loop options)."""
    hd = HOROVOD_DEFAULTS
    configs = [("1 process (baseline)", 1, {}, {}),
               ("2 processes, kerasdist defaults", 2, {}, {})]
    if quick:
        return configs
    configs += [
        ("2 processes, Horovod defaults (cycle 1 ms)", 2, hd, {}),
        ("cycle time 5 ms", 2, {**hd, "HOROVOD_CYCLE_TIME": "5"}, {}),
        ("cycle time 10 ms", 2, {**hd, "HOROVOD_CYCLE_TIME": "10"}, {}),
        ("fp16, Horovod defaults", 2, hd, {"compression": "fp16"}),
        ("fp16, kerasdist defaults", 2, {}, {"compression": "fp16"}),
    ]
    if full:
        configs += [
            ("cycle time 0.1 ms", 2, {**hd, "HOROVOD_CYCLE_TIME": "0.1"}, {}),
            ("cycle time 20 ms", 2, {**hd, "HOROVOD_CYCLE_TIME": "20"}, {}),
            ("fusion off (threshold 0)", 2, {**hd, "HOROVOD_FUSION_THRESHOLD": "0"}, {}),
            ("response cache off", 2, {**hd, "HOROVOD_CACHE_CAPACITY": "0"}, {}),
        ]
    return configs


# -- driver -------------------------------------------------------------------------

def run_config(label, processes, env_extra, options, args):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", str(processes), "--gloo", "-H", f"localhost:{processes}",
           "--network-interfaces", "lo", sys.executable, os.path.abspath(__file__), "--worker",
           "--steps", str(args.steps), "--rounds", str(args.rounds), "--options", json.dumps(options)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "KERASDIST_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", **env_extra)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if RESULT_TAG in line:
            result = json.loads(line.split(RESULT_TAG, 1)[1])
            return dict(result, label=label, processes=processes, env=env_extra, options=options)
    raise RuntimeError(f"{label}: no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main_multiworker_only(args):
    print(json.dumps(run_multiworker(args)))


def main_driver(args):
    """Every configuration ``--passes`` times, interleaved, so load from other processes spreads
    over all of them; per configuration the medians over passes are reported."""
    import statistics

    load = os.getloadavg()[0]
    runs = {}
    for p in range(args.passes):
        for label, processes, env_extra, options in configurations(args.quick, args.full):
            result = run_config(label, processes, env_extra, options, args)
            runs.setdefault(label, []).append(result)
            print(f"pass {p + 1}: " + _row(result), flush=True)
    results, baseline = [], None
    for label, passes in runs.items():
        result = dict(passes[0], passes=passes)
        for key in ("keras_step_s", "canonical_step_s", "cpu_per_step_s"):
            result[key] = statistics.median(r[key] for r in passes)
        result["ratio"] = statistics.median(c / k for r in passes
                                            for k, c in zip(r["keras_rounds_s"], r["canonical_rounds_s"]))
        if result["processes"] == 1:
            baseline = result
        elif baseline is not None:
            for loop in ("keras", "canonical"):
                result[f"{loop}_scaling"] = result["processes"] * baseline[f"{loop}_step_s"] / result[f"{loop}_step_s"]
        results.append(result)
    multiworker = run_multiworker(args) if not args.quick else None
    print("\nmedians over passes (ratio: median over rounds of canonical/keras step time, each pair run "
          "back to back):")
    for result in results:
        print(_row(result), flush=True)
    if multiworker is not None and "keras_step_s" in multiworker and baseline is not None:
        multiworker["keras_scaling"] = 2 * baseline["keras_step_s"] / multiworker["keras_step_s"]
        print(f"{'distribute=multiworker, 2 processes':<44} keras {multiworker['keras_step_s'] * 1e3:7.1f} ms"
              f"  scaling {multiworker['keras_scaling']:.2f}x")
    elif multiworker is not None:
        print(f"distribute=multiworker: {multiworker['missing']}")
    machine = _machine()
    machine["load_average_at_start"] = load
    machine["load_average_at_end"] = os.getloadavg()[0]
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "horovod.json"), "w") as f:
        json.dump({"machine": machine, "steps": args.steps, "rounds": args.rounds, "passes": args.passes,
                   "results": results, "multiworker": multiworker}, f, indent=2)
    print(json.dumps(machine))


def run_multiworker(args):
    """distribute="multiworker" on 2 processes (`kerasdist launch -n 2`), if that plugin works here."""
    import statistics

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "KERASDIST_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    rows = json.loads(subprocess.run([sys.executable, "-m", "kerasdist.cli", "plugins", "--json"], env=env,
                                     capture_output=True, text=True, timeout=120).stdout or "[]")
    if not any(r["name"] == "multiworker" and r["available"] for r in rows):
        return {"missing": "plugin not installed or unavailable here"}
    cmd = [sys.executable, "-m", "kerasdist.cli", "launch", "-n", "2", os.path.abspath(__file__),
           "--multiworker-worker", "--steps", str(args.steps), "--rounds", str(args.rounds)]
    times = []
    for _ in range(args.passes):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        found = [line for line in proc.stdout.splitlines() if RESULT_TAG in line]
        if not found:
            return {"missing": f"failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}"}
        times.append(json.loads(found[0].split(RESULT_TAG, 1)[1])["keras_step_s"])
    return {"keras_step_s": statistics.median(times), "passes_s": times}


def main_multiworker_worker(args):
    import statistics

    import kerasdist  # joins the cluster and starts TensorFlow: threads come from TF_NUM_*_THREADS
    import keras
    import tensorflow as tf

    model = build_model(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute=kerasdist.multiworker(backup=False))
    workers = model.distribute_strategy.num_replicas_in_sync
    # The dataset's batch is the global batch: BATCH per worker, as for horovod.
    x = tf.random.stateless_normal((BATCH * workers, FEATURES), seed=(1, 0))
    y = tf.random.stateless_uniform((BATCH * workers,), seed=(2, 0), maxval=CLASSES, dtype=tf.int32)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    times = [time_keras(keras, model, dataset, args.steps) for _ in range(args.rounds)]
    if model.distribute_strategy.extended.should_checkpoint:
        print(RESULT_TAG + json.dumps({"keras_step_s": statistics.median(times), "rounds_s": times}), flush=True)


def _row(r):
    scaling = "" if "keras_scaling" not in r else \
        f"  scaling keras {r['keras_scaling']:.2f}x canonical {r['canonical_scaling']:.2f}x"
    return (f"{r['label']:<44} keras {r['keras_step_s'] * 1e3:7.1f} ms  canonical {r['canonical_step_s'] * 1e3:7.1f} ms"
            f"  ratio(canonical/keras) {r.get('ratio', r['canonical_step_s'] / r['keras_step_s']):.3f}{scaling}"
            f"  cpu/step {r['cpu_per_step_s'] * 1e3:.0f} ms")


def _machine():
    import platform

    import keras
    import tensorflow as tf

    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "tensorflow": tf.__version__, "keras": keras.__version__, "horovod": _horovod_version()}


def _horovod_version():
    from importlib import metadata

    return metadata.version("horovod")


# -- worker (one horovodrun rank) -----------------------------------------------------------

BATCH, FEATURES, HIDDEN, CLASSES, WARMUP = 4096, 512, 1024, 10, 3


def main_worker(args):
    import statistics

    import kerasdist  # first: hvd.init() under horovodrun
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    options = json.loads(args.options)
    dataset = synthetic_data(tf, hvd.rank())
    keras_times, canonical_times, cpu = [], [], []
    keras_model = compiled_keras_model(kerasdist, keras, options)
    canonical = CanonicalLoop(hvd, keras, tf, options)
    for _ in range(args.rounds):
        c0 = _cpu_seconds()
        keras_times.append(time_keras(keras, keras_model, dataset, args.steps))
        canonical_times.append(canonical.time(dataset, args.steps))
        cpu.append((_cpu_seconds() - c0) / (2 * (args.steps + WARMUP)))
    result = {"keras_step_s": statistics.median(keras_times), "canonical_step_s": statistics.median(canonical_times),
              "keras_rounds_s": keras_times, "canonical_rounds_s": canonical_times,
              "cpu_per_step_s": statistics.median(cpu), "size": hvd.size()}
    everyone = hvd.allgather_object(result)
    if hvd.rank() == 0:
        result["cpu_per_step_s_by_rank"] = [r["cpu_per_step_s"] for r in everyone]
        print(RESULT_TAG + json.dumps(result), flush=True)


def _cpu_seconds():
    times = os.times()
    return times.user + times.system


def synthetic_data(tf, rank):
    x = tf.random.stateless_normal((BATCH, FEATURES), seed=(1, rank))
    y = tf.random.stateless_uniform((BATCH,), seed=(2, rank), maxval=CLASSES, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def build_model(keras):
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def compiled_keras_model(kerasdist, keras, options):
    model = build_model(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute=kerasdist.horovod(shard=False, **options))
    return model


def time_keras(keras, model, dataset, steps):
    """Median seconds between consecutive batch ends, after WARMUP steps."""
    import statistics

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    timer = StepTimes()
    model.fit(dataset, steps_per_epoch=steps + WARMUP, epochs=1, verbose=0, callbacks=[timer])
    ends = timer.ends[WARMUP - 1:]
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


class CanonicalLoop:
    """Horovod's TF2 example (examples/tensorflow2/tensorflow2_mnist.py), on the same model."""

    def __init__(self, hvd, keras, tf, options):
        self.hvd = hvd
        self.model = build_model(keras)
        self.optimizer = keras.optimizers.SGD(0.01)
        self.optimizer.build(self.model.trainable_variables)
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        compression = hvd.Compression.fp16 if options.get("compression") == "fp16" else hvd.Compression.none
        # Keras 3 variables have no .ref() (horovod#4290): pass their backing tf.Variables.
        hvd.broadcast_variables([v.value for v in self.model.variables], root_rank=0)
        hvd.broadcast_variables([v.value for v in self.optimizer.variables], root_rank=0)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = self.loss(y, self.model(x, training=True))
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            grads = tape.gradient(loss, [v.value for v in self.model.trainable_variables])
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

        self.step = step

    def time(self, dataset, steps):
        import statistics

        ends = []
        for x, y in dataset.take(steps + WARMUP):
            float(self.step(x, y))
            ends.append(time.perf_counter())
        ends = ends[WARMUP - 1:]
        return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="also cycle 0.1/20 ms, fusion off, cache off")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--multiworker-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--multiworker-only", action="store_true", help="only distribute='multiworker'")
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        main_worker(args)
    elif args.multiworker_only:
        main_multiworker_only(args)
    elif args.multiworker_worker:
        main_multiworker_worker(args)
    else:
        main_driver(args)


if __name__ == "__main__":
    main()
