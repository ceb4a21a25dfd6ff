"""Experiment (issue 22): 2 workers training with NO tf.distribute strategy, gradients summed over kerasdist's
TCP ring inside the optimizer's ``apply`` (as Horovod's DistributedOptimizer does), vs ``distribute="multiworker"``.

    python bench/exp_strategy_free.py [--batch 256] [--steps 20] [--warmup 3] [--rounds 3] [--kinds ...]
    python bench/exp_strategy_free.py --batch 256 --profile [--kinds alone mw mwnoop free]

Same model, data and thread limits as bench/bench_multiworker.py (512-1024-10 MLP, SGD, one cached batch per
process, 1 intra-op + 1 inter-op thread). Kinds, run interleaved (the order alternates between rounds):

- ``alone``: 1 process, plain Keras ``fit`` on the per-worker batch;
- ``ceiling``: 2 independent plain processes (no cluster, no communication), timed together;
- ``mw``: 2 workers, ``distribute="multiworker"`` (MultiWorkerMirroredStrategy, gradients over the TCP ring);
- ``mwfree``: ``mw`` with ``KERASDIST_STRATEGY_FREE=on``: the plugin's own strategy-free path (default strategy,
  one ring message per step for gradients x rows, rows and loss; rank 0's state broadcast at the start);
- ``mwtfcount``: ``mw`` with the per-step row count (uneven batches: the batch dimension is dynamic) summed by
  a TensorFlow collective, as before kerasdist sent it over the TCP ring;
- ``mwlocallogs``: ``mw`` whose per-step logs are not averaged over the workers (each keeps its own: what the
  second ring message per step costs; the chief's logs are then its shard's);
- ``mwstatic``: ``mw`` on batches of a static size (``drop_remainder=True``): kerasdist then knows every batch
  splits evenly and skips its per-step row-count all-reduce (a TensorFlow collective, for uneven batches);
- ``mwnoop``: ``mw`` whose ring calls return at once (wrong training; what the multi-worker step costs);
- ``free``: 2 workers, each a plain Keras ``fit`` (default strategy, one replica) on its half of the global batch;
  ``optimizer.apply`` sums the gradients over the same TCP ring (one ``tf.numpy_function``) and divides by
  the worker count, and ``train_step``'s float logs are averaged over the ring (a second, small message);
- ``free1``: ``free`` with the loss travelling in the gradients' message (one exchange per step; the other
  logs are the worker's own: the ``loss`` entry is the global one).

``--profile``: each kind's first worker also records its timed steps with the TensorFlow profiler (host
trace) and with cProfile (the Python thread), and prints the host events and Python functions that take the
most time per step. Medians over rounds; the load average is printed, since other processes move the figures.
"""

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (barrier, cpu_description, free_ports, median, print_result, results,  # noqa: E402
                     run_processes)
from timeline_multiworker import cpu_by_thread_name, thread_cpu  # noqa: E402

HERE = os.path.abspath(__file__)
KINDS = ("alone", "ceiling", "mw", "mwfree", "mwtfcount", "mwlocallogs", "mwstatic", "mwnoop", "free", "free1")


# -- inside a worker -----------------------------------------------------------------------------

def connect_ring():
    """The TCP ring between the workers named in BENCH_RING (no MultiWorkerMirroredStrategy, no TF_CONFIG)."""
    from kerasdist_plugins.multiworker import ring as tcp_ring

    addresses, rank = json.loads(os.environ["BENCH_RING"]), int(os.environ["BENCH_RANK"])
    host, port = addresses[rank].rsplit(":", 1)
    listener, _ = tcp_ring.listen(host, int(port))
    return tcp_ring.TcpRing.connect(listener, addresses, rank, timeout=120, secret=b"bench")


