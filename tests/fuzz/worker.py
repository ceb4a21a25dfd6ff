"""Runs a list of fuzz jobs in this process (one process, or each rank of a launch): for each job its one-process
reference (``distribute=None``, trained in this very process), then the job under each word, compared here.

    python tests/fuzz/worker.py OUT_DIR GROUP WORD[,WORD...] JOBS.json

Every rank appends one JSON line per (job, word) to OUT_DIR/outcomes-GROUP-rank{r}.jsonl: seed, word, outcome
(compare.OUTCOMES), worst difference and where, the error if one was raised, seconds. A job's script is written to
OUT_DIR/scripts/ and run from there (tracebacks name its lines). Ranks of a launch stop after a job with a raw
error (exit 3): the launcher starts the rest again.
"""

import kerasdist  # noqa: I001  first: joins a multi-worker cluster before any framework op

import inspect
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuzz.compare import FLOOR_JIT_COMPILE, classify, finite, within_rounding, worst_difference  # noqa: E402
from fuzz.source import script, word_source  # noqa: E402


def rank():
    cluster = kerasdist.detect_cluster()
    return int(os.environ.get("RANK") or os.environ.get("HOROVOD_RANK") or
               (0 if cluster.is_local else cluster.task_index))


def load(job, out_dir, this_rank, tag=""):
    """The job's script, executed as a module namespace (``train`` and its helpers)."""
    folder = os.path.join(out_dir, "scripts")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"seed{job['seed']}-{job['backend']}-{job['policy']}{tag}-rank{this_rank}.py")
    with open(path, "w") as f:
        f.write(script(job))
    namespace = {"__name__": f"fuzz_seed_{job['seed']}", "__file__": path}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)  # noqa: S102  our own generated script
    return namespace


def error_line(error):
    return f"{type(error).__module__}.{type(error).__name__}: {str(error)[:400]}"


def run_word(namespace, job, word, reference, out_dir, this_rank):
    began = time.monotonic()
    try:
        got = namespace["train"](eval(word_source(word, job), namespace))  # noqa: S307  our own literal
    except kerasdist.KerasdistError as error:
        return {"outcome": "refused", "error": error_line(error), "seconds": time.monotonic() - began}
    except Exception as error:  # noqa: BLE001  a raw error is the finding
        traceback.print_exc()
        return {"outcome": "DEFECT: raw error", "error": error_line(error), "seconds": time.monotonic() - began}
    outcome, worst, where = classify(job, reference, got)
    record = {"outcome": outcome, "worst": worst, "where": where}
    if outcome == "DEFECT: silent":
        record.update(rounding_checks(namespace, job, word, reference, out_dir, this_rank))
        if within_rounding(job, worst, record):
            record["outcome"] = "rounding"
    return {**record, "seconds": time.monotonic() - began}


def rounding_checks(namespace, job, word, reference, out_dir, this_rank):
    """What tells rounding from a defect (compare.within_rounding): under a 16-bit policy one process's own rounding
    floor (the job with other kernels, compared with the reference) and the job's float32 twin under the word; for
    an optimizer with an ``epsilon``, the job's twin with epsilon 1e-3 under the word. Every rank runs them: the ranks
    of a word hold the same weights and logs, so each reaches this point in the same job."""
    import keras

    checks = {"floor": None, "float32_twin": None, "float32_worst": None, "epsilon_twin": None, "epsilon_worst": None}
    if job["policy"] != "float32":
        if job["backend"] in FLOOR_JIT_COMPILE:
            try:
                checks["floor"] = worst_difference(namespace["train"](None, FLOOR_JIT_COMPILE[job["backend"]]),
                                                   reference)[0]
            except Exception as error:  # noqa: BLE001  the model has no XLA kernel: no floor, the difference stays
                print(f"[fuzz] no rounding floor for seed {job['seed']}: {error_line(error)}", flush=True)
        checks["float32_twin"], checks["float32_worst"] = _twin(dict(job, policy="float32"), word, out_dir, this_rank)
    optimizer = job["optimizer"]
    if "epsilon" in inspect.signature(getattr(keras.optimizers, optimizer["name"])).parameters:
        options = dict(optimizer["options"], epsilon=1e-3)
        twin = dict(job, optimizer=dict(optimizer, options=options))
        checks["epsilon_twin"], checks["epsilon_worst"] = _twin(twin, word, out_dir, this_rank, "-epsilon")
    return checks


def _twin(job, word, out_dir, this_rank, tag=""):
    """(outcome, worst difference) of ``job`` under ``word`` against its own one-process run."""
    namespace = load(job, out_dir, this_rank, tag)
    reference = namespace["train"](None)
    try:
        got = namespace["train"](eval(word_source(word, job), namespace))  # noqa: S307  our own literal
    except kerasdist.KerasdistError:
        return "refused", None
    outcome, worst, _ = classify(job, reference, got)
    return outcome, worst


def run_job(job, words, out_dir, this_rank):
    """[one record per word] for ``job``."""
    try:
        namespace = load(job, out_dir, this_rank)
        reference = namespace["train"](None)
        problem = None if finite(reference) else "the one-process run is not finite"
    except Exception as error:  # noqa: BLE001  the draw itself does not train in plain Keras
        traceback.print_exc()
        problem = error_line(error)
    if problem:
        return [{"word": word, "outcome": "invalid", "error": problem} for word in words]
    digest = reference_digest(reference)
    return [{"word": word, "reference": digest, **run_word(namespace, job, word, reference, out_dir, this_rank)}
            for word in words]


def reference_digest(reference):
    """One number for the one-process weights: the same job's reference must be the same in every group of a
    backend (a model compiled without distribute= in a launched worker trains as one plain process)."""
    return float(sum(np.abs(w).sum() for w in reference["weights"]))


def main(out_dir, group, words, jobs_file):
    with open(jobs_file) as f:
        jobs = json.load(f)
    this_rank = rank()
    path = os.path.join(out_dir, f"outcomes-{group}-rank{this_rank}.jsonl")
    for job in jobs:
        records = run_job(job, words.split(","), out_dir, this_rank)
        for record in records:
            record.update(seed=job["seed"], backend=job["backend"], group=group, rank=this_rank)
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[fuzz] {group} rank {this_rank} seed {job['seed']} {record['word']}: {record['outcome']} "
                  f"{record.get('worst', '')} {record.get('error', '')}", flush=True)
        if several_processes() and any(r["outcome"] == "DEFECT: raw error" for r in records):
            # the ranks may have left the job at different collectives: the next job's would pair across jobs
            print(f"[fuzz] {group} rank {this_rank}: stopping after a raw error", flush=True)
            return 3
    return 0


def several_processes():
    return bool(os.environ.get("RANK") or os.environ.get("HOROVOD_RANK")) or not kerasdist.detect_cluster().is_local


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
