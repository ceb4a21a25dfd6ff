"""Jobs the differential fuzzer found under the TensorFlow words (seeds 2001, 2002, 2007: per-output loss logs; 2005:
a clipped sparse gradient, synchronized batch statistics over an uneven batch; 2000, 2003, 2004: a custom step under
MultiWorkerMirroredStrategy's step, Muon under central_storage; 4002: Nadam under central_storage, an Embedding's
gradient under a LossScaleOptimizer on MultiWorkerMirroredStrategy's step), each equal to one
process now (tests/workers/tf_word_findings.py has each job and its figure before). One process start per word's
launcher; multiworker's two launches and horovod's are in the extended tier (MultiWorkerMirroredStrategy's step runs mirrored's
replica-context code; the strategy-free step's change is its metric watch counting ``sample_weight=None`` as none)."""

import os

import pytest

from helpers import PYTHON, ROOT, child_env, run
from runif import HOROVODRUN, run_if

pytestmark = [pytest.mark.slow]

SCRIPT = os.path.join(ROOT, "tests", "workers", "tf_word_findings.py")
KERASDIST = os.path.join(os.path.dirname(PYTHON), "kerasdist")
CASES = ("output-losses", "sparse-clip", "sync-bn", "own-step", "muon", "nadam", "sparse-loss-scale",
         "sparse-loss-scale-uneven")
#: jobs of one step only (tests/workers/tf_word_findings.py)
ONLY_UNDER = {"sparse-loss-scale": ("multiworker", "horovod"), "sparse-loss-scale-uneven": ("multiworker", "horovod")}
#: the worst relative difference allowed: float32 jobs 1e-6, the mixed_float16 ones half a float16 ulp
TOLERANCE = {"sparse-loss-scale": 2.0 ** -11, "sparse-loss-scale-uneven": 2.0 ** -11}


def _check(output, words, ranks, refused=()):
    found = {}
    for line in output.splitlines():
        _, _, rest = line.partition("CASE ")
        if rest:
            case, word, worst, where = rest.split()
            found.setdefault((case, word), []).append((float(worst), where))
    for word in words:
        for case in (c for c in CASES if word in ONLY_UNDER.get(c, (word,))):
            assert len(found.get((case, word), [])) == ranks, (case, word, output[-3000:])
            for worst, where in found[(case, word)]:
                if case in refused:
                    assert where == "refused", f"{case} under {word}: trained ({worst} at {where}), not refused"
                    assert "cannot yet train under mixed_float16" in output and "strategy-free step" in output, \
                        output[-3000:]
                    continue
                assert worst <= TOLERANCE.get(case, 1e-6), f"{case} under {word}: {worst} at {where}"


def _env(**extra):
    return child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", **extra)


@pytest.mark.timeout(300)
def test_replicas_of_one_process_train_and_log_as_one_process():
    output = run([PYTHON, SCRIPT, "mirrored,central_storage"], timeout=240, env=_env(KERASDIST_CPU_REPLICAS="2"))
    _check(output.stdout, ["mirrored", "central_storage"], 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy_free", ["on", "off"])
def test_multiworker_trains_and_logs_as_one_process(strategy_free):
    output = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", SCRIPT, "multiworker"], timeout=240,
                 env=_env(KERASDIST_STRATEGY_FREE=strategy_free, OMP_NUM_THREADS="1"))
    # MultiWorkerMirroredStrategy's step refuses mixed_float16 on uneven shares (seed 4002)
    _check(output.stdout, ["multiworker"], 2, refused=("sparse-loss-scale-uneven",) if strategy_free == "off" else ())


@run_if(horovod=True)
@pytest.mark.timeout(300)
def test_horovod_trains_and_logs_as_one_process():
    output = run([HOROVODRUN, "-np", "2", "--gloo", "-H", "localhost:2", "--network-interfaces", "lo",
                  "--gloo-timeout-seconds", "60", PYTHON, SCRIPT, "horovod"], timeout=240,
                 env=_env(OMP_NUM_THREADS="1"))
    _check(output.stdout, ["horovod"], 2)
