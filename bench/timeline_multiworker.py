"""Where a 2-worker ``fit(distribute="multiworker")`` step goes: a per-step timeline for each worker.

    python bench/timeline_multiworker.py [--batch 4096] [--steps 20] [--warmup 3] [--rounds 3]

Same model, data and thread limits as bench/bench_multiworker.py. Each round runs, interleaved: one plain
process (no cluster: the pace a worker would have alone) and 2 workers with the TCP ring. Inside the
workers, the ring's entry points are timed (the gradient and the log all-reduce run as
``tf.numpy_function`` calls into ``TcpRing.sum_arrays``), and Keras callbacks mark the step boundaries, so
that each step splits into:

- ``fwd+bwd``: step begin -> gradient all-reduce entered (input, forward, backward, dispatch into Python), less
  ``count sum``
- ``count sum``: ring calls before the gradients' (MultiWorkerMirroredStrategy's step: the row count of an
  uneven batch)
- ``grad wait``: inside the gradient all-reduce, waiting for the peer's first bytes (the other worker is
  still computing: imbalance)
- ``grad xfer``: the rest of the gradient all-reduce (packing, socket transfer, summing, unpacking)
- ``apply``: gradient all-reduce left -> the next ring call entered (optimizer update, metrics), or -> Keras's
  batch end callback when none follows (the strategy-free step: its loss travels with the gradients)
- ``log sum``: ring calls after the gradients' (the log all-reduce, metric states)
- ``to python``: the last ring call left -> Keras's batch end callback (function return, logs to numpy)
- ``between``: batch end -> next batch begin (Keras's loop, callbacks)

``--pin`` and ``--noop`` add variants to the interleaved rounds (2 workers each pinned to one CPU; 2 workers
whose ring calls return without moving a byte: what the multi-worker step costs without the transfer; its
training is wrong, its timing is the point); ``--mwms`` adds 2 workers on MultiWorkerMirroredStrategy's step
(``KERASDIST_STRATEGY_FREE=off``: the step before issue 22's strategy-free default); for others, add a kind to
``run`` the same way.

It also prints each process's CPU use during the timed steps by thread (from /proc/self/task), which
shows what competes with the compute thread (gRPC pollers, TF's inter-op pools, the ring), and the input
pipeline's own time per step (the distributed dataset iterated alone). Medians over rounds; the load
average is printed with each figure, since on a shared machine it moves them.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_description, free_ports, print_result, results, run_processes  # noqa: E402

HERE = os.path.abspath(__file__)
PHASES = ("fwd+bwd", "count sum", "grad wait", "grad xfer", "apply", "log sum", "to python", "between")


# -- inside a worker -------------------------------------------------------------------------

def thread_cpu():
    """{thread id: (name, CPU seconds)} for this process's threads."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        threads[tid] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return threads


def cpu_by_thread_name(before, after):
    """CPU seconds spent between two :func:`thread_cpu` samples, summed by thread name."""
    spent = collections.Counter()
    for tid, (name, seconds) in after.items():
        spent[name] += seconds - before.get(tid, (name, 0.0))[1]
    return {name: round(s, 3) for name, s in spent.most_common() if s > 0.0005}


def instrument_ring(marks):
    """Time TcpRing.sum_arrays (entry, first peer bytes, exit) per call, in ``marks``."""
    from kerasdist_plugins.multiworker import ring

    sum_arrays, exchange = ring.TcpRing.sum_arrays, ring.TcpRing._exchange
    first_bytes = []

    class FirstBytesClock:
        """The left socket, noting when the peer's first bytes of a call arrive."""

        def __init__(self, sock):
            self.sock = sock

        def fileno(self):
            return self.sock.fileno()

        def recv_into(self, buffer):
            got = self.sock.recv_into(buffer)
            if not first_bytes:
                first_bytes.append(time.perf_counter())
            return got

    def timed_exchange(self, send_array, receive_array):
        left = self._left
        self._left = FirstBytesClock(left)
        try:
            return exchange(self, send_array, receive_array)
        finally:
            self._left = left

    def timed_sum_arrays(self, *arrays):
        first_bytes.clear()
        entered = time.perf_counter()
        result = sum_arrays(self, *arrays)
        marks.append((sum(a.size for a in arrays), entered, first_bytes[0] if first_bytes else entered,
                      time.perf_counter()))
        return result

    ring.TcpRing.sum_arrays, ring.TcpRing._exchange = timed_sum_arrays, timed_exchange


def step_phases(begin, end, next_begin, calls):
    """One step's phases (seconds) from its boundaries and the ring calls (size, entered, first bytes, left) made
    inside it: the largest is the gradients'; those before it count rows, those after it sum logs."""
    if not calls:
        return None
    at = max(range(len(calls)), key=lambda i: calls[i][0])
    grad, before, after = calls[at], calls[:at], calls[at + 1:]
    count = sum(c[3] - c[1] for c in before)
    return {"fwd+bwd": grad[1] - begin - count, "count sum": count, "grad wait": grad[2] - grad[1],
            "grad xfer": grad[3] - grad[2], "apply": (after[0][1] if after else end) - grad[3],
            "log sum": sum(c[3] - c[1] for c in after), "to python": end - after[-1][3] if after else 0.0,
            "between": next_begin - end}


def input_time_per_step(strategy, dataset, steps):
    """The distributed input pipeline alone: seconds per global batch."""
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    return (time.perf_counter() - start) / steps


