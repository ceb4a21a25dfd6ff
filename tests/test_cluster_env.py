"""Cluster detection (TF_CONFIG, Slurm) through TensorFlow's resolvers, and "auto"."""

import json
import os
import re
import stat
import subprocess

import pytest
import yaml

import kerasdist
from kerasdist import ClusterConfigError, ClusterInfo
from kerasdist_plugins import cluster_env, multiworker
from tests.helpers import ROOT, child_env, run

EXAMPLES = os.path.join(ROOT, "examples", "multiworker")


def tf_config(workers, index=0, task_type="worker", **jobs):
    return json.dumps({"cluster": {"worker": workers, **jobs}, "task": {"type": task_type, "index": index}})


def test_tf_config_resolves_task_and_cluster():
    info = cluster_env.kerasdist_detect_cluster({"TF_CONFIG": tf_config(["a:1", "b:2", "c:3"], index=2)})
    assert (info.task_type, info.task_index, info.source) == ("worker", 2, "tf_config")
    assert info.cluster == {"worker": ["a:1", "b:2", "c:3"]}
    assert info.num_workers == 3 and not info.is_chief


def test_tf_config_with_chief():
    info = cluster_env.kerasdist_detect_cluster(
        {"TF_CONFIG": tf_config(["w:1"], index=0, task_type="chief", chief=["c:1"])})
    assert info.is_chief and info.num_workers == 2


def test_no_tf_config_and_no_slurm_is_no_cluster():
    assert cluster_env.kerasdist_detect_cluster({}) is None
    assert cluster_env.kerasdist_detect_cluster({"TF_CONFIG": '{"task": {}}'}) is None


@pytest.mark.parametrize("raw,needle", [
    ('{"cluster": {"worker": ["a:1"]', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (tf_config(["a:1", "b:2"], index=2), "task index 2 is outside the cluster"),
    (tf_config(["a:1", "b:2"], index=-1), "task index -1 is outside the cluster"),
    (tf_config(["a:1", "a:1"], index=0), "address a:1 is listed twice"),
    (tf_config(["a:1"], index=0, task_type="chief"), "task type 'chief' is not a job"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), "no task"),
    (tf_config(["a1"], index=0), "is not 'host:port'"),
])
def test_bad_tf_config_is_one_clear_error(raw, needle):
    with pytest.raises(ClusterConfigError, match=needle):
        cluster_env.kerasdist_detect_cluster({"TF_CONFIG": raw})


def _slurm(procid, tasks="4", nodes="node[1-2]", per_node="2(x2)", **extra):
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": tasks, "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": per_node, "CUDA_VISIBLE_DEVICES": "", **extra}


def test_slurm_step_resolves_through_slurm_cluster_resolver():
    info = cluster_env.kerasdist_detect_cluster(_slurm(3))
    assert info.source == "slurm" and (info.task_type, info.task_index) == ("worker", 3)
    assert info.cluster == {"worker": ["node1:8888", "node1:8889", "node2:8888", "node2:8889"]}
    assert "SLURM_PROCID" not in os.environ  # the resolver saw a temporary environment only


def test_slurm_port_base_and_single_task():
    info = cluster_env.kerasdist_detect_cluster(_slurm(0, KERASDIST_SLURM_PORT_BASE="9000"))
    assert info.cluster["worker"][0] == "node1:9000"
    assert cluster_env.kerasdist_detect_cluster(_slurm(0, tasks="1", nodes="n1", per_node="1")) is None


def test_tf_config_wins_over_slurm():
    info = cluster_env.kerasdist_detect_cluster({**_slurm(1), "TF_CONFIG": tf_config(["a:1", "b:2"], 1)})
    assert info.source == "tf_config"


def test_auto_picks_multiworker_for_a_worker_cluster_only(system):
    worker = cluster_env.from_tf_config({"TF_CONFIG": tf_config(["a:1", "b:2"])})
    with_ps = cluster_env.from_tf_config({"TF_CONFIG": tf_config(["a:1"], ps=["p:1"])})
    assert system.hook.kerasdist_auto_strategy(cluster=worker) == "multiworker"
    assert system.hook.kerasdist_auto_strategy(cluster=ClusterInfo.local()) == "mirrored"
    assert multiworker.kerasdist_auto_strategy(with_ps) is None


def test_multiworker_without_a_cluster_says_how_to_get_one():
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ClusterConfigError, match="kerasdist launch -n N"):
        model.compile(loss="mse", distribute="multiworker")


def test_bad_spec_option_is_rejected():
    with pytest.raises(kerasdist.KerasdistError, match="shard_policy='rows'"):
        multiworker.kerasdist_create_strategy(kerasdist.multiworker(shard_policy="rows"), ClusterInfo.local())


