"""Where a 2-process ``fit(distribute="data_parallel")`` step goes on torch: a per-step timeline, beside the
same timeline of the no-communication ceiling (2 independent plain ``fit`` processes) and the keras.io
guide's DDP loop (forward, loss, backward with DDP's all-reduce inside, ``optimizer.step``, ``loss.item()``).

    python bench/timeline_torch.py [--batch 2048] [--steps 12] [--warmup 3] [--rounds 3] [--split-wait]

Same model, data and thread limits as bench/bench_torch.py (whose worker pieces it reuses). Inside each
worker, once ``fit`` has begun (kerasdist's wrappers are installed by then), entry and exit points are
timed with ``time.perf_counter``, so that each step splits into:

- ``step pre``: train function entered -> the model's ``call`` (kerasdist's step wrapper, unpacking)
- ``forward``: the model's call -> ``_compute_loss`` entered (forward, ``zero_grad``)
- ``loss``: -> ``loss.backward()`` entered (loss, loss tracker, ``scale_loss``)
- ``backward``: -> ``optimizer.apply`` entered
- ``flat build``: -> the gradient ``all_reduce`` entered (kerasdist: the flat buffer; plain fit: nothing)
- ``wait``: (``--split-wait`` only) a ``barrier`` before the all-reduce: the other rank still computing
- ``all_reduce``: the gradient all-reduce
- ``unflatten``: -> Keras's own ``apply`` body (kerasdist: the sums cut back, divided)
- ``optimizer``: Keras's apply body
- ``metrics``: optimizer left -> train function left (``compute_metrics``, ``get_metrics_result``)
- ``cb end``/``cb begin``: Keras's batch-end / batch-begin callbacks
- ``data``: batch-end callbacks left -> next batch-begin callbacks (the epoch iterator: the batch read
  and converted to torch tensors)

Means over the timed steps of each rank (so that the phases add up to the step: a step's time in
synchronous training goes to whichever phase waits), then medians over rounds; the load average is printed
with each round (another process on the machine moves absolute times: compare shares within one run).
"""

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_torch  # noqa: E402
from _common import barrier, cpu_description, free_ports, print_result, results, run_processes  # noqa: E402

HERE = os.path.abspath(__file__)
# (phase, the mark that ends it); every phase starts at the previous phase's end mark
PHASES = (("step pre", "call"), ("forward", "loss"), ("loss", "backward"), ("backward", "apply"),
          ("flat build", "reduce"), ("wait", "waited"), ("all_reduce", "reduced"), ("unflatten", "keras apply"),
          ("optimizer", "applied"), ("metrics", "step end"), ("cb end", "cb end done"),
          ("data", "cb begin"), ("cb begin", "next step"))


# -- inside a worker -------------------------------------------------------------------------

def _timed_entry(marks, name, function):
    def entered(*args, **kwargs):
        marks.setdefault(name, time.perf_counter())
        return function(*args, **kwargs)
    return entered


def _timed_span(marks, enter, leave, function):
    def spanned(*args, **kwargs):
        marks.setdefault(enter, time.perf_counter())
        try:
            return function(*args, **kwargs)
        finally:
            marks[leave] = time.perf_counter()
    return spanned


def instrument(model, steps, split_wait):
    """Wrap the model's, optimizer's and torch's entry points; each step's marks go to ``steps``."""
    import torch
    import torch.distributed as dist
    from keras.src import callbacks as callbacks_module

    marks = {}
    model.call = _timed_entry(marks, "call", model.call)
    model._compute_loss = _timed_entry(marks, "loss", model._compute_loss)
    backward = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *a, **k: _timed_entry(marks, "backward", backward)(self, *a, **k)
    model.optimizer.apply = _timed_span(marks, "apply", "applied", model.optimizer.apply)
    model.optimizer._check_variables_are_known = _timed_entry(marks, "keras apply",
                                                              model.optimizer._check_variables_are_known)
    if dist.is_initialized():
        all_reduce = dist.all_reduce

        def timed_all_reduce(tensor, *args, **kwargs):
            if "reduce" in marks:  # a later collective in the step (metrics): counted, not split out
                marks["extra collectives"] = marks.get("extra collectives", 0) + 1
                return all_reduce(tensor, *args, **kwargs)
            marks["reduce"] = time.perf_counter()
            if split_wait:
                dist.barrier()
            marks["waited"] = time.perf_counter()
            try:
                return all_reduce(tensor, *args, **kwargs)
            finally:
                marks["reduced"] = time.perf_counter()
        dist.all_reduce = timed_all_reduce
    train_function = model.train_function

    def timed_train_function(data):
        if "start" in marks:
            marks["next step"] = time.perf_counter()
            steps.append(dict(marks))
        marks.clear()
        marks["start"] = time.perf_counter()
        try:
            return train_function(data)
        finally:
            marks["step end"] = time.perf_counter()
    model.train_function = timed_train_function
    end, begin = callbacks_module.CallbackList.on_train_batch_end, callbacks_module.CallbackList.on_train_batch_begin
    callbacks_module.CallbackList.on_train_batch_end = _timed_span(marks, "cb end start", "cb end done", end)
    callbacks_module.CallbackList.on_train_batch_begin = _timed_entry(marks, "cb begin", begin)