def worker(args):
    if os.environ.get("BENCH_PIN_CPU"):  # before TensorFlow starts its threads: they inherit it
        os.sched_setaffinity(0, {int(os.environ["BENCH_PIN_CPU"]) % os.cpu_count()})
    import bench_multiworker as bench

    bench.PER_WORKER_BATCH = args.batch
    bench.limit_threads()
    import kerasdist
    import keras

    cluster = kerasdist.detect_cluster()
    marks = []
    if not cluster.is_local:
        instrument_ring(marks)
    if os.environ.get("BENCH_RING_NOOP"):  # the numpy_function calls stay, the bytes do not move
        from kerasdist_plugins.multiworker import ring

        ring.TcpRing._ring_all_reduce = lambda self, flat: None

    global_batch = args.batch * cluster.num_workers
    model = bench.make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute=None if cluster.is_local else "multiworker")
    bounds, samples = [], {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.warmup:
                samples["threads"], samples["cpu"] = thread_cpu(), time.process_time()
            bounds.append(["begin", time.perf_counter(), len(marks)])

        def on_train_batch_end(self, batch, logs=None):
            bounds.append(["end", time.perf_counter(), len(marks)])
            if batch == args.warmup + args.steps - 1:
                samples["threads_after"], samples["cpu_after"] = thread_cpu(), time.process_time()

    model.fit(bench.make_data(global_batch), steps_per_epoch=args.warmup + args.steps + 1, epochs=1, verbose=0,
              callbacks=[Clock()])
    begins = [b for b in bounds if b[0] == "begin"]
    ends = [b for b in bounds if b[0] == "end"]
    phases = []
    for i in range(args.warmup, args.warmup + args.steps):
        calls = marks[begins[i][2]:ends[i][2]]
        phase = step_phases(begins[i][1], ends[i][1], begins[i + 1][1], calls)
        if phase is not None:
            phases.append(phase)
    wall = begins[args.warmup + args.steps][1] - begins[args.warmup][1]
    result = {"rank": cluster.task_index if not cluster.is_local else 0, "step_s": wall / args.steps,
              "cpu_per_step_s": (samples["cpu_after"] - samples["cpu"]) / args.steps,
              "threads_cpu_s": cpu_by_thread_name(samples["threads"], samples["threads_after"]),
              "phases_s": {p: statistics.mean(s[p] for s in phases) for p in PHASES} if phases else {}}
    strategy = model.distribute_strategy
    result["input_only_s"] = input_time_per_step(strategy, bench.make_data(global_batch), args.steps)
    print_result(result)


# -- the driver -----------------------------------------------------------------------------

def run(kind, args):
    workers = 1 if kind == "alone" else 2
    ports = free_ports(workers)
    command = [sys.executable, HERE, "--role", "worker", "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    environments = []
    for index in range(workers):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update(TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if kind == "pinned":
            env["BENCH_PIN_CPU"] = str(index)
        if kind == "noop":
            env["BENCH_RING_NOOP"] = "1"
        if kind == "mwms":
            env["KERASDIST_STRATEGY_FREE"] = "off"
        if workers > 1:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": index}})
            env["KERASDIST_COMMUNICATION"] = "tcp"  # the TCP ring, timed: auto's probe might pick TensorFlow's
        environments.append(env)
    outputs = run_processes([command] * workers, environments, args.timeout, f"timeline {kind}")
    return results(outputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", choices=("driver", "worker"))
    parser.add_argument("--batch", type=int, default=4096, help="per-worker batch size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--pin", action="store_true",
                        help="also 2 workers each pinned to one CPU (os.sched_setaffinity), interleaved")
    parser.add_argument("--noop", action="store_true",
                        help="also 2 workers whose ring moves nothing (not training correctly: a cost split)")
    parser.add_argument("--mwms", action="store_true",
                        help="also 2 workers on MultiWorkerMirroredStrategy's step (KERASDIST_STRATEGY_FREE=off)")
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    print(f"CPU: {cpu_description()}; per-worker batch {args.batch}; {args.steps} steps after {args.warmup} "
          f"warm-up; {args.rounds} round(s); load average at start {os.getloadavg()[0]:.2f}")
    results = collections.defaultdict(list)
    for round_number in range(args.rounds):
        kinds = ("alone", "ring") + (("pinned",) if args.pin else ()) + (("noop",) if args.noop else ()) \
            + (("mwms",) if args.mwms else ())
        for kind in (kinds if round_number % 2 == 0 else kinds[::-1]):
            for result in run(kind, args):
                results[(kind, result["rank"])].append(result)
                print(f"  round {round_number + 1}: {kind:<6} rank {result['rank']} step "
                      f"{result['step_s'] * 1e3:7.1f} ms  load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\nmedians over rounds (load average at end {os.getloadavg()[0]:.2f}), ms per step:")
    print(f"  {'':<14}{'step':>7}{'cpu':>7}{'input':>7}" + "".join(f"{p:>11}" for p in PHASES))
    for (kind, rank), runs in sorted(results.items()):
        med = lambda f: statistics.median(f(r) for r in runs) * 1e3  # noqa: E731
        phases = "".join(f"{med(lambda r: r['phases_s'][p]):11.1f}" if runs[0]["phases_s"] else f"{'-':>11}"
                         for p in PHASES)
        print(f"  {kind + ' rank ' + str(rank):<14}{med(lambda r: r['step_s']):7.1f}"
              f"{med(lambda r: r['cpu_per_step_s']):7.1f}{med(lambda r: r['input_only_s']):7.1f}{phases}")
    print("\nCPU seconds by thread during the timed steps (last round):")
    for (kind, rank), runs in sorted(results.items()):
        print(f"  {kind} rank {rank}: {runs[-1]['threads_cpu_s']}")


if __name__ == "__main__":
    sys.exit(main())
