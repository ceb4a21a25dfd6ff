"""Quantization-aware training and export over several processes (issue 36), on the digits net of
tests/workers/qat_digits.py (tests/workers/export_backends.py --ranks): 3 float epochs, then 2 with
``quantize()``, under ``kerasdist launch -n 2`` on torch (data_parallel, data_parallel with synchronized
BatchNormalization, fsdp) and JAX (data_parallel, one device a process), each against one process trained on the
same global batches. Every rank calls ``kerasdist.export`` with the same path (as a torch script calls a checkpoint
save): rank 0 writes the file, every rank gets rank 0's result (or its error).

Checked: both ranks hold the same weights and int8 ranges, bit for bit (BatchNormalization's moving statistics
aside where each rank normalizes its own rows: torch data_parallel without ``sync_batch_norm``); the same as one
process (max |Δ| bounds below); the QAT int8 ONNX file (no representative data) in onnxruntime within 0.5 point
of the float model; the float ONNX file within 1e-4 of Keras. All marked ``extended`` (``make test-extended``):
about 13 minutes of 2 shared cores (torch 1 + 2 processes about 5, JAX about 8).
"""

import glob
import importlib.util
import json
import os

import numpy as np
import pytest

from helpers import ROOT, child_env, python, run

WORKER = os.path.join(ROOT, "tests", "workers", "export_backends.py")
KERASDIST = os.path.join(os.path.dirname(python()[0]), "kerasdist")
TIMEOUT = 900
TORCH_WORDS = ["data_parallel", "data_parallel_sync", "fsdp"]
#: max |w - w_one_process| over every weight and range after 3 float and 2 QAT epochs. Measured: the float phase is
#: within 1.2e-5 (torch, sync_batch_norm) and 4.8e-6 (JAX) of one process, but the QAT phase ends 4.4e-3 and 9.1e-3
#: away (ranges 2.7e-3, 3.1e-3), the ranks bit-equal. One process does as much to itself: its 2 QAT epochs from the
#: same float weights changed by 1e-6 end 6.3e-3 (torch) / 1.4e-2 (JAX) away, its 2 float epochs 6.8e-6 / 1.3e-6
#: (tests/workers/qat_sensitivity.py): fake quantization's int8 rounding makes last-digit differences whole steps
BOUND = 0.02

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(2 * TIMEOUT)]


def _needs(backend):
    if importlib.util.find_spec(backend) is None or importlib.util.find_spec("onnxruntime") is None:
        pytest.skip(f"needs {backend} and onnxruntime (make test installs them)")


