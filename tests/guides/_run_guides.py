"""Runs several guides in turn in one process, under one or more words, keeping each ``fit``'s weights.

    python tests/guides/_run_guides.py OUTDIR WORD[,WORD...] GUIDE[,GUIDE...]

GUIDE is a guide file's name without ``guide_`` and ``.py`` (``transfer_learning``). Each guide runs as
``__main__`` with GUIDE_DISTRIBUTE=WORD (``none``: no word) in the working
directory OUTDIR/WORD-GUIDE (one folder for every process of a job, as on one machine). Writes
OUTDIR/run-<pid>.json (the fits' histories, epochs, weight paths, the process's rank) and run-<pid>.npz (the
weights: ``WORD/GUIDE/FIT/INDEX``). In a test process, :func:`run_guides` does the same and returns the runs.
"""

import contextlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def guide_path(name):
    return os.path.join(HERE, f"guide_{name}.py")


def rank():
    """This process's rank in a kerasdist launch, horovodrun or torchrun job; None alone."""
    if "TF_CONFIG" in os.environ:
        return json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    for name in ("HOROVOD_RANK", "RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def run_guides(outdir, words, guides, environ=None):
    """Each guide under each word, in turn: ``{(word, guide): {"fits": [...], "error": repr or None}}``; a fit
    keeps its ``weights`` (numpy arrays) and their ``paths``."""
    from _harness import run_in_this_process

    runs = {}
    for word in words:
        for guide in guides:
            workdir = os.path.join(outdir, f"{word}-{guide}")
            os.makedirs(workdir, exist_ok=True)
            fits, started = [], time.monotonic()
            with contextlib.chdir(workdir):
                _, error = run_in_this_process(guide_path(guide), fits, {
                    **(environ or {}), "GUIDE_DISTRIBUTE": "" if word == "none" else word}, keep_weights=True)
            print(f"RUN_GUIDES {word} {guide}: {len(fits)} fits in {time.monotonic() - started:.1f} s"
                  + (f", stopped: {error!r}" if error is not None else ""), flush=True)
            runs[word, guide] = {"fits": fits, "error": None if error is None else repr(error)}
    return runs


def write(outdir, runs):
    import numpy as np

    arrays, described = {}, []
    for (word, guide), run in runs.items():
        fits = []
        for index, fit in enumerate(run["fits"]):
            for number, value in enumerate(fit["weights"]):
                arrays[f"{word}/{guide}/{index}/{number}"] = np.asarray(value)
            fits.append({k: v for k, v in fit.items() if k not in ("weights", "specs")})
        described.append({"word": word, "guide": guide, "fits": fits, "error": run["error"]})
    np.savez(os.path.join(outdir, f"run-{os.getpid()}.npz"), **arrays)
    with open(os.path.join(outdir, f"run-{os.getpid()}.json"), "w") as f:
        json.dump({"rank": rank(), "runs": described}, f)


def read(outdir):
    """Every process's runs, by rank (None: a process alone): ``{rank: {(word, guide): {"fits", "error"}}}``,
    each fit with its ``weights`` back."""
    import numpy as np

    found = {}
    for name in sorted(os.listdir(outdir)):
        if name.startswith("run-") and name.endswith(".json"):
            with open(os.path.join(outdir, name)) as f:
                process = json.load(f)
            with np.load(os.path.join(outdir, name[:-5] + ".npz")) as arrays:
                runs = {}
                for run in process["runs"]:
                    for index, fit in enumerate(run["fits"]):
                        fit["weights"] = [arrays[f"{run['word']}/{run['guide']}/{index}/{number}"]
                                          for number in range(len(fit["paths"]))]
                    runs[run["word"], run["guide"]] = run
            found[process["rank"]] = runs
    return found


if __name__ == "__main__":
    import kerasdist  # noqa: F401  first, as each guide has it: a multi-worker job joins before any TensorFlow op

    out = os.path.abspath(sys.argv[1])
    write(out, run_guides(out, sys.argv[2].split(","), sys.argv[3].split(",")))