def test_port_in_use_is_named(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterConfigError, match=f"Port {port} of worker 1 .* already in use"):
            multiworker.check_port_free(f"127.0.0.1:{port}", "worker 1")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_kerasdist_env_prints_the_resolved_cluster():
    config = tf_config(["127.0.0.1:1", "127.0.0.1:2"], index=1)
    out = run([os.path.join(os.path.dirname(__import__("sys").executable), "kerasdist"), "env", "--json"],
              timeout=50, env=child_env(TF_CONFIG=config)).stdout
    info = json.loads(out[out.index("{"):])
    assert info["auto_strategy"] == "multiworker" and info["num_workers"] == 2
    assert info["cluster"]["task_index"] == 1 and info["cluster"]["source"] == "tf_config"


# -- recipes in examples/multiworker ------------------------------------------------

def test_kubernetes_manifest_parses_and_its_tf_config_resolves(tmp_path):
    docs = list(yaml.safe_load_all(open(os.path.join(EXAMPLES, "kubernetes.yaml"))))
    job = next(d for d in docs if d["kind"] == "Job")
    service = next(d for d in docs if d["kind"] == "Service")
    replicas = job["spec"]["completions"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == replicas
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    script = container["command"][-1]
    configs = []
    for index in range(replicas):
        shell_env = {"PATH": os.environ["PATH"], "JOB_COMPLETION_INDEX": str(index),
                     **{k: v for k, v in env.items() if v is not None}}
        probe = script.replace("exec python train.py", 'echo "$TF_CONFIG"')
        configs.append(subprocess.run(["sh", "-c", probe], env=shell_env, capture_output=True, text=True,
                                      timeout=10, check=True).stdout.strip())
    infos = [cluster_env.from_tf_config({"TF_CONFIG": c}) for c in configs]
    assert [i.task_index for i in infos] == list(range(replicas))
    hosts = infos[0].cluster["worker"]
    assert len(set(hosts)) == replicas and all(i.cluster["worker"] == hosts for i in infos)
    subdomain = job["spec"]["template"]["spec"]["subdomain"]
    assert subdomain == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert all(h.split(":")[0].split(".")[1] == subdomain for h in hosts)
    assert infos[0].is_chief and sum(i.is_chief for i in infos) == 1


def test_slurm_sbatch_environment_resolves(tmp_path):
    text = open(os.path.join(EXAMPLES, "slurm.sbatch")).read()
    assert re.search(r"^srun .*python examples/multiworker/train\.py", text, re.M)
    tasks = int(text.split("--ntasks-per-node=")[1].split()[0]) * int(text.split("--nodes=")[1].split()[0])
    per_node = int(text.split("--ntasks-per-node=")[1].split()[0])
    infos = [cluster_env.from_slurm(_slurm(r, tasks=str(tasks), nodes="gpu[07-08]",
                                           per_node=f"{per_node}(x2)", CUDA_VISIBLE_DEVICES="0,1"))
             for r in range(tasks)]
    assert [i.task_index for i in infos] == list(range(tasks))
    assert infos[0].cluster["worker"][0] == "gpu07:8888" and infos[-1].cluster["worker"][-1].startswith("gpu08:")


def test_ray_snippet_tf_config_shape_resolves():
    text = open(os.path.join(EXAMPLES, "ray_train.py")).read()
    assert "TensorflowTrainer" in text and 'distribute="multiworker"' in text
    # Ray's _TensorflowBackend sets exactly this shape on worker i (anchors §5).
    config = json.dumps({"cluster": {"worker": ["10.0.0.1:5001", "10.0.0.2:5002"]},
                         "task": {"type": "worker", "index": 1}})
    info = cluster_env.from_tf_config({"TF_CONFIG": config})
    assert info.task_index == 1 and multiworker.is_worker_cluster(info)
    assert stat.S_ISREG(os.stat(os.path.join(EXAMPLES, "train.py")).st_mode)


@pytest.mark.parametrize("policy,expected", [("data", "DATA"), ("file", "FILE"), ("off", "OFF")])
def test_shard_policy_is_set_on_datasets(policy, expected):
    import tensorflow as tf

    dataset = tf.data.Dataset.range(8).batch(2)
    out = multiworker.kerasdist_prepare_dataset(dataset, "tf.data", "fit", None, kerasdist.multiworker(shard_policy=policy))
    assert out.options().experimental_distribute.auto_shard_policy == getattr(
        tf.data.experimental.AutoShardPolicy, expected)
    assert multiworker.kerasdist_prepare_dataset(dataset, "tf.data", "fit", None, kerasdist.multiworker()) is None


@pytest.mark.parametrize("environ,chief", [
    ({}, True),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                               "task": {"type": "worker", "index": 0}})}, True),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                               "task": {"type": "worker", "index": 1}})}, False),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
                               "task": {"type": "chief", "index": 0}})}, True),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                               "task": {"type": "worker", "index": 0}})}, False),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, True),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}, False),
], ids=["local", "worker-0", "worker-1", "ps-coordinator", "worker-0-with-a-chief", "hvd-rank-0", "hvd-rank-1"])
def test_is_chief_names_the_one_writer(environ, chief):
    from kerasdist.manager import PluginSystem, get_system, reset_system

    previous = get_system()
    reset_system(PluginSystem(environ=environ))
    try:
        assert kerasdist.is_chief() is chief
    finally:
        reset_system(previous)
