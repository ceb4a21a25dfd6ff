"""Cluster detection (TF_CONFIG, a Slurm step's own variables, placement as Slurm documents it), and "auto"."""

import json
import os
import re
import stat
import subprocess
import sys

import pytest
import yaml

import kerasdist
from kerasdist import ClusterConfigError, ClusterInfo, cli, launch
from kerasdist_plugins import cluster_env, multiworker
from kerasdist_plugins.cluster_env import slurm
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
            "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", **extra}


# Slurm's documented placement (srun -m): block fills each node in turn; cyclic deals one task to each node
# with room, round after round. Node order is the node list's (node9 before node10), not alphabetical.
PLACEMENTS = {
    ("node[9-10]", "2(x2)", "block"): ["node9/0", "node9/1", "node10/0", "node10/1"],
    ("node[9-10]", "2(x2)", "cyclic"): ["node9/0", "node10/0", "node9/1", "node10/1"],
    ("n[1-2]", "2,1", "block"): ["n1/0", "n1/1", "n2/0"],
    ("n[1-2]", "2,1", "cyclic"): ["n1/0", "n2/0", "n1/1"],
    ("b,a[10-11]", "1,3,1", "cyclic"): ["b/0", "a10/0", "a11/0", "a10/1", "a10/2"],
    ("gpu[01-03,7]", "2(x3),1", "block"): ["gpu01/0", "gpu01/1", "gpu02/0", "gpu02/1", "gpu03/0", "gpu03/1", "gpu7/0"],
}


def _as_slurm_gives_it(nodes, per_node, distribution, table, rank):
    """The variables Slurm sets for task ``rank`` of a step laid out as ``table`` ("node/local id" per rank)."""
    node, local = table[rank].split("/")
    mates = ",".join(str(r) for r, place in enumerate(table) if place.split("/")[0] == node)
    extra = {"SLURM_DISTRIBUTION": distribution} if distribution != "block" else {}
    return _slurm(rank, tasks=str(len(table)), nodes=nodes, per_node=per_node, SLURMD_NODENAME=node,
                  SLURM_LOCALID=local, SLURM_GTIDS=mates, **extra)


@pytest.mark.parametrize("key", list(PLACEMENTS), ids=["-".join(k) for k in PLACEMENTS])
def test_slurm_step_places_every_task_where_slurm_does(key):
    table = PLACEMENTS[key]
    infos = [cluster_env.kerasdist_detect_cluster(_as_slurm_gives_it(*key, table, rank)) for rank in range(len(table))]
    base = infos[0].extra["port_base"]
    expected = [f"{place.split('/')[0]}:{base + int(place.split('/')[1])}" for place in table]
    assert [(i.source, i.task_index) for i in infos] == [("slurm", r) for r in range(len(table))]
    assert all(i.cluster == {"worker": expected} for i in infos)
    assert infos[0].is_chief and not any(i.is_chief for i in infos[1:])


def test_slurm_host_list_and_tasks_per_node_syntax():
    assert slurm.expand_hostlist("node[9-10],gpu[01-03,7]") == ["node9", "node10", "gpu01", "gpu02", "gpu03", "gpu7"]
    assert slurm.expand_hostlist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert slurm.expand_hostlist("login") == ["login"]
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


@pytest.mark.parametrize("environ,needle", [
    # TF's resolver took a sorted host list and block slots: rank 0 of node[9-10] would have been node10
    (dict(_slurm(0, nodes="node[9-10]"), SLURMD_NODENAME="node10"), "SLURMD_NODENAME='node10' .derived: 'node9'"),
    # tasks placed cyclically while the step's variables say block
    (dict(_slurm(1), SLURMD_NODENAME="node2", SLURM_LOCALID="0"), "SLURMD_NODENAME='node2' .derived: 'node1'"),
    (dict(_slurm(2), SLURM_GTIDS="0,2"), "SLURM_GTIDS='0,2' .derived: '2,3'"),
    (_slurm(0, SLURM_DISTRIBUTION="arbitrary"), "'arbitrary'.*--distribution=block.*TF_CONFIG"),
    (_slurm(0, SLURM_DISTRIBUTION="plane=2"), "a block or cyclic distribution only"),
    (_slurm(0, nodes="node[1-3]"), "do not describe SLURM_STEP_NUM_TASKS=4"),
    (_slurm(0, nodes="node[3-1]"), "rising range"),
    (_slurm(0, nodes="node[1-2"), "unbalanced brackets"),
    (_slurm(0, per_node="2(x)"), "not a task count list"),
    (_slurm(4), "SLURM_PROCID=4 is outside"),
    (_slurm(0, SLURM_STEP_NODELIST=""), "SLURM_STEP_NODELIST is not set"),
    (_slurm(0, KERASDIST_SLURM_PORT_BASE="65535"), "must lie in 1..65535"),
    (_slurm(0, tasks="130", nodes="big", per_node="130"), "set KERASDIST_SLURM_PORT_BASE"),
], ids=["sorted-hosts", "cyclic-as-block", "gtids", "arbitrary", "plane", "count-mismatch", "falling-range",
        "brackets", "per-node-syntax", "procid", "no-nodelist", "port-base-range", "too-many-per-node"])
