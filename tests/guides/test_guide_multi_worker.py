"""TensorFlow's "Multi-worker training with Keras" on 2 workers on 127.0.0.1: once under
`kerasdist launch -n 2`, once with TF_CONFIG set by hand in 2 processes (tests/guides/guide_multi_worker_main.py
and mnist_setup.py list every changed line)."""

import json
import os
import sys
import uuid

import pytest

from tests.guides._harness import read_fits
from tests.helpers import PYTHON, ROOT, child_env, finish, free_port, processes_with, run, start

pytestmark = [pytest.mark.slow]

HERE = os.path.join(ROOT, "tests", "guides")
HARNESS = os.path.join(HERE, "_harness.py")
MAIN = os.path.join(HERE, "guide_multi_worker_main.py")
KERASDIST = os.path.join(os.path.dirname(sys.executable), "kerasdist")


def _check(outdir, backup_dir, token):
    left = processes_with(token)
    assert not left, f"processes left behind: {left}"
    workers = read_fits(outdir)
    assert len(workers) == 2, workers
    indexes = sorted(json.loads(w["env"]["TF_CONFIG"])["task"]["index"] for w in workers)
    assert indexes == [0, 1]
    histories = []
    for worker in workers:
        (fit,) = worker["fits"]
        # the default, strategy-free on CPU workers: plain Keras per worker, one replica each, the ring between them
        assert (fit["strategy"], fit["replicas"]) == ("_DefaultDistributionStrategy", 1), fit
        assert fit["epochs"] == [0, 1, 2]
        histories.append(fit["history"])
    print("multi-worker tutorial, per worker:", histories)
    loss = histories[0]["loss"]
    assert histories[0] == histories[1]  # one model: the logs are averaged over the workers
    assert loss[2] < loss[1] < loss[0]  # SGD(0.001), 210 steps: slow but steady, as in the tutorial
    assert not os.path.exists(backup_dir) or os.listdir(backup_dir) == []  # removed when fit completes


@pytest.mark.timeout(300)
def test_tutorial_under_kerasdist_launch(tmp_path):
    token = f"kerasdist-guide-{uuid.uuid4().hex}"
    backup = tmp_path / "backup"
    env = child_env(GUIDE_BACKUP_DIR=backup)
    run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", HARNESS, str(tmp_path), MAIN, token],
        timeout=240, env=env)
    _check(tmp_path, str(backup), token)


@pytest.mark.timeout(300)
def test_tutorial_with_tf_config_set_by_hand(tmp_path):
    token = f"kerasdist-guide-{uuid.uuid4().hex}"
    backup = tmp_path / "backup"
    cluster = {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    procs = [start([PYTHON, HARNESS, str(tmp_path), MAIN, token], GUIDE_BACKUP_DIR=backup, KERASDIST_JOIN_TIMEOUT=60,
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
             for i in range(2)]
    for code, output in finish(procs, timeout=240):
        assert code == 0, output[-4000:]
    _check(tmp_path, str(backup), token)
