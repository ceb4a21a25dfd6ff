"""Elastic training (kerasdist_plugins.horovod.run_elastic) under a real
`horovodrun --gloo --min-np 1 --max-np 2 --host-discovery-script` job on loopback.

One job goes through every kind of world change: a host removed (discovery), a host added back (a
new worker process joins), and a worker killed (SIGKILL, in the middle of an epoch). Loopback has
two names, ``localhost`` and ``127.0.0.1``, one slot each, because Horovod blacklists the whole host
of a failed worker.
"""

import json
import os
import sys
import time
import uuid

import numpy as np
import pytest

from helpers import PYTHON, ROOT, child_env, run

sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
import hvd_common as common  # noqa: E402

from kerasdist_plugins import horovod as plugin  # noqa: E402
from test_horovod import HOROVODRUN, needs_horovod, processes_with  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "hvd_elastic.py")
#: Rank 0's plan: remove the second host after epoch 2, add it back after epoch 4, kill its worker in
#: the middle of epoch 6. Epochs (1-based) run on: 1-2: 2 workers, 3-4: 1, 5: 2, 6 (again)-7: 1.
PLAN = "2:hosts=1,4:hosts=2,6:kill"
SIZES = {1: 2, 2: 2, 3: 1, 4: 1, 5: 2, 6: 1, 7: 1}


@pytest.fixture(scope="module")
def elastic_job(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("hvd_elastic")
    hosts = outdir / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discovery = outdir / "discover.sh"
    discovery.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discovery.chmod(0o755)
    token = f"kerasdist-test-{uuid.uuid4().hex}"
    cmd = [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2", "--gloo",
           "--host-discovery-script", str(discovery), "--network-interfaces", "lo",
           "--gloo-timeout-seconds", "20", "--elastic-timeout", "30",
           PYTHON, WORKER, str(outdir), str(hosts), PLAN, token]
    start = time.monotonic()
    try:
        result = run(cmd, timeout=100, env=child_env(TF_CPP_MIN_LOG_LEVEL=3), check=False)
    finally:
        left = processes_with(token)
        for pid in left:
            os.kill(pid, 9)
    assert not left, f"processes left behind: {left}"
    assert result.returncode == 0, result.stdout[-6000:]
    events = [json.loads(line) for line in (outdir / "events.jsonl").read_text().splitlines()]
    for event in events:
        event["weights"] = np.array(event["weights"])
    return events, time.monotonic() - start


def reference_epoch_weights():
    """Plain Keras, one process: each epoch on the global batch of the world size it ran with."""
    import keras

    x, y = common.data(batches=8)
    model = common.build_model()
    model.set_weights(common.initial_weights(0))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    weights = {}
    for epoch, size in SIZES.items():
        model.fit(x, y, batch_size=size * common.BATCH, initial_epoch=epoch - 1, epochs=epoch,
                  shuffle=False, verbose=0)
        weights[epoch] = np.concatenate([np.ravel(w) for w in model.get_weights()])
    return weights


@pytest.mark.timeout(150)
@pytest.mark.slow
@needs_horovod
def test_training_continues_through_removed_added_and_killed_workers(elastic_job):
    events, seconds = elastic_job
    ends = [e for e in events if e["event"] == "epoch_end" and e["rank"] == 0]
    # Every epoch ran on the expected number of workers; epoch 6 twice (interrupted by the kill).
    assert [(e["epoch"], e["size"]) for e in ends] == [(1, 2), (2, 2), (3, 1), (4, 1), (5, 2), (6, 1), (7, 1)]
    assert [e["steps"] for e in ends] == [4, 4, 8, 8, 4, 8, 8]  # data re-sharded for each world size

    # Each (re)start of fit begins at the committed epoch with the committed weights, on every worker.
    begins = [e for e in events if e["event"] == "train_begin"]
    committed = {e["epoch"]: e["weights"] for e in ends}
    committed[0] = np.concatenate([np.ravel(w) for w in common.initial_weights(0)])
    assert sorted({(e["epoch"], e["size"]) for e in begins}) == [(0, 2), (2, 1), (4, 2), (5, 1)]
    for begin in begins:
        np.testing.assert_array_equal(begin["weights"], committed[begin["epoch"]])
    # The worker that joined after epoch 4 started from other weights and got rank 0's (and its momentum).
    joined = [e for e in events if e["event"] == "start" and e["pid"] not in
              {b["pid"] for b in begins if b["epoch"] == 0}]
    assert len(joined) == 1
    assert np.abs(joined[0]["weights"] - committed[4]).max() > 1e-2
    joined_begin = [b for b in begins if b["pid"] == joined[0]["pid"]]
    rank0_begin = [b for b in begins if b["rank"] == 0 and b["epoch"] == 4]
    np.testing.assert_array_equal(joined_begin[0]["optimizer"], rank0_begin[0]["optimizer"])

    # The kill came mid-epoch 6: the uncommitted steps were rolled back, not kept.
    kill = [e for e in events if e["event"] == "kill"]
    assert len(kill) == 1 and np.abs(kill[0]["weights"] - committed[5]).max() > 1e-4

    # Workers agree at every epoch, and the whole run equals single-process training on the global batch.
    for e in events:
        if e["event"] == "epoch_end" and e["rank"] != 0:
            np.testing.assert_array_equal(e["weights"], committed[e["epoch"]])
    reference = reference_epoch_weights()
    for epoch, weights in reference.items():
        assert np.abs(committed[epoch] - weights).max() <= 1e-4, epoch
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == 1 and done[0]["epoch"] == 7
    np.testing.assert_array_equal(done[0]["weights"], committed[7])
    print(f"elastic job: {seconds:.1f} s")


def test_run_elastic_needs_a_horovod_compiled_model():
    import kerasdist

    model = common.build_model()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(kerasdist.KerasdistError, match="compile the model with distribute='horovod' first"):
        plugin.run_elastic(model, np.zeros((4, common.FEATURES)), np.zeros((4, common.CLASSES)))
