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
import inspect
import math
import os
import socket
import sys
import threading
import time
from typing import Optional, Sequence

import kerasdist
from kerasdist import ClusterConfigError, KerasdistError, PluginUnavailableError

#: Jobs of a parameter-server cluster. The coordinator ("chief") is this process: it joins the
#: cluster under its local job name, so a "chief" entry is accepted and not connected to.
SERVING_JOBS = ("ps", "worker")
DEFAULT_CONNECT_TIMEOUT = 30.0
#: NumPy input is embedded in the input pipeline sent to every worker; beyond this, use a dataset function.
MAX_NUMPY_BYTES = 256 << 20
_FIT_UNSUPPORTED = {"class_weight": None, "validation_split": 0.0}


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


# -- the cluster -------------------------------------------------------------------------------------

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
            _split_address(address, job)


def _split_address(address, job):
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(
            f"ps: {job} address {address!r} is not 'host:port' (e.g. '10.0.0.2:2222').")
    return host.strip("[]"), int(port)


def wait_reachable(jobs, timeout):
    """Wait until every ps and worker accepts TCP connections; PluginUnavailableError after ``timeout`` s.

    TensorFlow itself retries an unreachable task for minutes before failing."""
    deadline = time.monotonic() + timeout
    pending = [(job, i, address) for job in SERVING_JOBS for i, address in enumerate(jobs[job])]
    errors = {}
    while True:
        still = []
        for job, index, address in pending:
            host, port = _split_address(address, job)
            try:
                with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                    pass
            except OSError as exc:
                errors[address] = exc.strerror or str(exc) or type(exc).__name__
                still.append((job, index, address))
        pending = still
        if not pending:
            return
        if time.monotonic() >= deadline:
            missing = ", ".join(f"{job} {index} at {address} ({errors[address]})" for job, index, address in pending)
            raise PluginUnavailableError(
                f"ps: cannot reach {missing} within connect_timeout={timeout:g}s. Start every ps and worker "
                "task first (`python -m kerasdist_plugins.ps` with TF_CONFIG, or tf.distribute.Server), check "
                "the addresses, or raise kerasdist.ps(connect_timeout=...).")
        time.sleep(0.2)


class _Connection:
    """One parameter-server cluster per process: connecting to another one invalidates the first's variables."""

    lock = threading.Lock()
    jobs = None
    strategy = None


@kerasdist.hookimpl
def kerasdist_create_strategy(spec, cluster):
    if not isinstance(spec, PS):
        return None
    if not isinstance(spec.connect_timeout, (int, float)) or spec.connect_timeout <= 0:
        raise KerasdistError(f"ps: connect_timeout={spec.connect_timeout!r} is not valid; give seconds > 0.")
    jobs, source = cluster_of(spec, cluster)
    with _Connection.lock:
        if _Connection.jobs is not None:
            if _Connection.jobs == jobs:
                return _Connection.strategy
            raise ClusterConfigError(
                f"ps: this process already coordinates the parameter-server cluster {_Connection.jobs}; it "
                f"cannot also join {jobs} ({source}). Use one parameter-server cluster per process.")
        wait_reachable(jobs, spec.connect_timeout)
        import tensorflow as tf

        from kerasdist import _keras_internals as internals

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), rpc_layer=getattr(cluster, "rpc_layer", None) or "grpc")
        try:
            strategy = internals.parameter_server_strategy(resolver)
        except (tf.errors.OpError, ValueError) as exc:
            raise PluginUnavailableError(
                f"ps: could not connect to the cluster {jobs} ({source}): {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}. Check that every address runs a TensorFlow "
                "server (python -m kerasdist_plugins.ps or tf.distribute.Server).") from exc
        _Connection.jobs, _Connection.strategy = jobs, strategy
        return strategy


# -- fit / evaluate / predict ---------------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_run_call(method, call, call_kwargs, model, spec, strategy):
    if not isinstance(spec, PS):
        return None
    if method == "fit":
        return fit(model, strategy, **call_kwargs)
    return run_on_coordinator(call, call_kwargs, model)


def run_on_coordinator(call, call_kwargs, model):
    """Keras's own evaluate/predict in this process, reading the variables from the parameter servers.

    Exact (every sample once, in order), not distributed: Keras's loop cannot schedule on workers, and
    a worker-side evaluation would read a copy of the data per worker.
    """
    import tensorflow as tf

    from kerasdist import _keras_internals as internals

    if tf.distribute.has_strategy():
        raise KerasdistError("ps: call evaluate/predict outside `with strategy.scope():` (it runs on the "
                             "coordinator, outside the parameter-server strategy).")
    kwargs = dict(call_kwargs)
    if callable(kwargs.get("x")) and not _is_dataset(kwargs["x"]):
        kwargs["x"] = _call_dataset_fn(kwargs["x"])
    bound = internals.bound_strategy(model)
    internals.bind_model(model, tf.distribute.get_strategy())
    try:
        return call(**kwargs)
    finally:
        internals.bind_model(model, bound)