def test_slurm_layout_that_cannot_be_derived_is_one_clear_error(environ, needle):
    with pytest.raises(ClusterConfigError, match=needle):
        cluster_env.kerasdist_detect_cluster(environ)


def test_slurm_ports_follow_the_job_and_step_and_can_be_set():
    bases = {(job, step): cluster_env.from_slurm(_slurm(0, SLURM_JOB_ID=job, SLURM_STEP_ID=step)).extra["port_base"]
             for job in ("1234", "1235", "99999") for step in ("0", "1")}
    assert len(set(bases.values())) == len(bases)  # jobs and steps sharing a node do not collide
    assert all(slurm.PORT_LOW <= b and b + slurm.PORT_BLOCK <= slurm.PORT_HIGH <= 32768 for b in bases.values())
    info = cluster_env.from_slurm(_slurm(3, KERASDIST_SLURM_PORT_BASE="9000"))
    assert info.cluster["worker"] == ["node1:9000", "node1:9001", "node2:9000", "node2:9001"]


def test_slurm_single_task_step_and_batch_script_are_one_process():
    assert cluster_env.kerasdist_detect_cluster(_slurm(0, tasks="1", nodes="n1", per_node="1")) is None
    # sbatch --ntasks=2 running `python train.py` itself: the allocation's variables, no step of tasks
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    assert cluster_env.kerasdist_detect_cluster(batch) is None
    assert cluster_env.kerasdist_detect_cluster(dict(batch, SLURM_STEP_ID="4294967294",
                                                     SLURM_STEP_NUM_TASKS="2")) is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_slurm_batch_script_trains_at_once_and_torch_reads_slurm_without_tensorflow():
    """A batch script outside srun: `import kerasdist` is one process at once, saying so once (it waited
    300 s for a cluster); an srun task on torch resolves its step without importing TensorFlow."""
    code = ("import sys, time; t = time.monotonic(); import kerasdist; from kerasdist_plugins import cluster_env\n"
            "print('source', kerasdist.detect_cluster().source, round(time.monotonic() - t))\n"
            f"info = cluster_env.kerasdist_detect_cluster({_slurm(1, tasks='2', nodes='n1', per_node='2')!r})\n"
            "print('step', info.task_index, info.cluster['worker'][1].startswith('n1:'), "
            "'tensorflow' in sys.modules)")
    env = child_env(KERAS_BACKEND="torch", SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n[1-2]",
                    SLURM_JOB_ID="7")
    result = run([sys.executable, "-c", code], timeout=100, env=env)
    seconds = int(result.stdout.split("source local ")[1].split()[0])
    assert seconds < 120 and "step 1 True False" in result.stdout, result.stdout  # not the 300 s wait; a loaded machine
    assert result.stdout.count("Slurm batch script outside srun") == 1, result.stdout


def test_launch_inside_a_multi_task_srun_step_is_refused(monkeypatch, capsys):
    child = os.path.join(ROOT, "tests", "workers", "launch_child.py")
    for name, value in _slurm(1, tasks="2", nodes="n1", per_node="2").items():
        monkeypatch.setenv(name, value)
    assert cli.main(["launch", "-n", "2", child, "ok", "."]) == 2
    err = capsys.readouterr().err
    assert "one of the 2 tasks of an srun step" in err
    assert "srun --ntasks 2 python train.py" in err and "srun --ntasks 1 kerasdist launch -n N" in err
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # `srun --ntasks 1 kerasdist launch -n 2`: fine
    envs = launch.worker_environments(cli.build_parser().parse_args(["launch", "-n", "2", child]))
    assert [json.loads(e["TF_CONFIG"])["task"]["index"] for e in envs] == [0, 1]


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
    nodes = int(text.split("--nodes=")[1].split()[0])
    per_node = int(text.split("--ntasks-per-node=")[1].split()[0])
    table = [f"gpu{n:02d}/{local}" for n in range(7, 7 + nodes) for local in range(per_node)]
    infos = [cluster_env.from_slurm(_as_slurm_gives_it(f"gpu[07-{6 + nodes:02d}]", f"{per_node}(x{nodes})",
                                                       "block", table, rank)) for rank in range(len(table))]
    assert [i.task_index for i in infos] == list(range(len(table)))
    assert infos[0].cluster["worker"][0].startswith("gpu07:") and infos[-1].cluster["worker"][-1].startswith("gpu08:")


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


@pytest.mark.parametrize("slurm, expected", [
    ({}, "torchrun"),  # torchrun alone
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "torchrun"),  # torchrun in a batch script, outside srun
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"}, "torchrun"),  # srun --ntasks 1 torchrun
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "4294967294"}, "torchrun"),  # batch step
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}, None),  # srun's tasks: cluster_env
])
def test_torchrun_inside_one_slurm_task_is_read_as_torchrun(slurm, expected):
    from kerasdist_plugins.torch_distributed.launching import detect

    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
               **slurm}
    found = detect(environ)
    assert (found and found.source) == expected
    if found is not None:
        assert (found.task_index, found.num_workers) == (1, 2)
