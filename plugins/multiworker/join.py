"""Joining the cluster: this task's gRPC server, TF's coordination service, and a watchdog that
turns a cluster that never comes up into a clear error."""

import contextlib
import os
import sys

from kerasdist import ClusterConfigError, KerasdistError
from kerasdist.plugin_tools import (configure_coordination, install_multiworker_fit_fixes, port_is_free,
                                    tf_context_initialized, unreachable)

from .options import JOIN_TIMEOUT_VAR


class state:
    """This process's multiworker state: one cluster and one strategy per process."""

    strategy = None
    options = None
    cluster = None
    error = None
    ring = None  # the TcpRing, False when the workers agreed on TensorFlow's collectives
    said_strategy_free = False  # the chief's one line saying KERASDIST_STRATEGY_FREE=on took effect
    strategy_free_setting = None  # KERASDIST_STRATEGY_FREE, once every worker was found to have the same


class TooLate(KerasdistError):
    pass


def join_cluster(cluster, options, join_timeout):
    """Create the MultiWorkerMirroredStrategy: starts this task's gRPC server and waits for the others."""
    import tensorflow as tf

    if tf_context_initialized():
        raise TooLate(
            "distribute='multiworker': TensorFlow already ran an operation before kerasdist could set up "
            "collective ops for the cluster. Put `import kerasdist` before any TensorFlow/Keras code that "
            "runs an op (building a model, creating a tensor), e.g. as the script's first import.")
    own = cluster.cluster[cluster.task_type][cluster.task_index]
    check_port_free(own, f"{cluster.task_type} {cluster.task_index}")
    spec = tf.train.ClusterSpec(cluster.cluster)
    configure_coordination(spec, join_timeout)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=cluster.task_type, task_id=cluster.task_index, rpc_layer=cluster.rpc_layer)
    watchdog = _JoinWatchdog(cluster, join_timeout)
    watchdog.start()
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options.tf_options())
    except tf.errors.OpError as exc:
        raise ClusterConfigError(_join_failure(cluster, join_timeout, exc)) from None
    finally:
        watchdog.cancel()
    install_multiworker_fit_fixes()
    return strategy


def check_port_free(address, who):
    """Raise ClusterConfigError when this task's port is already taken."""
    port = int(address.rsplit(":", 1)[1])
    if not port_is_free(port):
        raise ClusterConfigError(
            f"Port {port} of {who} ({address}) is already in use by another process, so this worker "
            "cannot start its gRPC server. Stop that process or give the task a free port "
            "(`kerasdist launch` picks free ports).")


def _unreachable(cluster):
    down = unreachable([a for addresses in cluster.cluster.values() for a in addresses])
    return [f"{job} {index} ({address})" for job, addresses in cluster.cluster.items()
            for index, address in enumerate(addresses) if address in down]


def _join_failure(cluster, join_timeout, exc=None):
    down = _unreachable(cluster)
    who = f"not reachable: {', '.join(down)}" if down else "all addresses answer, but not every task registered"
    detail = f" TensorFlow said: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}" if exc else ""
    return _join_failure_template(cluster, join_timeout).replace("{who}", who) + detail


class _JoinWatchdog:
    """TensorFlow's cluster set-up can block forever in C++ holding the GIL (the
    coordination leader waits for absent workers), so a thread cannot help: a small
    separate process waits for the join timeout, prints why, and kills this worker."""

    def __init__(self, cluster, timeout):
        self.cluster, self.timeout = cluster, timeout
        self._proc = None

    def start(self):
        import json
        import subprocess

        message = _join_failure_template(self.cluster, self.timeout)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.timeout + 5), message,
             json.dumps(self.cluster.cluster)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)

    def cancel(self):
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # EOF: the join finished
            self._proc.wait()
            self._proc = None


def _join_failure_template(cluster, join_timeout):
    return (f"distribute='multiworker': the cluster did not come up within {join_timeout:g} s "
            f"({cluster.num_workers} workers expected; {{who}}). Start every worker with the same cluster "
            f"(TF_CONFIG), check the addresses and firewalls, or raise {JOIN_TIMEOUT_VAR}.")


_WATCHDOG = r"""
import json, os, select, signal, socket, sys
parent, timeout, message, cluster = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
if select.select([sys.stdin], [], [], timeout)[0]:
    sys.exit(0)
down = []
for job, addresses in cluster.items():
    for index, address in enumerate(addresses):
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            down.append(f"{job} {index} ({address})")
who = "not reachable: " + ", ".join(down) if down else "all addresses answer, but not every task registered"
sys.stderr.write("kerasdist.ClusterConfigError: " + message.replace("{who}", who) + "\n")
sys.stderr.flush()
os.kill(parent, signal.SIGKILL)
"""
