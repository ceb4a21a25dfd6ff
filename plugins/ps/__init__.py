"""distribute="ps": asynchronous training with parameter servers (tf.distribute ParameterServerStrategy).

Keras 3's ``fit`` has no ClusterCoordinator path (tf_keras had one), so this plugin runs ``fit`` itself:
the process that calls ``fit`` is the coordinator; it schedules training steps (``model.train_step``)
on the workers through ``tf.distribute.coordinator.ClusterCoordinator``; the variables live on the
parameter servers and every worker updates them without waiting for the others.

``evaluate`` and ``predict`` run Keras's own loops in the coordinator process, reading the variables
from the parameter servers: exact, but not spread over the workers.

Parameter-server and worker tasks only serve: start them with ``python -m kerasdist_plugins.ps``
(cluster from TF_CONFIG) or ``tf.distribute.Server``. See docs/ps.md.
"""

import dataclasses
from typing import Optional, Sequence

import kerasdist
from kerasdist import ClusterConfigError, PluginUnavailableError
from kerasdist.plugin_tools import check_number, keras_backend

from .cluster import DEFAULT_CONNECT_TIMEOUT, SERVING_JOBS, Connection, Presence, cluster_of, wait_reachable

__all__ = ["PS", "SERVING_JOBS", "cluster_of", "wait_reachable", "fit", "training_input", "serve", "main"]


@dataclasses.dataclass
class PS(kerasdist.StrategySpec):
    """``tf.distribute.experimental.ParameterServerStrategy`` driven by a ClusterCoordinator.

    The cluster comes from, in order: ``cluster_resolver``; ``workers`` + ``ps``; the detected cluster
    (TF_CONFIG with a "ps" job).

    :param workers: worker addresses, ``["host:port", ...]``.
    :param ps: parameter-server addresses, ``["host:port", ...]``.
    :param cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver`` with "ps" and "worker" jobs.
    :param connect_timeout: seconds to wait for every ps and worker to accept connections before
        ``compile`` fails (they may still be starting).
    """

    workers: Optional[Sequence[str]] = None
    ps: Optional[Sequence[str]] = None
    cluster_resolver: object = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT


@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("ps", PS, aliases=("parameter_server", "parameter-server", "parameterserver"),
             description="Asynchronous data parallelism: variables on parameter servers, steps scheduled on "
                         "workers by this process (ParameterServerStrategy + ClusterCoordinator).")


@kerasdist.hookimpl(tryfirst=True)
def kerasdist_auto_strategy(cluster):
    return "ps" if cluster.has_parameter_servers and cluster.task_type not in SERVING_JOBS else None


@kerasdist.hookimpl
def kerasdist_listeners(cluster):
    if not cluster.has_parameter_servers or keras_backend() != "tensorflow":
        return None
    address = cluster.cluster[cluster.task_type][cluster.task_index]
    if cluster.task_type in SERVING_JOBS:
        return [{"what": f"ps: TensorFlow's gRPC server of {cluster.task_type} {cluster.task_index} "
                         "(python -m kerasdist_plugins.ps); runs any graph a client sends, no authentication",
                 "address": "*:" + address.rsplit(":", 1)[1], "interfaces": "all"}]
    return [{"what": "ps: the coordinator's presence (accepts and closes connections, reads nothing)",
             "address": address, "interfaces": "the address's"}]


@kerasdist.hookimpl
def kerasdist_create_strategy(spec, cluster):
    if not isinstance(spec, PS):
        return None
    check_number(spec.connect_timeout, "connect_timeout", "ps", minimum=0, inclusive_minimum=False)
    jobs, source = cluster_of(spec, cluster)
    with Connection.lock:
        if Connection.jobs is not None:
            if Connection.jobs == jobs:
                return Connection.strategy
            raise ClusterConfigError(
                f"ps: this process already coordinates the parameter-server cluster {Connection.jobs}; it "
                f"cannot also join {jobs} ({source}). Use one parameter-server cluster per process.")
        wait_reachable(jobs, spec.connect_timeout)
        import tensorflow as tf

        from kerasdist.plugin_tools import parameter_server_strategy

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), rpc_layer=getattr(cluster, "rpc_layer", None) or "grpc")
        try:
            strategy = parameter_server_strategy(resolver)
        except (tf.errors.OpError, ValueError) as exc:
            raise PluginUnavailableError(
                f"ps: could not connect to the cluster {jobs} ({source}): {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}. Check that every address runs a TensorFlow "
                "server (python -m kerasdist_plugins.ps or tf.distribute.Server).") from exc
        Connection.jobs, Connection.strategy = jobs, strategy
        Presence.announce(cluster)
        return strategy


# -- fit / evaluate / predict ---------------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_run_call(method, call, call_kwargs, model, spec, strategy):
    if not isinstance(spec, PS):
        return None
    from . import training

    if method == "fit":
        return training.fit(model, strategy, **call_kwargs)
    return training.run_on_coordinator(call, call_kwargs, model)


def __getattr__(name):
    if name in ("fit", "training_input", "run_on_coordinator"):
        from . import training

        return getattr(training, name)
    if name in ("serve", "main"):
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
