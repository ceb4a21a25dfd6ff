"""distribute="ps": real ps/worker gRPC servers on 127.0.0.1, a real coordinator, and the errors.

The slow tests start every task as its own process (ps/worker servers, then the coordinator script
tests/workers/ps_train.py) and kill every process group at the end.
"""

import json
import os
import subprocess
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist
import kerasdist_plugins.ps as ps_plugin
from kerasdist_plugins.ps import data as ps_data
from kerasdist_plugins.ps import server as ps_server
from tests.helpers import PYTHON, ROOT, child_env, free_port, kill_group, run

SERVER = os.path.join(ROOT, "tests", "workers", "ps_server.py")
TRAIN = os.path.join(ROOT, "tests", "workers", "ps_train.py")


def _model():
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])


def _addresses(count):
    return [f"127.0.0.1:{free_port()}" for _ in range(count)]


# -- registration, auto, cluster errors (no servers) -------------------------------------------------

def test_registered_with_aliases():
    row = next(r for r in kerasdist.list_plugins() if r["name"] == "ps")
    assert row["kind"] == "strategy" and row["available"] is True
    assert "parameter_server" in row["aliases"]
    assert isinstance(kerasdist.spec("parameter-server", workers=["h:1"]), ps_plugin.PS)


def test_auto_picks_ps_for_the_coordinator_of_a_cluster_with_parameter_servers():
    jobs = {"chief": ["h0:1"], "worker": ["h1:1"], "ps": ["h2:1"]}
    auto = ps_plugin.kerasdist_auto_strategy
    assert auto(kerasdist.ClusterInfo("chief", 0, jobs, source="tf_config")) == "ps"
    assert auto(kerasdist.ClusterInfo("worker", 0, jobs, source="tf_config")) is None  # serves only
    assert auto(kerasdist.ClusterInfo("worker", 0, {"worker": ["h1:1", "h2:1"]}, source="tf_config")) is None
    assert auto(kerasdist.ClusterInfo.local()) is None


def test_no_parameter_servers_is_a_clear_error():
    with pytest.raises(kerasdist.ClusterConfigError, match="needs a cluster with parameter servers") as info:
        _model().compile(loss="mse", distribute="ps")
    assert "kerasdist.ps(workers=" in str(info.value) and "TF_CONFIG" in str(info.value)
    with pytest.raises(kerasdist.ClusterConfigError, match="has none"):
        _model().compile(loss="mse", distribute=kerasdist.ps(workers=_addresses(1)))
    with pytest.raises(kerasdist.ClusterConfigError, match="at least one worker"):
        _model().compile(loss="mse", distribute=kerasdist.ps(ps=_addresses(1)))


@pytest.mark.parametrize("bad", ["nohost", "h:port", "h:0", ":2222"])
def test_bad_address_is_named(bad):
    with pytest.raises(kerasdist.ClusterConfigError, match="is not 'host:port'") as info:
        _model().compile(loss="mse", distribute=kerasdist.ps(workers=[bad], ps=_addresses(1)))
    assert repr(bad) in str(info.value)


def test_resolver_without_ps_and_bad_timeout_are_refused():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": _addresses(2)}))
    with pytest.raises(kerasdist.ClusterConfigError, match="cluster_resolver=SimpleClusterResolver has none"):
        _model().compile(loss="mse", distribute=kerasdist.ps(cluster_resolver=resolver))
    with pytest.raises(kerasdist.ClusterConfigError, match="not a tf.distribute.cluster_resolver"):
        _model().compile(loss="mse", distribute=kerasdist.ps(cluster_resolver="grpc://h:1"))
    with pytest.raises(kerasdist.KerasdistError, match="connect_timeout=0"):
        _model().compile(loss="mse", distribute=kerasdist.ps(workers=_addresses(1), ps=_addresses(1),
                                                            connect_timeout=0))


def test_a_ps_or_worker_task_running_the_training_script_is_told_to_serve():
    cluster = kerasdist.ClusterInfo("worker", 1, {"worker": ["h:1", "h:2"], "ps": ["h:3"]}, source="tf_config")
    with pytest.raises(kerasdist.ClusterConfigError, match="python -m kerasdist_plugins.ps"):
        ps_plugin.kerasdist_create_strategy(ps_plugin.PS(), cluster)
    with pytest.raises(kerasdist.ClusterConfigError, match="not a ps or worker task"):
        ps_plugin.serve(kerasdist.ClusterInfo.local())


def test_unreachable_ps_and_worker_fail_fast_naming_them():
    workers, ps = _addresses(1), _addresses(1)  # nothing listens there
    start = time.monotonic()
    with pytest.raises(kerasdist.PluginUnavailableError, match="cannot reach") as info:
        _model().compile(loss="mse", distribute=kerasdist.ps(workers=workers, ps=ps, connect_timeout=1))
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert f"ps 0 at {ps[0]}" in message and f"worker 0 at {workers[0]}" in message
    assert "connect_timeout=1s" in message