def ring_over_optimizer(model, ring, loss_too):
    """Horovod-style: ``apply`` averages the gradients over the ring first; logs averaged over it too."""
    import tensorflow as tf

    optimizer, keras_apply, keras_train_step = model.optimizer, model.optimizer.apply, model.train_step
    carried = {}

    def apply(grads, trainable_variables=None):
        grads = list(grads)
        extra = [carried.pop("loss")] if "loss" in carried else []
        sums = ring.sum_tensors(grads + extra)
        if extra:
            carried["loss_mean"] = sums.pop() / ring.size
        return keras_apply([s / ring.size for s in sums], trainable_variables)

    def compute_loss(*args, **kwargs):
        loss = keras_compute_loss(*args, **kwargs)
        if loss_too:
            carried["loss"] = tf.cast(loss, tf.float32)
        return loss

    def train_step(data):
        logs = keras_train_step(data)
        if loss_too:
            logs = dict(logs, loss=carried.pop("loss_mean"))
            return logs
        names = [k for k, v in logs.items() if v.shape.rank == 0 and v.dtype.is_floating]
        means = ring.sum_tensors([logs[k] for k in names])
        return dict(logs, **{k: m / ring.size for k, m in zip(names, means)})

    keras_compute_loss = model.compute_loss
    object.__setattr__(optimizer, "apply", apply)
    object.__setattr__(model, "compute_loss", compute_loss)
    object.__setattr__(model, "train_step", train_step)


