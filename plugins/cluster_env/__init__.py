"""Cluster detection: TF_CONFIG (through TensorFlow's resolver when installed), then Slurm.

TF_CONFIG is what Kubeflow's TFJob, Ray Train, a hand-written Kubernetes manifest
and ``kerasdist launch`` set. Slurm is read from an ``srun`` step's own variables
(one task per worker; :mod:`.slurm`, no TensorFlow). Horovod/MPI variables belong
to the horovod plugin.
"""

import contextlib
import importlib.util
import json
import os

import kerasdist
from kerasdist import ClusterConfigError, ClusterInfo
from kerasdist.plugin_tools import split_address

from . import slurm

TASK_TYPES = ("chief", "worker", "ps", "evaluator")


@kerasdist.hookimpl
def kerasdist_detect_cluster(environ):
    """TF_CONFIG first, then a Slurm step with more than one task; None otherwise (a batch script outside
    srun is one process)."""
    if environ.get("TF_CONFIG", "").strip():
        return from_tf_config(environ)
    if "SLURM_PROCID" in environ:
        return from_slurm(environ)
    return None


# -- TF_CONFIG ------------------------------------------------------------------

def from_tf_config(environ):
    """The cluster described by ``environ["TF_CONFIG"]``, checked; None when it names no cluster."""
    raw = environ["TF_CONFIG"]
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON ({exc.msg} at character {exc.pos}): {raw[:200]!r}. Expected e.g. "
            '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}'
        ) from None
    if not isinstance(config, dict):
        raise ClusterConfigError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task'; got {raw[:200]!r}.")
    if not config.get("cluster"):
        return None
    if importlib.util.find_spec("tensorflow") is None:  # a JAX-only install: the same reading, in Python
        cluster, task_type, task_index, rpc_layer = _read_without_tensorflow(config)
        validate(cluster, task_type, task_index, source="TF_CONFIG")
        return ClusterInfo(task_type=task_type, task_index=int(task_index), cluster=cluster,
                           source="tf_config", rpc_layer=rpc_layer)
    import tensorflow as tf

    with _environment(environ, ("TF_CONFIG",)):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        try:
            cluster = resolver.cluster_spec().as_dict()
        except (TypeError, ValueError) as exc:
            raise ClusterConfigError(
                f"TF_CONFIG 'cluster' is not valid ({exc}): {json.dumps(config.get('cluster'))[:200]}. "
                'Give job names mapped to lists of "host:port", e.g. {"worker": ["h1:2222", "h2:2222"]}.'
            ) from None
        task_type, task_index = resolver.task_type, resolver.task_id
        rpc_layer = resolver.rpc_layer or "grpc"
    cluster = {job: list(addresses.values()) if isinstance(addresses, dict) else list(addresses)
               for job, addresses in cluster.items()}
    validate(cluster, task_type, task_index, source="TF_CONFIG")
    return ClusterInfo(task_type=task_type, task_index=int(task_index), cluster=cluster,
                       source="tf_config", rpc_layer=rpc_layer)


def _read_without_tensorflow(config):
    """What ``TFConfigClusterResolver`` reads from TF_CONFIG: ``(cluster, task type, task index, rpc layer)``,
    each job's addresses as a list in task order (a job may be ``{"index": address}``, as TensorFlow allows)."""
    cluster, task = config["cluster"], config.get("task") or {}
    try:
        cluster = {job: [addresses[k] for k in sorted(addresses, key=int)] if isinstance(addresses, dict)
                   else list(addresses) for job, addresses in cluster.items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise ClusterConfigError(
            f"TF_CONFIG 'cluster' is not valid ({exc}): {json.dumps(config.get('cluster'))[:200]}. "
            'Give job names mapped to lists of "host:port", e.g. {"worker": ["h1:2222", "h2:2222"]}.') from None
    return cluster, task.get("type"), task.get("index"), config.get("rpc_layer") or "grpc"


def validate(cluster, task_type, task_index, source):
    """Raise ClusterConfigError for an unknown job, a task index outside it, or a repeated address."""
    unknown = sorted(set(cluster) - set(TASK_TYPES))
    if unknown:
        raise ClusterConfigError(f"{source}: unknown job name(s) {unknown} in the cluster; "
                                 f"use {', '.join(TASK_TYPES)}.")
    if task_type is None or task_index is None:
        raise ClusterConfigError(
            f"{source} has a cluster but no task: add \"task\": {{\"type\": \"worker\", \"index\": N}} "
            "naming this process's place in the cluster.")
    if task_type not in cluster:
        raise ClusterConfigError(
            f"{source}: task type {task_type!r} is not a job of the cluster {sorted(cluster)}; "
            "set task.type to one of them.")
    size = len(cluster[task_type])
    if not 0 <= int(task_index) < size:
        raise ClusterConfigError(
            f"{source}: task index {task_index} is outside the cluster: job {task_type!r} has {size} "
            f"address(es) ({', '.join(cluster[task_type])}), so the index must be 0..{size - 1}.")
    if cluster.get("chief") and len(cluster["chief"]) > 1:
        raise ClusterConfigError(f"{source}: a cluster has at most one chief; got {cluster['chief']}.")
    seen = {}
    for job, addresses in cluster.items():
        for index, address in enumerate(addresses):
            if not isinstance(address, str):
                raise ClusterConfigError(f"{source}: address {address!r} of {job} {index} is not 'host:port'.")
            split_address(address, f"{source}: address of {job} {index}")
            if address in seen:
                raise ClusterConfigError(
                    f"{source}: address {address} is listed twice (as {seen[address]} and {job} {index}); "
                    "every task needs its own host:port.")
            seen[address] = f"{job} {index}"


# -- Slurm ------------------------------------------------------------------------

def from_slurm(environ):
    """The cluster of an ``srun`` step (one worker per task), or None for one task or a batch script."""
    return slurm.detect(environ)


@contextlib.contextmanager
def _environment(environ, names):
    """Make ``os.environ`` show ``environ``'s values of ``names`` while a TF resolver reads them."""
    if environ is os.environ:
        yield
        return
    saved = {name: os.environ.get(name) for name in names}
    try:
        for name in names:
            if environ.get(name) is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(environ[name])
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- kerasdist launch ------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_launch_environment(worker, environ):
    """Each worker of ``kerasdist launch`` gets a TF_CONFIG naming every worker's address (refused inside
    a multi-task srun step: each task would launch a whole cluster)."""
    slurm.refuse_launch_in_step(environ)
    environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(worker.addresses)},
                                       "task": {"type": "worker", "index": worker.index}})