def fit(model, strategy, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None, sample_weight=None,
        initial_epoch=0, steps_per_epoch=None, validation_steps=None, validation_batch_size=None,
        validation_freq=1):
    """``model.fit`` through a ClusterCoordinator; returns the ``keras.callbacks.History``."""
    import keras
    import tensorflow as tf

    from kerasdist import _keras_internals as internals

    given = {"class_weight": class_weight, "validation_split": validation_split}
    for name, default in _FIT_UNSUPPORTED.items():
        if given[name] not in (default, None):
            raise KerasdistError(
                f"distribute='ps': fit({name}={given[name]!r}) is not supported. "
                + ("Weight samples in the dataset instead (x, y, sample_weight)." if name == "class_weight"
                   else "Pass validation_data= (evaluated on the coordinator after each epoch)."))
    _check_count("epochs", epochs, minimum=1)
    _check_count("initial_epoch", initial_epoch, minimum=0)
    _check_count("validation_freq", validation_freq, minimum=1)
    source, element_spec, default_steps = training_input(strategy, x, y, sample_weight, batch_size, shuffle)
    if steps_per_epoch is None:
        steps_per_epoch = default_steps
    if steps_per_epoch is None:
        raise KerasdistError(
            "distribute='ps': fit() needs steps_per_epoch=N (a whole number > 0) with a dataset input: each "
            "worker reads its own copy of the dataset, repeated without end, so only a step count can end an "
            "epoch. Example: model.fit(dataset, epochs=3, steps_per_epoch=100). (NumPy input defaults to "
            "one pass over the data.)")
    _check_count("steps_per_epoch", steps_per_epoch, minimum=1)
    verbose = 1 if verbose == "auto" else verbose

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        internals.symbolic_build(model, element_spec)
    iterator = iter(coordinator.create_per_worker_dataset(source))
    train_function = _train_function(model, strategy)

    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
        steps=steps_per_epoch, model=model)
    history = next(c for c in callback_list.callbacks if isinstance(c, keras.callbacks.History))
    model.stop_training = False
    callback_list.on_train_begin()
    logs = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        for step in range(steps_per_epoch):
            # Batch callbacks run as steps are scheduled; their logs are empty (fetching a step's
            # result would make training synchronous).
            callback_list.on_train_batch_begin(step)
            coordinator.schedule(train_function, args=(iterator,))
            callback_list.on_train_batch_end(step, {})
            if model.stop_training:
                break
        _join(coordinator)
        logs = _metrics(model)
        if validation_data is not None and (epoch + 1) % validation_freq == 0:
            val_logs = evaluate_for_fit(model, validation_data, validation_steps,
                                        validation_batch_size or batch_size)
            logs.update({"val_" + name: value for name, value in val_logs.items()})
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return history


def _train_function(model, strategy):
    import tensorflow as tf

    @tf.function
    def train_function(iterator):
        strategy.run(model.train_step, args=(next(iterator),))

    return train_function


def _join(coordinator):
    import tensorflow as tf

    try:
        coordinator.join()
    except tf.errors.OutOfRangeError as exc:
        raise KerasdistError(
            "distribute='ps': a worker's dataset ran out of data during fit. Each worker needs an endless "
            "stream: make the dataset function return dataset.repeat() (steps_per_epoch ends each epoch).") from exc


def _metrics(model):
    import numpy as np

    return {name: float(np.asarray(value)) for name, value in model.get_metrics_result().items()}


def evaluate_for_fit(model, validation_data, steps, batch_size):
    if isinstance(validation_data, tuple) and not _is_dataset(validation_data):
        x, y, *rest = validation_data + ((None,) if len(validation_data) == 2 else ())
        kwargs = {"x": x, "y": y, "sample_weight": rest[0] if rest else None, "batch_size": batch_size}
    else:
        kwargs = {"x": validation_data}
    return model.evaluate(steps=steps, verbose=0, return_dict=True, **kwargs)


