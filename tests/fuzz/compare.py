"""A word's run against one process's: the worst difference, and the outcome.

The difference of two values is ``|got - want| / max(1, |want|)``: relative for values above 1 (losses, large
weights), absolute below (a weight near 0 has no meaningful relative error). float32 jobs pass within 1e-5: the
equivalence matrix's bound (docs/equivalence.md), ~100 float32 ulps at 1, room for a different summation order
over a few dozen steps, and two orders below what a wrong average, a lost row or a doubled step moves (1e-3 and
up in every defect seen). Mixed precision passes within half an ulp of its 16-bit type at 1 (tests/test_
equivalence.py's FLOAT16_HALF_ULP / BFLOAT16_HALF_ULP).
"""

import math

import numpy as np

TOLERANCES = {"float32": 1e-5, "mixed_float16": 2.0 ** -11, "mixed_bfloat16": 2.0 ** -8}
#: outcomes, worst first (a job's outcome over ranks is the worst any rank saw)
OUTCOMES = ("DEFECT: raw error", "DEFECT: silent", "refused", "invalid", "rounding", "exact")
#: one process's own rounding floor under a 16-bit policy: the same job with XLA's fused kernels (TensorFlow, whose
#: default on CPU is none) or op by op (JAX, whose default is XLA); torch has none cheap enough (torch.compile)
FLOOR_JIT_COMPILE = {"tensorflow": True, "jax": False}


def worst_difference(a, b, where=""):
    """(largest |a - b| / max(1, |b|), where) over two nested results (dicts, lists, arrays, numbers)."""
    if isinstance(a, str):  # the word refused this call with a KerasdistError (predict over JAX processes)
        return 0.0, f"{where} ({a[:60]})"
    if isinstance(b, dict):
        if sorted(a) != sorted(b):
            return float("inf"), f"{where} keys {sorted(a)} != {sorted(b)}"
        return max((worst_difference(a[k], b[k], f"{where}/{k}") for k in b), default=(0.0, where))
    if isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return float("inf"), f"{where} length {len(a)} != {len(b)}"
        return max((worst_difference(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))),
                   default=(0.0, where))
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return float("inf"), f"{where} shape {a.shape} != {b.shape}"
    difference = np.abs(a - b) / np.maximum(1.0, np.abs(b))
    if np.isnan(difference).any():
        return float("inf"), f"{where} (NaN)"
    return float(np.max(difference, initial=0.0)), where


def finite(result):
    """Whether every number in a nested result is finite."""
    if isinstance(result, dict):
        return all(finite(v) for v in result.values())
    if isinstance(result, (list, tuple)):
        return all(finite(v) for v in result)
    return bool(np.all(np.isfinite(np.asarray(result, "float64"))))


def tolerance(job):
    return TOLERANCES[job["policy"]]


def classify(job, reference, got):
    """(outcome, worst, where) of a finished run ``got`` against ``reference``. Under a 16-bit policy an accuracy
    log may differ by one example of the smallest split: a half-ulp difference in a logit flips a near-tie's class
    (seed 2005: 1/45 under multiworker, its weights within half a float16 ulp)."""
    worst, where = worst_difference(got, reference)
    if worst > tolerance(job) and job["policy"] != "float32" and "accuracy" in where:
        counts, count_where = worst_difference(_accuracies(got), _accuracies(reference))
        worst, where = worst_difference(_accuracies(got, False), _accuracies(reference, False))
        if counts > 1.0 / _smallest_split(job) + tolerance(job):
            worst, where = max((worst, where), (counts, count_where))
    return ("exact" if worst <= tolerance(job) else "DEFECT: silent"), worst, where


def _smallest_split(job):
    """The fewest rows an accuracy is a mean over: training's, validation's (data: rows // 3, at least 4; split: a
    quarter of the rows), evaluate's (tests/fuzz/source.py)."""
    rows = job["data"]["rows"]
    return min(rows, job["data"]["eval_rows"], max(4, rows // 3), int(rows * 0.25))


def _accuracies(result, kept=True):
    """``result`` with only (``kept``) or without its accuracy logs."""
    if not isinstance(result, dict):
        return result
    found = {}
    for key, value in result.items():
        if "accuracy" in key:
            if kept:
                found[key] = value
        elif isinstance(value, dict):
            found[key] = _accuracies(value, kept)
        elif not kept:
            found[key] = value
    return found


def worst_outcome(outcomes):
    return min(outcomes, key=OUTCOMES.index)


def figure(worst):
    return "inf" if math.isinf(worst) else f"{worst:.2g}"


def within_rounding(job, worst, checks):
    """A run beyond its tolerance is "rounding" (not a defect) when the checks of worker.rounding_checks show the
    difference comes from where one process rounds, not from what the word computes:

    - its twin with the optimizer's ``epsilon`` at 1e-3 is exact: Adam-like optimizers step by lr x g / (|g| + eps),
      so a gradient that is exactly 0 in one process (MAE's signs cancelling) and 1e-9 in a split sum moves a weight
      by ~1e-4 (seed 4006: 2.4e-5 under every word, 6e-8 with epsilon 1e-3; seed 4002 on JAX: 4.7e-3, 2.6e-4);
    - under a 16-bit policy, its float32 twin is exact and it is no further from one process than one process is
      from itself with other kernels (seed 3009: RMSprop, 8.6e-3; one process with XLA 2.3e-2).
    """
    if checks.get("epsilon_twin") == "exact" and (job["policy"] == "float32" or checks.get("float32_twin") == "exact"):
        return True
    floor = checks.get("floor")
    return (job["policy"] != "float32" and checks.get("float32_twin") == "exact" and floor is not None
            and worst <= floor)