def phases_of(marks):
    """{phase: seconds} of one step's marks (a phase whose end mark is absent is folded into the next)."""
    out, at = {}, marks["start"]
    for phase, end in PHASES:
        if end in marks:
            out[phase] = marks[end] - at
            at = marks[end]
        else:
            out[phase] = 0.0
    out["step"] = marks["next step"] - marks["start"]
    out["collectives"] = int("reduce" in marks) + marks.get("extra collectives", 0)
    return out


def worker(args):
    bench_torch.limit_threads()
    import kerasdist  # noqa: F401
    import keras

    _, size = bench_torch.world()
    global_batch = args.batch * size
    x, y = bench_torch.make_data(global_batch, args.warmup + args.steps + 1)
    model = bench_torch.make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute="data_parallel" if size > 1 else None)
    steps = []

    class Instrument(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            instrument(self.model, steps, args.split_wait)

        def on_train_batch_end(self, batch, logs=None):
            if batch == args.warmup - 1:
                barrier()  # independent processes (the ceiling) start their timed steps together

    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[Instrument()])
    timed = [phases_of(m) for m in steps[args.warmup:]]
    print_result({"phases": {k: statistics.fmean(s[k] for s in timed) for k in timed[0]}})


def worker_guide(args):
    """The keras.io guide's loop of bench_torch.py, timed: DDP's all-reduce runs inside ``backward``."""
    bench_torch.limit_threads()
    import torch

    import keras  # noqa: F401

    rank, size = bench_torch.world()
    torch.distributed.init_process_group("gloo", init_method="env://", world_size=size, rank=rank)
    x, y = bench_torch.make_data(args.batch * size, args.warmup + args.steps)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=False)
    loader = list(torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch, shuffle=False))
    model = bench_torch.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    steps = []
    for inputs, targets in loader:
        t = [time.perf_counter()]
        outputs = ddp_model(inputs)
        t.append(time.perf_counter())
        loss = loss_fn(outputs, targets)
        t.append(time.perf_counter())
        optimizer.zero_grad()
        loss.backward()
        t.append(time.perf_counter())
        optimizer.step()
        t.append(time.perf_counter())
        loss.item()
        t.append(time.perf_counter())
        steps.append(t)
    timed = [{"forward": b[1] - b[0], "loss": b[2] - b[1], "backward": b[3] - b[2], "optimizer": b[4] - b[3],
              "metrics": b[5] - b[4], "data": nxt[0] - b[5], "step": nxt[0] - b[0], "collectives": 0}
             for b, nxt in zip(steps[args.warmup:], steps[args.warmup + 1:])]
    print_result({"phases": {k: statistics.fmean(s[k] for s in timed) for k in timed[0]}})
    sys.stdout.flush()
    os._exit(0)  # as bench_torch's guide worker: torch 2.13 + gloo teardown can hang


# -- the driver ------------------------------------------------------------------------------

def run(kind, args):
    """Per-process step means of one configuration: "ceiling" (2 independent plain fits), "kerasdist" or "guide"
    (the keras.io guide's DDP loop; its backward includes DDP's all-reduce)."""
    independent = kind == "ceiling"
    port = free_ports(1)[0]
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
    base = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC")}
    base.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3",
                PYTHONUNBUFFERED="1")
    environments = [dict(base) if independent else dict(base, **bench_torch.torchrun_environment(rank, 2, port))
                    for rank in range(2)]
    command = [sys.executable, HERE, "--role", "guide" if kind == "guide" else "worker", "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch)] + (["--split-wait"] if args.split_wait else [])
    return results(run_processes([command] * 2, environments, args.timeout, kind, independent=independent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", choices=("driver", "worker", "guide"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2048, help="per-process batch size")
    parser.add_argument("--split-wait", action="store_true", help="a barrier before the gradient all-reduce "
                        "separates waiting for the other rank from the transfer")
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    if args.role == "guide":
        return worker_guide(args)
    print(f"CPU: {cpu_description()}; per-process batch {args.batch}; {args.steps} timed steps after "
          f"{args.warmup} warm-up; {args.rounds} round(s); split wait: {args.split_wait}", flush=True)
    figures = collections.defaultdict(list)  # (kind, rank) -> [phases per round]
    for round_index in range(args.rounds):
        load = os.getloadavg()[0]
        for kind in ("ceiling", "kerasdist", "guide"):
            for index, result in enumerate(run(kind, args)):  # independent processes are all rank 0
                figures[(kind, index)].append(result["phases"])
        print(f"round {round_index + 1} done (load average at its start {load:.2f})", flush=True)
    names = [p for p, _ in PHASES] + ["step", "collectives"]
    keys = sorted(figures, key=lambda k: (("ceiling", "kerasdist", "guide").index(k[0]), k[1]))
    print(f"{'ms per step':<22}" + "".join(f"{kind[:9]} p{index}".rjust(14) for kind, index in keys))
    for name in names:
        row = [statistics.median(r.get(name, 0.0) for r in figures[key]) for key in keys]
        scale = 1 if name == "collectives" else 1000
        print(f"{name:<22}" + "".join(f"{v * scale:14.2f}" for v in row))


if __name__ == "__main__":
    sys.exit(main())
