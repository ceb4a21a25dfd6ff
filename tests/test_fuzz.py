"""The differential fuzzer's short tier (tests/fuzz, docs/fuzzing.md): a fixed list of drawn jobs per word, each
trained with and without the word on the same backend; every run must equal one process's (weights, every epoch's
logs and history, evaluate, predict) or be refused with one KerasdistError. One process start per group of words
(tests/fuzz/groups.py). Seeds that hit a known, still-open defect are strict xfails naming it: they fail once the
defect is fixed, and the seed then moves to the asserted list. ``make fuzz`` is the long tier."""

import importlib.util
import json
import os

import pytest

from fuzz.compare import classify, figure, worst_difference
from fuzz.grammar import draw_job, features
from fuzz.groups import GROUPS, run_group
from fuzz.source import script
from runif import run_if

#: group -> seeds; each seed's job runs under every word of the group, all in one process start. 267: keras.io's
#: lower-level custom step (ops.mean loss, a tracker named total_loss), which took twice one process's step under
#: mirrored (issue 35 item 6) and logged another loss under multiworker (item 7); 21: Embedding over repeated ids
#: + Adagrad (item 1; horovod: a raw 'Mismatched ALLREDUCE tensor shapes' at 03:50, exact at 04:09 after the
#: horovod plugin's log changes); 1000: Conv1D, a nested model, two outputs, Ftrl, a generator, initial_epoch.
#: make test runs one process start per backend and one for multiworker (about 1 minute each on a quiet machine);
#: KERASDIST_FUZZ_ALL_GROUPS=1 adds horovod and JAX over 2 processes (the long tier, ``make fuzz``, runs every group).
SEEDS = {
    "tf_local": [267],
    "tf_multiworker": [21],
    "jax_local": [1000],
    "torch": [1000],
}
if os.environ.get("KERASDIST_FUZZ_ALL_GROUPS") == "1":
    SEEDS.update({"tf_multiworker": [21, 267], "tf_horovod": [21], "jax_processes": [1000]})
#: (group, seed, word) -> the open defect the seed hits (strict xfail: the test fails once it is exact)
KNOWN = {}
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _gated():
    """Carries run_if(horovod=True)'s marks for the horovod group's parameters."""


HOROVOD_MARKS = run_if(horovod=True)(_gated).pytestmark


def marks(group, seed, word):
    found = [pytest.mark.slow]
    if (group, seed, word) in KNOWN:
        found.append(pytest.mark.xfail(reason=KNOWN[(group, seed, word)], strict=True))
    if group == "tf_horovod":
        found += HOROVOD_MARKS
    if GROUPS[group][0] == "torch":
        found.append(pytest.mark.skipif(not HAS_TORCH, reason="needs torch (pip install 'kerasdist[torch]')"))
    return found


CASES = [pytest.param(group, seed, word, id=f"{group}-{word}-seed{seed}", marks=marks(group, seed, word))
         for group, seeds in SEEDS.items() for seed in seeds for word in GROUPS[group][1]]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """group -> {(seed, word): record}, each group run once, on first use."""
    ran = {}

    def of(group):
        if group not in ran:
            ran[group], seconds = run_group(group, SEEDS[group], str(tmp_path_factory.mktemp(group)))
            print(f"{group}: {len(SEEDS[group])} jobs in {seconds:.0f} s")
        return ran[group]

    return of


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group, seed, word", CASES)
def test_a_drawn_job_trains_as_one_process_or_is_refused(group, seed, word, outcomes):
    record = outcomes(group)[(seed, word)]
    detail = record.get("error") or f"{figure(record['worst'])} at {record['where']}"
    print(f"seed {seed} {group}:{word}: {record['outcome']} ({detail})")
    assert record["outcome"] in ("exact", "rounding", "refused"), (
        f"seed {seed} {group}:{word}: {record['outcome']}: {detail}\n"
        f"reproduce: FUZZ_SEED={seed} FUZZ_GROUPS={group} FUZZ_CHUNK=1 FUZZ_MINUTES=0.1 make fuzz")


@pytest.mark.slow
@pytest.mark.skipif("jax_processes" not in SEEDS, reason="runs with KERASDIST_FUZZ_ALL_GROUPS=1 (JAX over 2 processes)")
@pytest.mark.timeout(600)
def test_a_launched_worker_without_a_word_trains_as_one_process(outcomes):
    """The references of a launch (distribute=None in each rank) equal one plain process's: the same seed's
    reference digest in jax_processes' ranks as in jax_local's single process."""
    local, launched = outcomes("jax_local")[(1000, "hybrid")], outcomes("jax_processes")[(1000, "data_parallel")]
    assert abs(local["reference"] - launched["reference"]) <= 1e-6 * local["reference"], (local, launched)


def test_a_draw_is_data_the_same_for_a_seed():
    job = draw_job(12345, "torch")
    assert json.loads(json.dumps(job)) == job == draw_job(12345, "torch")
    assert draw_job(12346, "torch") != job


def test_every_drawn_job_is_a_script_that_compiles():
    for seed in range(150):
        for backend in ("tensorflow", "jax", "torch"):
            job = draw_job(seed, backend)
            compile(script(job, "mirrored"), f"seed{seed}-{backend}", "exec")
            assert features(job)