def _check_count(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KerasdistError(f"distribute='ps': fit({name}={value!r}) is not valid; give a whole number >= {minimum}.")


# -- input -----------------------------------------------------------------------------------------------

def _is_dataset(value):
    import tensorflow as tf

    return isinstance(value, tf.data.Dataset)


def _takes_input_context(fn):
    try:
        parameters = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(parameters) >= 1


def _call_dataset_fn(fn):
    import tensorflow as tf

    dataset = fn(tf.distribute.InputContext()) if _takes_input_context(fn) else fn()
    if not _is_dataset(dataset):
        raise KerasdistError(f"ps: the dataset function {fn!r} returned {type(dataset).__name__}, not a "
                             "tf.data.Dataset.")
    return dataset


def training_input(strategy, x, y, sample_weight, batch_size, shuffle):
    """``(what create_per_worker_dataset takes, element_spec, default steps_per_epoch or None)``."""
    import numpy as np
    import tensorflow as tf

    if _is_dataset(x) or callable(x):
        extra = [name for name, value in (("y", y), ("sample_weight", sample_weight), ("batch_size", batch_size))
                 if value is not None]
        if extra:
            raise KerasdistError(f"distribute='ps': fit() got {', '.join(extra)} with a dataset input; put "
                                 "labels and weights in the dataset's elements and batch the dataset.")
    if _is_dataset(x):
        if x.cardinality() >= 0:  # finite: every worker needs an endless stream
            x = x.repeat()
        return x, x.element_spec, None
    if callable(x):
        sample = _call_dataset_fn(x)
        source = strategy.distribute_datasets_from_function(x) if _takes_input_context(x) else x
        return source, sample.element_spec, None
    arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
    try:
        flat = [np.asarray(a) for a in tf.nest.flatten(arrays)]
    except Exception:
        flat = None
    if x is None or flat is None or any(a.dtype == object for a in flat) or not flat:
        raise KerasdistError(
            f"distribute='ps': fit() cannot feed x of type {type(x).__name__} to the workers. Pass a "
            "tf.data.Dataset, a function returning one (called on each worker, optionally with a "
            "tf.distribute.InputContext), or NumPy arrays. Python generators and keras.utils.PyDataset "
            "live in this process and cannot be sent to the workers.")
    size = sum(a.nbytes for a in flat)
    if size > MAX_NUMPY_BYTES:
        raise KerasdistError(
            f"distribute='ps': the NumPy input is {size / 2**20:.0f} MiB; above {MAX_NUMPY_BYTES >> 20} MiB "
            "it cannot be embedded in the input pipeline sent to every worker. Pass a function that builds "
            "a tf.data.Dataset from files (e.g. TFRecord) instead.")
    count = len(flat[0])
    batch_size = 32 if batch_size is None else batch_size
    _check_count("batch_size", batch_size, minimum=1)
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if shuffle:
        dataset = dataset.shuffle(count, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size).repeat()
    return dataset, dataset.element_spec, math.ceil(count / batch_size)


# -- serving: the ps and worker tasks --------------------------------------------------------------

def serve(cluster=None, inter_op_threads=None):
    """Run this process's ps or worker task until it is killed (the cluster from TF_CONFIG by default)."""
    import tensorflow as tf

    cluster = cluster or kerasdist.detect_cluster()
    if cluster.is_local or cluster.task_type not in SERVING_JOBS or not cluster.has_parameter_servers:
        raise ClusterConfigError(
            f"ps serve: this process is not a ps or worker task of a parameter-server cluster (task "
            f"{cluster.task_type}:{cluster.task_index}, jobs {sorted(cluster.cluster) or 'none'}, source "
            f"{cluster.source}). Set TF_CONFIG, e.g. {{\"cluster\": {{\"worker\": [\"h1:2222\"], \"ps\": "
            "[\"h2:2222\"], \"chief\": [\"h0:2222\"]}, \"task\": {\"type\": \"ps\", \"index\": 0}}.")
    jobs = {job: list(cluster.cluster[job]) for job in SERVING_JOBS}
    config = tf.compat.v1.ConfigProto()
    # A worker blocks an inter-op thread while a step waits for variables: never run with just one.
    config.inter_op_parallelism_threads = max(2, inter_op_threads or os.cpu_count() or 2)
    server = tf.distribute.Server(tf.train.ClusterSpec(jobs), job_name=cluster.task_type,
                                  task_index=cluster.task_index, protocol=cluster.rpc_layer or "grpc",
                                  config=config, start=True)
    print(f"kerasdist ps: serving {cluster.task_type} {cluster.task_index} at "
          f"{jobs[cluster.task_type][cluster.task_index]}", flush=True)
    server.join()


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kerasdist_plugins.ps",
        description="Serve this process's ps or worker task of a parameter-server cluster (from TF_CONFIG).")
    parser.add_argument("--inter-op-threads", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        serve(inter_op_threads=args.inter_op_threads)
    except KerasdistError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