def _env(backend):
    if backend == "jax":
        return child_env(KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return child_env(KERAS_BACKEND="torch", OMP_NUM_THREADS="1")


def _run(tmp_path_factory, backend, processes, words):
    _needs(backend)
    out = str(tmp_path_factory.mktemp(f"{backend}{processes}") / "r")
    command = [KERASDIST, "launch", "-n", "2", "--", WORKER] if processes == 2 else python(WORKER)
    result = run([*command, "--ranks", out, *words], timeout=TIMEOUT, env=_env(backend), check=False)
    return {"out": out, "output": result.stdout}


@pytest.fixture(scope="module")
def torch_one(tmp_path_factory):
    return _run(tmp_path_factory, "torch", 1, ["one"])


@pytest.fixture(scope="module")
def torch_two(tmp_path_factory):
    return _run(tmp_path_factory, "torch", 2, TORCH_WORDS)


@pytest.fixture(scope="module")
def jax_one(tmp_path_factory):
    return _run(tmp_path_factory, "jax", 1, ["one"])


@pytest.fixture(scope="module")
def jax_two(tmp_path_factory):
    return _run(tmp_path_factory, "jax", 2, ["data_parallel"])


def _rank(runs, word, rank):
    """(float weights, QAT weights, figures) that ``rank`` wrote for ``word``."""
    errors = [open(p).read() for p in sorted(glob.glob(f"{runs['out']}-{word}.error-rank*.txt"))]
    assert not errors, f"{word}: {errors}\n{runs['output'][-5000:]}"
    name = f"{runs['out']}-{word}-rank{rank}"
    assert os.path.exists(name + ".json"), f"{word}: no results of rank {rank}\n{runs['output'][-5000:]}"
    with np.load(name + ".npz") as saved:
        weights = tuple([saved[f"{kind}{i}"] for i in range(sum(k.startswith(kind) for k in saved.files))]
                        for kind in ("float", "qat"))
    with open(name + ".json") as f:
        return (*weights, json.load(f))


def _max_diff(a, b, skip=()):
    return max(float(np.max(np.abs(x - y))) for i, (x, y) in enumerate(zip(a, b)) if i not in skip)


def _check(two, one, word, one_process_bound, local_batch_norm=False):
    ranks = [_rank(two, word, r) for r in (0, 1)]
    reference = _rank(one, "one", 0)
    (float0, qat0, info0), (float1, qat1, info1) = ranks
    # the variables that depend on each rank's own rows: BatchNormalization's moving mean and variance
    local = {i for i, w in enumerate(qat0) if local_batch_norm and w.ndim == 1 and not np.array_equal(w, qat1[i])}
    assert len(qat0) == len(qat1) == len(reference[1])
    assert all(np.array_equal(a, b) for i, (a, b) in enumerate(zip(qat0, qat1)) if i not in local), word
    ranges = [i for i, w in enumerate(qat0) if w.ndim == 0]  # the QAT ranges: scalars
    assert len(ranges) == 10 and not local & set(ranges), (word, ranges, local)  # 5 (min, max) pairs
    one_process = _max_diff(qat0, reference[1], skip=local)
    range_diff = _max_diff([qat0[i] for i in ranges], [reference[1][i] for i in ranges])
    print(f"{word}: ranks equal ({len(local)} local BatchNormalization statistics); QAT weights vs one process "
          f"max |Δ| {one_process:.3g}, ranges {range_diff:.3g}; float {info0['float']:.4f}, float ONNX max |Δ logit| "
          f"{info0['float_onnx']['max_abs_diff']:.3g}, QAT Keras {info0['qat_keras']:.4f}, QAT int8 ONNX "
          f"{info0['qat_onnx']['accuracy']:.4f} ({info0['qat_onnx']['quantize_linear']} Q/DQ pairs); "
          f"{info0['seconds']:.0f} s")
    assert one_process <= one_process_bound, (word, one_process)
    for info in (info0, info1):  # every rank returns rank 0's result, for the one file rank 0 wrote
        for kind in ("float_onnx", "qat_onnx"):
            assert info[kind] == info0[kind], (word, kind, info[kind], info0[kind])
        assert info["error_in_every_rank"] and "does not exist" in info["error_in_every_rank"], info
    assert info0["float_onnx"]["max_abs_diff"] <= 1e-4 and info0["float_onnx"]["agreement"] == 1.0
    assert info0["float_onnx"]["accuracy"] == info0["float"]
    qat = info0["qat_onnx"]
    assert qat["quantize_linear"] > 0 and qat["dequantize_linear"] > 0
    assert qat["accuracy"] >= info0["float"] - 0.005, info0  # within 0.5 pt of the float model, or better
    assert abs(qat["accuracy"] - info0["qat_keras"]) <= 0.005 and qat["agreement"] >= 0.98, info0
    assert "rank 0" in info1["error_in_every_rank"], info1["error_in_every_rank"]


@pytest.mark.parametrize("word, bound, local_batch_norm", [
    ("data_parallel_sync", BOUND, False),  # BatchNormalization over the global batch: one process's training
    ("data_parallel", None, True),  # each rank's BatchNormalization normalizes its own rows: not one process
    # fsdp has no sync_batch_norm: BatchNormalization's batch statistics are each rank's. Its run passed once and once
    # lost rank 1 to a SIGSEGV in gloo's pt_gloo_runloop thread (in libc, during a DTensor redistribute in backward,
    # 2026-11-29, not investigated yet): non-strict xfail until it is
    pytest.param("fsdp", None, False, marks=pytest.mark.xfail(strict=False, reason="gloo SIGSEGV seen 1 in 2 runs")),
])
def test_torch_2_ranks_learn_one_set_of_ranges_and_export_int8_onnx(torch_two, torch_one, word, bound,
                                                                     local_batch_norm):
    _check(torch_two, torch_one, word, float("inf") if bound is None else bound, local_batch_norm)


def test_jax_2_processes_learn_one_set_of_ranges_and_export_int8_onnx(jax_two, jax_one):
    _check(jax_two, jax_one, "data_parallel", BOUND)  # JAX normalizes over the global batch