def static_batches(global_batch):
    """bench_multiworker.make_data with a static batch size (the same batch, every batch full)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(0)
    x = rng.rand(global_batch, 512).astype("float32")
    y = rng.randint(0, 10, size=(global_batch,)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True).cache().repeat()


def host_events_per_step(directory, steps, top=45):
    """{event name: ms per step} over the host threads of the profiler's xplane, the largest first."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    totals = collections.Counter()
    for path in glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if not plane.name.startswith("/host:CPU"):
                continue
            names = {i: m.name for i, m in plane.event_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    totals[f"{line.name[:18]} | {names.get(event.metadata_id, '?')[:70]}"] += event.duration_ps
    return [(name, round(ps / 1e9 / steps, 3)) for name, ps in totals.most_common(top)]


def python_functions_per_step(profile, steps, top=20):
    """[(function, own ms per step, cumulative ms per step)] of the Python thread, by own time."""
    stats = pstats.Stats(profile)
    rows = [(f"{os.path.basename(k[0])}:{k[1]}:{k[2]}", v[2], v[3]) for k, v in stats.stats.items()]
    rows.sort(key=lambda r: -r[1])
    return [(name, round(own * 1e3 / steps, 3), round(cum * 1e3 / steps, 3)) for name, own, cum in rows[:top]]


def worker(args):
    import bench_multiworker as bench

    bench.PER_WORKER_BATCH = args.batch
    bench.limit_threads()
    kind = os.environ["BENCH_KIND"]
    import kerasdist  # noqa: F401  joins the cluster before any op (mw kinds: TF_CONFIG is set)
    import keras
    import tensorflow as tf

    from kerasdist_plugins.multiworker import ring as tcp_ring

    if kind == "mwnoop":
        tcp_ring.TcpRing._ring_all_reduce = lambda self, flat: None
    if kind == "mwlocallogs":  # scalar lists are the logs (gradients and row counts are not all scalars)
        ring_sum_tensors = tcp_ring.TcpRing.sum_tensors
        tcp_ring.TcpRing.sum_tensors = lambda self, tensors: (
            [t * self.size for t in tensors] if all(t.shape.rank == 0 for t in tensors)
            else ring_sum_tensors(self, tensors))
    if kind == "mwtfcount":
        tcp_ring.TcpRing.sum_count = None  # the plugin then leaves the row count to TensorFlow's all-reduce
    ring = connect_ring() if kind.startswith("free") else None
    rank = int(os.environ.get("BENCH_RANK", "0"))
    workers = 2 if kind.startswith(("mw", "free")) else 1
    model = bench.make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute="multiworker" if kind.startswith("mw") else None)
    if ring is not None:
        ring_over_optimizer(model, ring, loss_too=kind == "free1")
    # mw: the global batch, sharded by the strategy; the others: each process its per-worker batch
    data = bench.make_data(args.batch * (workers if kind.startswith("mw") else 1))
    if kind == "mwstatic":
        data = static_batches(args.batch * workers)
    profiling = args.profile and rank == 0
    times, state = [], {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == args.warmup - 1:
                barrier()
                state["cpu"], state["threads"] = time.process_time(), thread_cpu()
                if profiling:
                    state["trace"] = tempfile.mkdtemp(prefix="exp-trace-")
                    tf.profiler.experimental.start(state["trace"])
                    state["py"] = cProfile.Profile()
                    state["py"].enable()
            times.append(time.perf_counter())
            if batch == args.warmup + args.steps - 1:
                state["cpu_after"], state["threads_after"] = time.process_time(), thread_cpu()
                if profiling:
                    state["py"].disable()
                    tf.profiler.experimental.stop()

    model.fit(data, steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0, callbacks=[Clock()])
    timed = times[args.warmup - 1:]
    result = {"kind": kind, "rank": rank, "step_s": (timed[-1] - timed[0]) / (len(timed) - 1),
              "cpu_per_step_s": (state["cpu_after"] - state["cpu"]) / args.steps,
              "threads_cpu_ms": {name: round(s * 1e3 / args.steps, 2) for name, s in
                                 cpu_by_thread_name(state["threads"], state["threads_after"]).items()},
              "loss": float(model.evaluate(data, steps=1, verbose=0)) if kind in ("alone", "free") else None}
    if profiling:
        result["host_events_ms"] = host_events_per_step(state["trace"], args.steps)
        path = os.path.join(state["trace"], "python.prof")
        state["py"].dump_stats(path)
        result["python_ms"] = python_functions_per_step(path, args.steps)
    if ring is not None:
        ring.close()
    print_result(result)


# -- the driver ---------------------------------------------------------------------------------

def run(kind, args):
    workers = 1 if kind == "alone" else 2
    ports = free_ports(workers)
    command = [sys.executable, HERE, "--role", "worker", "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--profile"] if args.profile else [])
    environments = []
    for index in range(workers):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update(TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", BENCH_KIND=kind,
                   BENCH_RANK=str(index))
        addresses = [f"127.0.0.1:{p}" for p in ports]
        if kind.startswith("mw"):
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses},
                                           "task": {"type": "worker", "index": index}})
            env["KERASDIST_COMMUNICATION"] = "tcp"  # the TCP ring, as auto picks on CPUs (and no probe)
            env["KERASDIST_STRATEGY_FREE"] = "on" if kind == "mwfree" else "off"
        elif kind.startswith("free"):
            env["BENCH_RING"] = json.dumps(addresses)
        environments.append(env)
    outputs = run_processes([command] * workers, environments, args.timeout, f"{kind}",
                            independent=kind in ("ceiling", "free", "free1"))
    return results(outputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", choices=("driver", "worker"))
    parser.add_argument("--batch", type=int, default=256, help="per-worker batch size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--kinds", nargs="+", default=["alone", "ceiling", "mw", "free", "free1"], choices=KINDS)
    parser.add_argument("--profile", action="store_true", help="TF profiler + cProfile of each kind's worker 0")
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    print(f"CPU: {cpu_description()}; per-worker batch {args.batch}; {args.steps} steps after {args.warmup} "
          f"warm-up; {args.rounds} round(s); load average at start {os.getloadavg()[0]:.2f}")
    steps, last = collections.defaultdict(list), {}
    for round_number in range(args.rounds):
        for kind in args.kinds if round_number % 2 == 0 else args.kinds[::-1]:
            results = run(kind, args)
            slowest = max(r["step_s"] for r in results)  # synchronous: the pace of the slowest worker
            steps[kind].append(slowest)
            cpu = max(r["cpu_per_step_s"] for r in results)
            last[kind] = results
            print(f"  round {round_number + 1}: {kind:<8} step {slowest * 1e3:7.1f} ms  cpu {cpu * 1e3:6.1f} ms  "
                  f"loss {[r['loss'] for r in results]}  load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\nmedians over rounds (load average at end {os.getloadavg()[0]:.2f}):")
    ceiling = median(steps["ceiling"]) if steps.get("ceiling") else None
    for kind in args.kinds:
        step = median(steps[kind])
        share = f"  {ceiling / step:.0%} of the ceiling's pace" if ceiling and kind != "alone" else ""
        print(f"  {kind:<8} step {step * 1e3:7.1f} ms{share}")
    print("\nCPU ms per step by thread (last round, each process):")
    for kind, results in last.items():
        for result in results:
            print(f"  {kind} worker {result['rank']}: {result['threads_cpu_ms']}")
    if args.profile:
        for kind, results in last.items():
            for result in results:
                if "host_events_ms" in result:
                    print(f"\n{kind} worker {result['rank']}: host trace, ms per step (thread | event):")
                    for name, ms in result["host_events_ms"]:
                        print(f"  {ms:8.3f}  {name}")
                    print(f"{kind} worker {result['rank']}: Python thread (cProfile), own / cumulative ms per step:")
                    for name, own, cum in result["python_ms"]:
                        print(f"  {own:8.3f} {cum:8.3f}  {name}")


if __name__ == "__main__":
    sys.exit(main())
