"""The words the fuzzer runs, in groups that share one process start: each group runs a list of jobs in ONE process
or launch (tests/fuzz/worker.py), each job's one-process reference trained in that same process.

``run_group(name, seeds, out_dir, timeout)`` returns {(seed, word): record}, each record the worst any rank saw;
the first job some rank never finished (a hang, a crash) is "DEFECT: raw error", the jobs after it, or after a
raw error in a launch (its ranks stop there, worker.py), "not run".
"""

import json
import os
import time
import uuid

from helpers import PYTHON, ROOT, child_env, processes_with, run

from .compare import worst_outcome
from .grammar import draw_job

KERASDIST = os.path.join(os.path.dirname(PYTHON), "kerasdist")
HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")
WORKER = os.path.join(ROOT, "tests", "fuzz", "worker.py")
LAUNCH = [KERASDIST, "launch", "-n", "2", "--join-timeout", "60"]
HOROVOD = [HOROVODRUN, "-np", "2", "--gloo", "-H", "localhost:2", "--network-interfaces", "lo",
           "--gloo-timeout-seconds", "60", PYTHON]
TWO_DEVICES = "--xla_force_host_platform_device_count=2"

#: name -> (backend, words, launcher (None: one process), environment)
GROUPS = {
    "tf_local": ("tensorflow", ("mirrored", "central_storage"), None, {"KERASDIST_CPU_REPLICAS": 2}),
    "tf_multiworker": ("tensorflow", ("multiworker",), LAUNCH, {"KERASDIST_STRATEGY_FREE": "on"}),
    "tf_multiworker_mwms": ("tensorflow", ("multiworker",), LAUNCH, {"KERASDIST_STRATEGY_FREE": "off"}),
    "tf_horovod": ("tensorflow", ("horovod",), HOROVOD, {}),
    "jax_local": ("jax", ("data_parallel", "hybrid"), None, {"XLA_FLAGS": TWO_DEVICES}),
    "jax_processes": ("jax", ("data_parallel",), LAUNCH, {}),
    "torch": ("torch", ("data_parallel", "fsdp"), LAUNCH, {"OMP_NUM_THREADS": 1}),
}
#: how the launcher is written in a defect's standalone script
LAUNCHER_TEXT = {None: "", "launch": "kerasdist launch -n 2 ", "horovod": "horovodrun -np 2 --gloo -H localhost:2 "}


def launcher_text(group):
    start = GROUPS[group][2]
    return LAUNCHER_TEXT["launch" if start is LAUNCH else "horovod" if start is HOROVOD else None]


def environment_text(group):
    return " ".join(f"{k}={v}" for k, v in GROUPS[group][3].items() if k != "OMP_NUM_THREADS")


def start_command(group, out_dir, jobs_file):
    backend, words, start, env = GROUPS[group]
    command = [*(start or [PYTHON]), WORKER, out_dir, group, ",".join(words), jobs_file]
    return command, child_env(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL=3, **env)


def read_records(out_dir, group):
    """{(seed, word): [record of each rank]} written so far."""
    found = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith(f"outcomes-{group}-rank") and name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name)) as f:
                for line in f:
                    record = json.loads(line)
                    found.setdefault((record["seed"], record["word"]), []).append(record)
    return found


def merged(records):
    """The record of the worst outcome any rank saw (its worst difference the largest)."""
    outcome = worst_outcome([r["outcome"] for r in records])
    same = [r for r in records if r["outcome"] == outcome]
    return max(same, key=lambda r: r.get("worst") or 0.0)


def group_timeout(seeds):
    """Seconds a group's start may take: 150 s to start, 250 s a job, at most 600 (load 17 on 2 cores: one JAX job
    over 2 processes took 215 s, and 240 s ran out)."""
    return min(600, 150 + 250 * len(seeds))


def run_group(group, seeds, out_dir, timeout=None):
    """Every seed's job under every word of ``group`` in one process or launch: {(seed, word): record}."""
    backend, words, start, _ = GROUPS[group]
    os.makedirs(out_dir, exist_ok=True)
    jobs_file = os.path.join(out_dir, f"jobs-{group}-{uuid.uuid4().hex[:8]}.json")
    with open(jobs_file, "w") as f:
        json.dump([draw_job(seed, backend) for seed in seeds], f)
    command, env = start_command(group, out_dir, jobs_file)
    tag = uuid.uuid4().hex
    began = time.monotonic()
    try:
        result = run([*command, tag] if start is HOROVOD else command, timeout=timeout or group_timeout(seeds),
                     env=env, check=False)
        output, code = result.stdout, f"exit {result.returncode}"
    except AssertionError as error:  # helpers.run's timeout: the group was killed
        output, code = str(error), "timed out"
    finally:
        for pid in processes_with(tag) if start is HOROVOD else ():
            os.kill(pid, 9)
    tail = output[-3000:]
    with open(jobs_file.replace(".json", ".log"), "w") as f:  # the tracebacks of the group's raw errors
        f.write(output)
    seconds = time.monotonic() - began
    found = read_records(out_dir, group)
    expected_ranks = 1 if start is None else 2
    results, stopped = {}, False
    for seed in seeds:
        for word in words:
            records = found.get((seed, word), [])
            if len(records) == expected_ranks and not stopped:
                results[(seed, word)] = merged(records)
                stopped = results[(seed, word)]["outcome"] == "DEFECT: raw error" and start is not None
            else:  # the first job without every rank's record is where the group died or hung
                outcome = "not run" if stopped else "DEFECT: raw error"
                error = None if stopped else f"the group ended ({code}) in this job: {tail[-1500:]}"
                results[(seed, word)] = {"seed": seed, "word": word, "group": group, "outcome": outcome,
                                         "error": error, "backend": backend}
                stopped = True
    return results, seconds