def test_the_grammar_reaches_every_layer_optimizer_and_input_kind():
    drawn = set()
    for seed in range(400):
        drawn.update(features(draw_job(seed)))
    for wanted in ("trunk:embedding", "trunk:conv1d", "trunk:conv2d", "trunk:rnn/LSTM", "trunk:rnn/GRU",
                   "trunk:attention", "norm:batch", "norm:layer", "model:shared", "model:nested", "model:frozen",
                   "lora:dense", "lora:embedding", "optimizer:Muon", "optimizer:Ftrl", "input:dataloader",
                   "input:generator", "input:py_dataset", "input:tf_data", "step:custom", "option:loss_scale",
                   "option:use_ema", "option:gradient_accumulation_steps", "weights:class_weight",
                   "fit:validation_split", "fit:initial_epoch", "callback:ModelCheckpoint", "policy:mixed_float16"):
        assert wanted in drawn, wanted


def test_the_difference_is_relative_above_one_and_names_where():
    assert worst_difference({"w": [1.0, 200.0]}, {"w": [1.0, 100.0]}) == (1.0, "/w[1]")
    assert worst_difference([0.5], [0.25]) == (0.25, "[0]")
    assert worst_difference({"loss": [1]}, {"loss": [1], "val_loss": [1]})[0] == float("inf")
    assert worst_difference({"p": "refused: predict ..."}, {"p": {"out": [1.0], "aux": [2.0]}})[0] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not HAS_TORCH, reason="needs torch (pip install 'kerasdist[torch]')")
def test_seed_2002_attention_under_fsdp_trains_or_names_the_uneven_batch(tmp_path):
    """Seed 2002 (MultiHeadAttention, mixed_bfloat16, batches of 6 with 5-row last ones) under torch fsdp: a raw
    NotImplementedError from DTensor at the first step (no sharding strategy for CPU flash attention's backward).
    Attention now runs as plain ops, and the first batch whose rows do not divide over the ranks (an EinsumDense
    reshapes them, which DTensor cannot do unevenly: its raw 'Cannot flatten unevenly sharded tensor') is one
    KerasdistError naming its rows and the fix, in every rank."""
    from helpers import PYTHON, child_env, run

    path = tmp_path / "seed2002.py"
    path.write_text(script(draw_job(2002, "torch"), "fsdp"))
    launcher = os.path.join(os.path.dirname(PYTHON), "kerasdist")
    result = run([launcher, "launch", "-n", "2", "--join-timeout", "60", str(path), "fsdp"], timeout=360,
                 env=child_env(KERAS_BACKEND="torch"), check=False)
    output = result.stdout
    assert result.returncode != 0, output[-3000:]
    assert "NotImplementedError" not in output, output[-3000:]
    assert "KerasdistError" in output and "cannot run this model on a batch of 5 rows over 2 ranks" in output, \
        output[-3000:]


def test_a_16_bit_accuracy_may_differ_by_one_example_and_nothing_else():
    job = {"policy": "mixed_float16", "data": {"rows": 45, "eval_rows": 18}}
    want = {"weights": [[1.0]], "history": {"loss": [1.0], "accuracy": [0.5]}, "evaluate": {"accuracy": 0.5}}
    one_flip = {"weights": [[1.0001]], "history": {"loss": [1.0], "accuracy": [0.5 + 1 / 45]}, "evaluate": {"accuracy": 0.5}}
    assert classify(job, want, one_flip)[0] == "exact"
    assert classify(dict(job, policy="float32"), want, one_flip)[0] == "DEFECT: silent"
    assert classify(job, want, dict(one_flip, weights=[[1.01]]))[:2] == ("DEFECT: silent", pytest.approx(0.01))
    assert classify(job, want, dict(one_flip, history={"loss": [1.0], "accuracy": [0.6]}))[0] == "DEFECT: silent"


def test_a_difference_beyond_its_tolerance_is_rounding_only_where_its_twins_say_so():
    """Seed 3009 (mixed_bfloat16, RMSprop): every TF word 8.6e-3 from one process at predict, its float32 twin
    1.2e-6, one process with XLA's kernels 2.3e-2 from itself: rounding. Seed 4006 (float32, AdamW, MAE): 2.4e-5,
    with epsilon 1e-3 6e-8: rounding. A float32 twin or an epsilon twin that differs, a difference above the floor,
    or a float32 job without an exact epsilon twin stays a defect."""
    from fuzz.compare import within_rounding

    bf16, f32 = {"policy": "mixed_bfloat16"}, {"policy": "float32"}
    assert within_rounding(bf16, 8.6e-3, {"floor": 2.3e-2, "float32_twin": "exact"})
    assert not within_rounding(bf16, 8.6e-3, {"floor": 2.3e-2, "float32_twin": "DEFECT: silent"})
    assert not within_rounding(bf16, 8.6e-3, {"floor": 1e-3, "float32_twin": "exact"})
    assert not within_rounding(bf16, 8.6e-3, {"floor": None, "float32_twin": "exact"})  # torch: no floor measured
    assert within_rounding(bf16, 4.7e-3, {"floor": 7e-4, "float32_twin": "exact", "epsilon_twin": "exact"})
    assert not within_rounding(bf16, 4.7e-3, {"floor": 7e-4, "float32_twin": "DEFECT: silent", "epsilon_twin": "exact"})
    assert within_rounding(f32, 2.4e-5, {"epsilon_twin": "exact"})
    assert not within_rounding(f32, 2.4e-5, {"epsilon_twin": "DEFECT: silent"})
    assert not within_rounding(f32, 2.4e-5, {"epsilon_twin": None})  # SGD: no epsilon
    assert not within_rounding(f32, 8.6e-3, {"floor": 2.3e-2, "float32_twin": "exact"})
