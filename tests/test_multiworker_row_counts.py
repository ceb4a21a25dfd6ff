"""Uneven batches over the TCP ring on MultiWorkerMirroredStrategy's step (KERASDIST_STRATEGY_FREE=off; the
strategy-free default sends the rows with the gradients): each worker's row count travels over the ring (not a TensorFlow collective,
which costs ~1 ms CPU per step more at small batches; issue 22), and training still equals one process."""

import os
import sys

import pytest

from tests.helpers import ROOT, child_env, max_diff, python, run, weights

KERASDIST = os.path.join(os.path.dirname(sys.executable), "kerasdist")
COUNTING_WORKER = os.path.join(ROOT, "tests", "workers", "mw_row_counts.py")
TRAIN = os.path.join(ROOT, "tests", "workers", "mw_train.py")


@pytest.mark.timeout(240)
def test_uneven_dataset_batches_count_rows_over_the_ring_and_equal_one_process(tmp_path):
    # 37 examples in global batches of 8 (a dynamic batch dimension): the last batch splits 3 / 2
    common = ["--dataset", "--epochs", "2", "--examples", "37", "--batch", "8"]
    result = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", "--communication", "tcp", COUNTING_WORKER,
                  *common, "--out", str(tmp_path / "mw")], timeout=180, env=child_env(KERASDIST_STRATEGY_FREE="off"))
    run(python(TRAIN, *common, "--distribute", "none", "--out", str(tmp_path / "single")), timeout=120)
    counts = {line.split()[0]: int(line.split()[-1]) for line in result.stdout.splitlines()
              if "ROW_COUNTS_OVER_RING" in line}
    assert sorted(counts) == ["[0]", "[1]"] and min(counts.values()) >= 1, result.stdout[-3000:]
    w0, w1, single = weights(tmp_path / "mw", 0), weights(tmp_path / "mw", 1), weights(tmp_path / "single", 0)
    assert max_diff(w0, w1) == 0.0
    assert max_diff(w0, single) <= 1e-5
