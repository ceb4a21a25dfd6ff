"""Pieces the multi-process benchmarks share: free loopback ports, a start barrier for independent
processes, running a group of processes with a timeout (no orphans), the CPU description and medians."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def barrier():
    """Independent processes (no cluster) start timing together, so that they compete for the CPUs."""
    directory, count = os.environ.get("BENCH_BARRIER_DIR"), int(os.environ.get("BENCH_BARRIER_N", "1"))
    if not directory:
        return
    open(os.path.join(directory, str(os.getpid())), "w").close()
    while len(os.listdir(directory)) < count:
        time.sleep(0.001)


def run_processes(commands, environments, timeout, what, independent=False):
    """Run one process per (command, environment), each in its own session; returns their outputs.
    ``independent``: they share a start barrier (:func:`barrier`). Any process still running at the
    timeout, or when another failed, is killed with its process group; a failure raises SystemExit."""
    barrier_dir = tempfile.mkdtemp(prefix="bench-barrier-") if independent else None
    procs = []
    try:
        for command, env in zip(commands, environments):
            if barrier_dir:
                env = dict(env, BENCH_BARRIER_DIR=barrier_dir, BENCH_BARRIER_N=str(len(commands)))
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        outputs = [proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for proc in procs]
    except subprocess.TimeoutExpired:
        outputs = _outputs_after_timeout(procs)
        raise SystemExit(f"{what}: still running after {timeout:.0f} s, killed. Each process's exit status "
                         "(None: killed) and last output (Python stacks of a hung one: faulthandler, SIGUSR1):\n"
                         + "\n".join(f"--- process {i} ({code}):\n{out[-2000:]}"
                                     for i, (code, out) in enumerate(outputs)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if barrier_dir:
            shutil.rmtree(barrier_dir, ignore_errors=True)
    for proc, out in zip(procs, outputs):
        if proc.returncode != 0:
            raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return outputs


def _outputs_after_timeout(procs):
    """(exit status before the kill, output) of each process; a running one is asked for its Python stacks
    (SIGUSR1: see :func:`stacks_on_signal`) and then killed."""
    codes = [proc.poll() for proc in procs]
    for proc, code in zip(procs, codes):
        if code is None:
            os.killpg(proc.pid, signal.SIGUSR1)
    time.sleep(2)
    outputs = []
    for proc, code in zip(procs, codes):
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        outputs.append((code, proc.communicate()[0] or ""))
    return outputs


def stacks_on_signal():
    """In a worker: print every thread's Python stack on SIGUSR1 (the driver's timeout asks for it)."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)


def cpu_description():
    """Model name, the vector flags that pick kernels (AVX2, AVX-512, VNNI), and the cores: results depend on them."""
    try:
        info = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return f"{os.cpu_count()} CPUs (no /proc/cpuinfo)"
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    vector = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile"))
    return f"{model}; {' '.join(vector) or 'no AVX2'}; {os.cpu_count()} CPUs"


def median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def interleaved_rounds(configs, rounds, run):
    """``{name: [step seconds per round]}``: every config once a round (``run(config)`` returns its step
    seconds), the order alternating between rounds so that neither goes first each time."""
    steps = {config[0]: [] for config in configs}
    for round_number in range(rounds):
        for config in configs if round_number % 2 == 0 else configs[::-1]:
            step_s = run(config)
            steps[config[0]].append(step_s)
            print(f"  round {round_number + 1}: {config[0]:<55} step {step_s * 1000:8.1f} ms", flush=True)
    return steps


def print_summary(steps, configs, batch_of, word, hand_written, ceiling_pace=False):
    """Medians per config (step, examples/s, scaling against configs[0]), then the two ratios that matter:
    the hand-written loop (configs[3]) over kerasdist (configs[2]), and the ceiling (configs[1]) over kerasdist."""
    import os

    print(f"\nmedians (load average at end {os.getloadavg()[0]:.2f}):")
    base, ceiling = median(steps[configs[0][0]]), median(steps[configs[1][0]])
    for config in configs:
        name, processes = config[0], config[2]
        step = median(steps[name])
        pace = f"  ({ceiling / step:.0%} of the ceiling's pace)" if ceiling_pace else ""
        print(f"  {name:<55} step {step * 1000:8.1f} ms  {batch_of(processes) / step:9.0f} examples/s  "
              f"scaling {processes * base / step:.2f}x{pace}")
    ceiling, ours, hand = (median(steps[config[0]]) for config in configs[1:4])
    print(f"\nstep time, {hand_written} / distribute='{word}': {hand / ours:.3f} "
          "(>= 1 means kerasdist is as fast or faster)")
    print(f"step time, ceiling (2 processes, no communication) / distribute='{word}': {ceiling / ours:.3f} "
          "(1 = communication costs nothing)")


def step_clock(warmup, times):
    """A Keras callback appending ``time.perf_counter()`` to ``times`` after every training step; the
    processes meet at :func:`barrier` after the last warm-up step, so the timed steps start together."""
    import keras

    class StepClock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == warmup - 1:
                barrier()
            times.append(time.perf_counter())

    return StepClock()


RESULT_PREFIX = "RESULT "


def print_result(result):
    """A worker's result line (a JSON object), read back by :func:`results`."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def results(outputs):
    """The result objects printed by :func:`print_result` in the workers' outputs."""
    decoder = json.JSONDecoder()  # raw_decode: torchrun's ranks share one stdout, a line may run into the next
    return [decoder.raw_decode(part)[0] for out in outputs for line in out.splitlines()
            for part in line.split(RESULT_PREFIX)[1:]]
