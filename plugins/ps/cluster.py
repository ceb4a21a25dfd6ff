"""The parameter-server cluster: where it comes from, checks, and the one connection per process."""

import socket
import threading
import time
import warnings

from kerasdist import ClusterConfigError, PluginUnavailableError
from kerasdist.plugin_tools import split_address, unreachable

#: Jobs of a parameter-server cluster. The coordinator ("chief") is this process: it joins the
#: cluster under its local job name, so a "chief" entry is accepted and not connected to.
SERVING_JOBS = ("ps", "worker")
DEFAULT_CONNECT_TIMEOUT = 30.0


def cluster_of(spec, cluster):
    """``(jobs, source)``: the ps and worker addresses this spec trains on, checked."""
    if spec.cluster_resolver is not None:
        resolver = spec.cluster_resolver
        if not hasattr(resolver, "cluster_spec"):
            raise ClusterConfigError(
                f"ps: cluster_resolver={resolver!r} is not a tf.distribute.cluster_resolver.ClusterResolver; "
                "pass e.g. SimpleClusterResolver(tf.train.ClusterSpec({'worker': [...], 'ps': [...]})).")
        jobs = {job: _addresses(a) for job, a in resolver.cluster_spec().as_dict().items()}
        source = f"cluster_resolver={type(resolver).__name__}"
    elif spec.workers is not None or spec.ps is not None:
        jobs = {"worker": list(spec.workers or ()), "ps": list(spec.ps or ())}
        source = "kerasdist.ps(workers=..., ps=...)"
    else:
        if cluster.task_type in SERVING_JOBS and cluster.has_parameter_servers:
            raise ClusterConfigError(
                f"ps: this process is task {cluster.task_type}:{cluster.task_index} of a parameter-server "
                f"cluster ({cluster.source}); ps and worker tasks only serve and must not run the training "
                "script. Run `python -m kerasdist_plugins.ps` there (same TF_CONFIG), and the training "
                "script in the chief task only.")
        jobs = {job: list(a) for job, a in cluster.cluster.items()}
        source = f"the detected cluster ({cluster.source})"
    _check_jobs(jobs, source)
    return {job: list(jobs[job]) for job in SERVING_JOBS}, source


def _addresses(value):
    return list(value.values()) if isinstance(value, dict) else list(value)


def _check_jobs(jobs, source):
    how = ("Pass kerasdist.ps(workers=['host:port', ...], ps=['host:port', ...]), or set TF_CONFIG with "
           "'ps' and 'worker' jobs (and this process as task 'chief').")
    if not jobs.get("ps"):
        raise ClusterConfigError(
            f"distribute='ps' needs a cluster with parameter servers, and {source} has none "
            f"(jobs: {sorted(j for j in jobs if jobs[j]) or 'none'}). {how}")
    if not jobs.get("worker"):
        raise ClusterConfigError(f"distribute='ps' needs at least one worker; {source} lists none. {how}")
    unknown = sorted(set(jobs) - set(SERVING_JOBS) - {"chief", "evaluator"})
    if unknown:
        raise ClusterConfigError(f"ps: unknown job(s) {unknown} in {source}; use 'ps', 'worker' (and 'chief').")
    for job in SERVING_JOBS:
        for address in jobs[job]:
            split_address(address, f"ps: {job} address")


def wait_reachable(jobs, timeout):
    """Wait until every ps and worker accepts TCP connections; PluginUnavailableError after ``timeout`` s.

    TensorFlow itself retries an unreachable task for minutes before failing."""
    deadline = time.monotonic() + timeout
    tasks = [(job, i, address) for job in SERVING_JOBS for i, address in enumerate(jobs[job])]
    while True:
        down = unreachable([address for _, _, address in tasks],
                           timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        if not down:
            return
        if time.monotonic() >= deadline:
            missing = ", ".join(f"{job} {index} at {address} ({down[address]})"
                                for job, index, address in tasks if address in down)
            raise PluginUnavailableError(
                f"ps: cannot reach {missing} within connect_timeout={timeout:g}s. Start every ps and worker "
                "task first (`python -m kerasdist_plugins.ps` with TF_CONFIG, or tf.distribute.Server), check "
                "the addresses, or raise kerasdist.ps(connect_timeout=...).")
        time.sleep(0.2)


class Connection:
    """One parameter-server cluster per process: connecting to another one invalidates the first's variables."""

    lock = threading.Lock()
    jobs = None
    strategy = None


class Presence:
    """The coordinator's presence for the ps and worker tasks: a listener on this process's "chief"
    address that accepts and closes connections (it reads nothing). ``python -m kerasdist_plugins.ps``
    watches it and exits once it has been gone for its grace: the coordinator finished or was killed."""

    listener = None

    @classmethod
    def announce(cls, cluster):
        if cls.listener is not None or cluster.task_type != "chief" or not cluster.cluster.get("chief"):
            return
        address = cluster.cluster["chief"][cluster.task_index]
        host, port = split_address(address, "ps: chief address")
        try:
            cls.listener = socket.create_server((host, port))
        except OSError as exc:
            warnings.warn(f"ps: cannot listen on this coordinator's address {address} ({exc}); the ps and worker "
                          "tasks will not notice when it ends and serve until they are stopped.", stacklevel=2)
            return
        threading.Thread(target=cls._accept, args=(cls.listener,), name="kerasdist-ps-presence",
                         daemon=True).start()

    @staticmethod
    def _accept(listener):
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.close()
