"""Horovod's Keras MNIST example under a real `horovodrun -np 2` on loopback, with kerasdist's
"horovod" strategy (tests/guides/guide_horovod_keras_mnist.py lists every changed line)."""

import os
import sys

import pytest

from tests.guides._harness import read_fits
from tests.helpers import PYTHON, ROOT, child_env, processes_with, run

sys.path.insert(0, os.path.join(ROOT, "tests"))
from runif import HOROVODRUN, run_if  # noqa: E402

pytestmark = [pytest.mark.slow]

HARNESS = os.path.join(ROOT, "tests", "guides", "_harness.py")
GUIDE = os.path.join(ROOT, "tests", "guides", "guide_horovod_keras_mnist.py")


@pytest.mark.timeout(300)
@run_if(horovod=True)
def test_example_trains_on_2_ranks_under_horovodrun(tmp_path):
    out = tmp_path / "fits"
    out.mkdir()
    cmd = [HOROVODRUN, "-np", "2", "--gloo", "-H", "localhost:2", "--network-interfaces", "lo",
           "--gloo-timeout-seconds", "30", PYTHON, HARNESS, str(out), GUIDE]
    try:
        result = run(cmd, timeout=240, env=child_env(TF_CPP_MIN_LOG_LEVEL=3), cwd=str(tmp_path))
    finally:
        left = processes_with(str(out))  # every process of the job has this folder on its command line
        for pid in left:
            os.kill(pid, 9)
    assert not left, f"processes left behind: {left}"
    ranks = read_fits(out)
    assert sorted(r["env"]["HOROVOD_RANK"] for r in ranks) == ["0", "1"]
    assert all(r["env"]["HOROVOD_SIZE"] == "2" for r in ranks)
    histories = []
    for rank in ranks:
        (fit,) = rank["fits"]
        assert fit["epochs"] == [0, 1] and fit["replicas"] == 1  # one replica per process, 2 processes
        histories.append(fit["history"])
    print("Horovod example, per rank:", histories)
    assert histories[0] == histories[1]  # epoch logs averaged over the ranks
    assert histories[0]["loss"][1] < histories[0]["loss"][0] and histories[0]["accuracy"][-1] > 0.5
    assert "each rank takes whole batches of the dataset: a step trains on 2 of its batches" in result.stdout
    # rank 0 only writes checkpoints, into the working directory as the example does
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1.h5", "checkpoint-2.h5", "fits"]
