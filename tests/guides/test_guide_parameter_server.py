"""TensorFlow's "Parameter server training" tutorial, its Model.fit part, with the tutorial's own in-process
cluster (3 workers, 2 parameter servers), in a child process (tests/guides/guide_parameter_server.py lists
every changed line)."""

import os

import pytest

from tests.guides._harness import read_fits
from tests.helpers import PYTHON, ROOT, child_env, processes_with, run

pytestmark = [pytest.mark.slow]

HARNESS = os.path.join(ROOT, "tests", "guides", "_harness.py")
GUIDE = os.path.join(ROOT, "tests", "guides", "guide_parameter_server.py")


@pytest.mark.timeout(300)
def test_model_fit_part_trains_on_the_in_process_cluster(tmp_path):
    work = tmp_path / "work"
    run([PYTHON, HARNESS, str(tmp_path), GUIDE], timeout=240, env=child_env(GUIDE_WORKDIR=work))
    assert not processes_with(str(tmp_path)), "the coordinator (and its in-process servers) outlived the run"
    (process,) = read_fits(tmp_path)
    (fit,) = process["fits"]
    print("parameter-server tutorial:", fit)
    assert "ParameterServerStrategy" in fit["strategy"]
    # the variables live on the two parameter servers (round-robin), not in the coordinator
    assert fit["variable_devices"] == ["/job:ps/replica:0/task:0/device:CPU:0",
                                       "/job:ps/replica:0/task:1/device:CPU:0"]
    loss = fit["history"]["loss"]
    assert fit["epochs"] == [0, 1, 2, 3, 4] and loss[-1] < loss[0]
    # the tutorial's callbacks did their work: a checkpoint and TensorBoard logs
    assert (work / "ckpt.keras").exists() and os.listdir(work / "log" / "train")