def test_input_errors_name_the_input_and_the_fix(monkeypatch):
    x, y = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    with pytest.raises(kerasdist.KerasdistError, match="got y, batch_size with a dataset input"):
        ps_plugin.training_input(None, dataset, y, None, 4, True)
    with pytest.raises(kerasdist.KerasdistError, match="cannot feed x of type dict_itemiterator"):
        ps_plugin.training_input(None, iter({}.items()), None, None, None, True)
    monkeypatch.setattr(ps_data, "MAX_NUMPY_BYTES", 16)
    with pytest.raises(kerasdist.KerasdistError, match="NumPy input is 0 MiB; above 0 MiB"):
        ps_plugin.training_input(None, x, y, None, 4, True)
    monkeypatch.undo()
    source, spec, steps = ps_plugin.training_input(None, x, y, None, 3, False)
    assert steps == 3 and spec[0].shape.as_list() == [None, 2]  # one pass over 8 samples: 3 batches
    repeated, _, steps = ps_plugin.training_input(None, dataset, None, None, None, True)
    assert steps is None and repeated.cardinality() == tf.data.INFINITE_CARDINALITY  # finite input repeated


# -- real clusters ----------------------------------------------------------------------------------------

def _start(cmd, env, log):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(procs):
    for proc in procs:
        kill_group(proc)
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_worker_matches_single_device_training_exactly(tmp_path):
    """1 worker + 1 ps (plain tf.distribute.Server processes), cluster given as kerasdist.ps(workers=, ps=)."""
    cluster = {"worker": _addresses(1), "ps": _addresses(1)}
    servers = []
    try:
        for job, addresses in cluster.items():
            for index in range(len(addresses)):
                servers.append(_start([PYTHON, SERVER, job, str(index), json.dumps(cluster)], child_env(),
                                      tmp_path / f"{job}{index}.log"))
        out = tmp_path / "exact.json"
        output = run([PYTHON, TRAIN, "exact", str(out), json.dumps(cluster["worker"]), json.dumps(cluster["ps"])],
                     timeout=240, env=child_env(TF_ENABLE_ONEDNN_OPTS=0)).stdout
    finally:
        _stop(servers)
    result = json.loads(out.read_text())
    print(json.dumps({k: result[k] for k in ("diff_dataset", "diff_numpy", "diff_dataset_fn", "diff_predict",
                                              "history", "ref_history", "fit_seconds")}))
    assert result["strategy"] == "ParameterServerStrategyV2"
    assert result["variable_devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"]
    # SGD, same initial weights, same batches: one worker's asynchronous updates are sequential.
    for key in ("diff_dataset", "diff_numpy", "diff_dataset_fn"):
        assert result[key] <= 1e-5, (key, result[key])
    assert result["iterations"] == 12
    np.testing.assert_allclose(result["history"]["loss"], result["ref_history"]["loss"], atol=1e-5)
    np.testing.assert_allclose(result["history"]["mae"], result["ref_history"]["mae"], atol=1e-5)
    assert result["history_type"] == "History"
    events = result["events"]
    assert [e[0] for e in events] == ["train_begin", "epoch_end", "epoch_end", "train_end"]
    assert events[2][2]["loss"] == pytest.approx(result["history"]["loss"][1])
    # evaluate/predict run on the coordinator with the ps variables: exact
    assert result["eval"] == pytest.approx(result["ref_eval"], abs=1e-5)
    assert result["evaluate_list"] == pytest.approx([result["eval"]["loss"], result["eval"]["mae"]])
    assert result["diff_predict"] <= 1e-5
    assert result["dataset_fn_contexts"] == ["InputContext"]
    # verbose="auto" prints Keras's progress bar; ModelCheckpoint writes the trained ps variables
    assert "Epoch 2/2" in output and "6/6" in output
    assert result["diff_checkpoint"] == 0.0
    assert set(result["val_history"]) == {"loss", "mae", "val_loss", "val_mae"}
    assert result["val_history"]["val_loss"][-1] == pytest.approx(result["ref_eval"]["loss"], abs=1e-5)
    errors = result["errors"]
    assert errors["no_steps"]["type"] == "KerasdistError" and "steps_per_epoch=N" in errors["no_steps"]["message"]
    assert errors["no_steps"]["seconds"] < 5  # refused before anything is scheduled: no hang
    assert "x of type generator" in errors["generator"]["message"]
    assert "class_weight={0: 1.0}" in errors["class_weight"]["message"]
    assert "ran out of data" in errors["exhausted"]["message"] and "repeat()" in errors["exhausted"]["message"]
    assert errors["other_cluster"]["type"] == "ClusterConfigError"
    assert "one parameter-server cluster per process" in errors["other_cluster"]["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_workers_from_tf_config_converge_and_both_run_steps(tmp_path):
    """2 workers + 1 ps served by `python -m kerasdist_plugins.ps`, the chief with distribute="auto"."""
    cluster = {"chief": _addresses(1), "worker": _addresses(2), "ps": _addresses(1)}

    def tf_config(job, index):
        return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})

    servers, logs = [], {}
    try:
        for job in ("ps", "worker"):
            for index in range(len(cluster[job])):
                logs[job, index] = tmp_path / f"{job}{index}.log"
                servers.append(_start([PYTHON, "-m", "kerasdist_plugins.ps"],
                                      child_env(TF_CONFIG=tf_config(job, index), KERASDIST_PS_EXIT_GRACE=3),
                                      logs[job, index]))
        out = tmp_path / "async.json"
        run([PYTHON, TRAIN, "async", str(out)], timeout=240, env=child_env(TF_CONFIG=tf_config("chief", 0)))
        finished = time.monotonic()
        codes = [proc.wait(timeout=30) for proc in servers]  # they exit by themselves
        exit_seconds = time.monotonic() - finished
    finally:
        _stop(servers)
    print(json.dumps({"server_exit_codes": codes, "servers_gone_after_s": round(exit_seconds, 1)}))
    assert codes == [0, 0, 0] and 3 <= exit_seconds < 3 + 15
    assert all("has been gone for 3 s" in log.read_text() for log in logs.values())
    result = json.loads(out.read_text())
    steps = [logs["worker", i].read_text().count("kerasdist-test-step") for i in range(2)]
    losses = result["history"]["loss"]
    print(json.dumps({"steps_per_worker": steps, "losses": losses, "initial_loss": result["initial_loss"],
                      "final_loss": result["final_loss"], "iterations": result["iterations"],
                      "fit_seconds": result["fit_seconds"]}))
    assert result["strategy"] == "ParameterServerStrategyV2"
    assert "serving ps 0" in logs["ps", 0].read_text()
    assert sum(steps) == 6 * 25 and min(steps) > 0, steps  # every scheduled step ran, on both workers
    assert result["final_loss"] < 0.1 * result["initial_loss"]
    assert len(losses) == 6


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_servers_exit_by_themselves_when_the_coordinator_is_killed(tmp_path):
    cluster = {"chief": _addresses(1), "worker": _addresses(1), "ps": _addresses(1)}

    def tf_config(job):
        return json.dumps({"cluster": cluster, "task": {"type": job, "index": 0}})

    servers = [_start([PYTHON, "-m", "kerasdist_plugins.ps"], child_env(TF_CONFIG=tf_config(job),
                                                                       KERASDIST_PS_EXIT_GRACE=2),
                      tmp_path / f"{job}.log") for job in ("ps", "worker")]
    coordinator = subprocess.Popen([PYTHON, TRAIN, "hold", str(tmp_path / "unused.json")], cwd=ROOT,
                                   env=child_env(TF_CONFIG=tf_config("chief")), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in coordinator.stdout:
            if "kerasdist-test-coordinator-ready" in line:
                break
        deadline = time.monotonic() + 30
        while not all("the coordinator at" in (tmp_path / f"{job}.log").read_text() for job in ("ps", "worker")):
            assert time.monotonic() < deadline, "the servers never saw the coordinator"
            time.sleep(0.2)
        assert all(proc.poll() is None for proc in servers)  # serving while the coordinator lives
        kill_group(coordinator)
        killed = time.monotonic()
        codes = [proc.wait(timeout=60) for proc in servers]
        seconds = time.monotonic() - killed
    finally:
        kill_group(coordinator)
        _stop(servers)
    print(json.dumps({"server_exit_codes": codes, "servers_gone_after_s": round(seconds, 1)}))
    assert codes == [0, 0] and 2 <= seconds < 2 + 15


@pytest.mark.parametrize("argv,environ,words", [
    (["--exit-grace", "nan"], {}, ["--exit-grace=nan", ">= 0"]),
    (["--exit-grace", "soon"], {}, ["--exit-grace='soon'"]),
    ([], {"KERASDIST_PS_EXIT_GRACE": "-1"}, ["KERASDIST_PS_EXIT_GRACE='-1'", ">= 0"]),
    (["--coordinator", "nohost"], {}, ["'nohost'", "host:port"]),
], ids=["nan", "word", "negative-env", "bad-coordinator"])
def test_bad_exit_options_are_named(argv, environ, words, monkeypatch, capsys):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    assert ps_server.main(argv) == 2
    err = capsys.readouterr().err
    assert all(word in err for word in words), err
    assert time.monotonic() - start < 5


def test_exit_grace_never_and_defaults():
    assert ps_server.exit_grace_of("never", {}) is None
    assert ps_server.exit_grace_of(None, {"KERASDIST_PS_EXIT_GRACE": "never"}) is None
    assert ps_server.exit_grace_of(None, {}) == ps_server.DEFAULT_EXIT_GRACE
    assert ps_server.exit_grace_of("2.5", {}) == 2.5
