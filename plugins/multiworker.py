"""distribute="multiworker": synchronous data parallelism across processes and machines.

Each process gets a cluster (TF_CONFIG, Slurm; see ``cluster_env``). At ``import
kerasdist`` the process joins the cluster and creates its
``tf.distribute.MultiWorkerMirroredStrategy`` (collective ops can only be set up
before TensorFlow runs an op); ``compile(distribute="multiworker")`` uses it.
Only the chief writes progress, checkpoints and TensorBoard events, and
``BackupAndRestore`` is on by default so that a relaunch resumes training.
"""

import atexit
import contextlib
import dataclasses
import hashlib
import os
import shutil
import socket
import sys
import tempfile
from typing import Optional

import keras

import kerasdist
from kerasdist import ClusterConfigError, KerasdistError

COMMUNICATION_VAR = "KERASDIST_COMMUNICATION"
BYTES_PER_PACK_VAR = "KERASDIST_BYTES_PER_PACK"
COLLECTIVE_TIMEOUT_VAR = "KERASDIST_COLLECTIVE_TIMEOUT"
JOIN_TIMEOUT_VAR = "KERASDIST_JOIN_TIMEOUT"
BACKUP_DIR_VAR = "KERASDIST_BACKUP_DIR"
#: Parent of non-chief workers' temporary write directories (kerasdist launch removes it at the end).
SCRATCH_DIR_VAR = "KERASDIST_SCRATCH_DIR"
DEFAULT_JOIN_TIMEOUT = 300.0
_COMMUNICATIONS = ("auto", "tcp", "ring", "nccl")
#: How long workers wait for each other while connecting the gradient ring.
RING_CONNECT_TIMEOUT = 60.0
_SHARD_POLICIES = ("auto", "data", "file", "off")


@dataclasses.dataclass
class MultiWorker(kerasdist.StrategySpec):
    """``tf.distribute.MultiWorkerMirroredStrategy`` over the detected cluster.

    Collective options are fixed when the process joins the cluster (at
    ``import kerasdist``), so they are read from the environment there
    (``KERASDIST_COMMUNICATION``, ``KERASDIST_BYTES_PER_PACK``,
    ``KERASDIST_COLLECTIVE_TIMEOUT``; ``kerasdist launch`` sets them from its
    flags). Giving different values here is an error.

    :param communication: "auto" (kerasdist's TCP ring when every worker trains on one CPU
        device, else TensorFlow's choice), "tcp" (always the TCP ring: gradients and per-step
        logs over plain sockets, the rest over TensorFlow's collectives), "ring" (TensorFlow's
        gRPC ring for everything) or "nccl" (GPUs).
    :param bytes_per_pack: pack gradients into all-reduces of about this size (0: one pack).
    :param timeout_seconds: abort a collective that takes longer (None: no limit).
    :param shard_policy: how a ``tf.data.Dataset`` is split across workers: "auto"
        (by file when it reads files, else by element), "data", "file" or "off".
    :param backup: keep a ``BackupAndRestore`` backup so a relaunch resumes from the
        last completed epoch (set False to opt out).
    :param backup_dir: where (must be visible to every worker); default
        ``$KERASDIST_BACKUP_DIR`` or a directory under the system temp dir named
        after the script.
    :param shuffle_seed: seed shared by all workers when fit shuffles numpy inputs.
    """

    communication: Optional[str] = None
    bytes_per_pack: Optional[int] = None
    timeout_seconds: Optional[float] = None
    shard_policy: str = "auto"
    backup: bool = True
    backup_dir: Optional[str] = None
    shuffle_seed: int = 1337


@dataclasses.dataclass(frozen=True)
class CollectiveOptions:
    """The options a strategy was created with."""

    communication: str = "auto"
    bytes_per_pack: int = 0
    timeout_seconds: Optional[float] = None

    @classmethod
    def from_env(cls, environ):
        communication = environ.get(COMMUNICATION_VAR, "auto").strip().lower() or "auto"
        if communication not in _COMMUNICATIONS:
            raise ClusterConfigError(f"{COMMUNICATION_VAR}={communication!r} is not valid; choose one of "
                                     f"{', '.join(_COMMUNICATIONS)}.")
        return cls(communication, _number(environ, BYTES_PER_PACK_VAR, int, 0),
                   _number(environ, COLLECTIVE_TIMEOUT_VAR, float, None))

    def tf_options(self):
        import tensorflow as tf

        implementation = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                          "tcp": tf.distribute.experimental.CommunicationImplementation.AUTO,
                          "ring": tf.distribute.experimental.CommunicationImplementation.RING,
                          "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.bytes_per_pack, timeout_seconds=self.timeout_seconds,
            implementation=implementation[self.communication])


def _number(environ, name, kind, default):
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ClusterConfigError(f"{name}={value!r} is not valid: give a number >= 0.")
    return number


# -- registration and choice -----------------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("multiworker", MultiWorker, aliases=("multi_worker", "multi-worker"),
             description="Synchronous data parallelism across processes/machines over gRPC collectives "
                         "(tf.distribute.MultiWorkerMirroredStrategy); cluster from TF_CONFIG or Slurm, "
                         "or start local workers with `kerasdist launch -n N`.")


def is_worker_cluster(cluster):
    """A cluster multiworker can train on: chief/worker tasks, no parameter servers."""
    return (not cluster.is_local and not cluster.has_parameter_servers
            and cluster.source in ("tf_config", "slurm")
            and cluster.task_type in ("chief", "worker"))


@kerasdist.hookimpl
def kerasdist_auto_strategy(cluster):
    return "multiworker" if is_worker_cluster(cluster) else None


# -- process start: join the cluster before any TensorFlow op -------------------------

class _Started:
    strategy = None
    options = None
    cluster = None
    error = None
    ring = None  # the TcpRing, False when the workers agreed on TensorFlow's collectives


@kerasdist.hookimpl
def kerasdist_process_start(cluster, environ):
    if not is_worker_cluster(cluster):
        return
    options = CollectiveOptions.from_env(environ)
    join_timeout = _number(environ, JOIN_TIMEOUT_VAR, float, DEFAULT_JOIN_TIMEOUT)
    _Started.cluster, _Started.options = cluster, options
    try:
        _Started.strategy = join_cluster(cluster, options, join_timeout)
    except _TooLate as exc:
        _Started.error = exc


class _TooLate(KerasdistError):
    pass


def join_cluster(cluster, options, join_timeout):
    """Create the MultiWorkerMirroredStrategy: starts this task's gRPC server and waits for the others."""
    import tensorflow as tf

    from kerasdist import _keras_internals as internals

    if internals.tf_context_initialized():
        raise _TooLate(
            "distribute='multiworker': TensorFlow already ran an operation before kerasdist could set up "
            "collective ops for the cluster. Put `import kerasdist` before any TensorFlow/Keras code that "
            "runs an op (building a model, creating a tensor), e.g. as the script's first import.")
    own = cluster.cluster[cluster.task_type][cluster.task_index]
    check_port_free(own, f"{cluster.task_type} {cluster.task_index}")
    spec = tf.train.ClusterSpec(cluster.cluster)
    internals.configure_coordination(spec, join_timeout)
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
    internals.install_multiworker_fit_fixes()
    return strategy


def check_port_free(address, who):
    """Raise ClusterConfigError when this task's port is already taken."""
    from kerasdist.launch import port_is_free

    port = int(address.rsplit(":", 1)[1])
    if not port_is_free(port):
        raise ClusterConfigError(
            f"Port {port} of {who} ({address}) is already in use by another process, so this worker "
            "cannot start its gRPC server. Stop that process or give the task a free port "
            "(`kerasdist launch` picks free ports).")


def _unreachable(cluster):
    down = []
    for job, addresses in cluster.cluster.items():
        for index, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    pass
            except OSError:
                down.append(f"{job} {index} ({address})")
    return down


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


# -- compile -----------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_create_strategy(spec, cluster):
    if not isinstance(spec, MultiWorker):
        return None
    _check_spec(spec)
    if _Started.error is not None:
        raise _Started.error
    if _Started.strategy is None:
        if cluster.is_local:
            raise ClusterConfigError(
                "distribute='multiworker' needs a cluster, and none was found: set TF_CONFIG in each worker, "
                "run under Slurm's srun, or start the workers with `kerasdist launch -n N script.py`.")
        if not is_worker_cluster(cluster):
            raise ClusterConfigError(
                f"distribute='multiworker' cannot run on this cluster ({cluster.source}, task "
                f"{cluster.task_type}, jobs {sorted(cluster.cluster)}): it needs chief/worker tasks and no "
                "'ps' job (parameter servers take a different strategy).")
        _Started.cluster = cluster
        _Started.options = CollectiveOptions.from_env(os.environ)
        _Started.strategy = join_cluster(cluster, _Started.options,
                                         _number(os.environ, JOIN_TIMEOUT_VAR, float, DEFAULT_JOIN_TIMEOUT))
    _check_options_match(spec, _Started.options)
    return _Started.strategy


def _check_spec(spec):
    if spec.communication is not None and spec.communication.lower() not in _COMMUNICATIONS:
        raise KerasdistError(f"multiworker: communication={spec.communication!r} is not valid; choose one of "
                             f"{', '.join(_COMMUNICATIONS)}.")
    if spec.shard_policy.lower() not in _SHARD_POLICIES:
        raise KerasdistError(f"multiworker: shard_policy={spec.shard_policy!r} is not valid; choose one of "
                             f"{', '.join(_SHARD_POLICIES)}.")


def _check_options_match(spec, options):
    wanted = {"communication": (spec.communication and spec.communication.lower(), COMMUNICATION_VAR),
              "bytes_per_pack": (spec.bytes_per_pack, BYTES_PER_PACK_VAR),
              "timeout_seconds": (spec.timeout_seconds, COLLECTIVE_TIMEOUT_VAR)}
    for field, (value, var) in wanted.items():
        actual = getattr(options, field)
        if value is not None and value != actual:
            raise ClusterConfigError(
                f"multiworker: {field}={value!r} differs from {actual!r}, the value the cluster was joined "
                f"with at `import kerasdist` (collective ops cannot be reconfigured later). Set {var}={value} "
                f"in every worker's environment instead (kerasdist launch --{field.replace('_', '-')} {value}).")


# -- fit / evaluate / predict --------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_prepare_dataset(dataset, spec):
    if not isinstance(spec, MultiWorker) or spec.shard_policy.lower() == "auto":
        return None
    import tensorflow as tf

    policy = {"data": tf.data.experimental.AutoShardPolicy.DATA,
              "file": tf.data.experimental.AutoShardPolicy.FILE,
              "off": tf.data.experimental.AutoShardPolicy.OFF}[spec.shard_policy.lower()]
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, strategy, spec):
    if not isinstance(spec, MultiWorker):
        return
    if method in ("fit", "evaluate"):
        _use_ring(model, strategy, method)
    chief = bool(strategy.extended.should_checkpoint)
    if method == "fit":
        index = _count_fit()
        _shuffle_arrays_alike(call_kwargs, spec.shuffle_seed + index)
        if spec.backup:
            _add_backup(call_kwargs, _backup_dir(spec, strategy, index), chief)
    if not chief:
        if call_kwargs.get("verbose", "auto") != 0:
            call_kwargs["verbose"] = 0
        if method == "fit":  # the paths are given back at the end of training
            _redirect_writes(call_kwargs, _scratch_dir())


# -- the gradient ring -------------------------------------------------------------

def _use_ring(model, strategy, method):
    """Send this model's gradients and logs over the TCP ring, when the workers agreed on one."""
    from kerasdist import _keras_internals as internals

    if _Started.ring is None:
        _Started.ring = agree_on_ring(strategy, _Started.cluster, _Started.options) or False
    ring = _Started.ring
    internals.set_log_summer(strategy, ring.size if ring else 0, ring.sum_tensors if ring else None)
    if method == "fit":
        # an XLA-compiled step cannot call back into Python: it keeps TensorFlow's all-reduce
        use = ring and not model.jit_compile
        internals.route_gradient_all_reduce(model.optimizer, strategy, ring.sum_tensors if use else None)


def gradient_transport():
    """How this process's multiworker gradients travel: "tcp" (kerasdist's ring), "tensorflow"
    (TensorFlow's collectives), or None before the first ``fit``/``evaluate`` decided it."""
    if _Started.ring is None:
        return None
    return "tcp" if _Started.ring else "tensorflow"


def agree_on_ring(strategy, cluster, options):
    """Connect the workers' TCP ring, or agree on TensorFlow's collectives; every worker runs this
    at the same point (it runs two collectives), and all of them reach the same answer.

    Each worker offers "<its communication setting>|<its ring address>", with "!why" in place of the
    address when it will not use the ring (settings, GPUs) and "?why" when it cannot (sockets).
    """
    from kerasdist import tcp_ring

    listener, offer = None, _ring_refusal(strategy, options)
    if offer is None:
        host, _ = tcp_ring.split_address(cluster.cluster[cluster.task_type][cluster.task_index])
        try:
            listener, offer = tcp_ring.listen(host)
        except OSError as exc:
            offer = f"?cannot listen on {host}: {exc}"
    offers, rank = _all_gather_text(strategy, f"{options.communication}|{offer}")
    settings = [text.split("|", 1)[0] for text in offers]
    offers = [text.split("|", 1)[1] for text in offers]
    ring = None
    if _refusals(offers):
        if listener is not None:
            listener.close()
    else:
        outcome = "ok"
        try:
            ring = tcp_ring.TcpRing.connect(listener, offers, rank, timeout=options.timeout_seconds,
                                            connect_timeout=RING_CONNECT_TIMEOUT)
        except (OSError, tcp_ring.RingError) as exc:
            outcome = f"?cannot connect the ring: {exc}"
        offers, _ = _all_gather_text(strategy, outcome)
    refusals = _refusals(offers)
    if not refusals:
        return ring
    if ring is not None:
        ring.close()
    why = "; ".join(f"worker {i}: {text[1:]}" for i, text in refusals)
    if "tcp" in settings:
        demanding = ", ".join(str(i) for i, setting in enumerate(settings) if setting == "tcp")
        raise ClusterConfigError(
            f"{COMMUNICATION_VAR}=tcp (worker {demanding}) asks for the TCP gradient ring, which cannot run "
            f"({why}). Give every worker the same {COMMUNICATION_VAR}: auto (the ring when it can run) or "
            "ring (TensorFlow's collectives).")
    if any(text.startswith("?") for _, text in refusals) and strategy.extended.should_checkpoint:
        print(f"kerasdist: multiworker uses TensorFlow's collectives instead of the TCP ring ({why})",
              file=sys.stderr, flush=True)
    return None


def _refusals(offers):
    return [(i, text) for i, text in enumerate(offers) if text[:1] in ("!", "?")]


def _ring_refusal(strategy, options):
    """Why this worker cannot (or is told not to) use the TCP ring, as "!reason", or None."""
    if options.communication not in ("auto", "tcp"):
        return f"!{COMMUNICATION_VAR}={options.communication}"
    devices = strategy.extended.worker_devices
    if len(devices) != 1:
        return f"!{len(devices)} local replicas"
    if "CPU" not in devices[0].upper():
        return f"!trains on {devices[0]} (GPU: TensorFlow's collectives are faster there)"
    return None


_TEXT_WIDTH = 512


def _all_gather_text(strategy, text):
    """Every worker's ``text`` (in replica order) and this worker's replica index."""
    import numpy as np
    import tensorflow as tf

    codes = np.zeros(_TEXT_WIDTH, np.int32)
    raw = text.encode()[:_TEXT_WIDTH]
    codes[:len(raw)] = list(raw)

    @tf.function
    def gather():
        def each_replica():
            context = tf.distribute.get_replica_context()
            return context.all_gather(tf.constant(codes)[None], axis=0), context.replica_id_in_sync_group

        return strategy.run(each_replica)

    table, rank = (strategy.experimental_local_results(v)[0] for v in gather())
    texts = [bytes(int(c) for c in row if c).decode(errors="replace") for row in table.numpy()]
    return texts, int(rank)


_fits = [0]


def _count_fit():
    """The index of this fit call in this process (the same on every worker)."""
    _fits[0] += 1
    return _fits[0] - 1


def _backup_dir(spec, strategy, fit_index):
    """Where the backup lives: the same path on every worker and on every relaunch."""
    if spec.backup_dir:
        return spec.backup_dir
    root = os.environ.get(BACKUP_DIR_VAR)
    if root:
        return os.path.join(root, f"fit{fit_index}")
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "interactive"
    key = "\0".join([script, *sys.argv[1:], str(strategy.num_replicas_in_sync), str(fit_index)])
    name = f"{os.path.splitext(os.path.basename(script))[0]}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    return os.path.join(tempfile.gettempdir(), f"kerasdist-backup-{_user()}", name)


def _user():
    try:
        return str(os.getuid())
    except AttributeError:  # Windows
        return os.environ.get("USERNAME", "user")


def _add_backup(call_kwargs, backup_dir, chief):
    """BackupAndRestore first in the list (the user's own, if given); non-chief workers
    restore from the shared backup but write theirs to a scratch directory."""
    from kerasdist import _keras_internals as internals

    callbacks = call_kwargs["callbacks"]
    mine = [cb for cb in callbacks if isinstance(cb, keras.callbacks.BackupAndRestore)]
    if mine:
        if chief:
            return
        user = mine[0]
        replacement = internals.make_chief_aware_backup(
            internals.backup_dir_of(user), os.path.join(_scratch_dir(), "backup"), save_freq=user.save_freq,
            double_checkpoint=user.double_checkpoint, delete_checkpoint=user.delete_checkpoint)
        callbacks[callbacks.index(user)] = replacement
        return
    if chief:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(backup_dir))
    else:
        callbacks.insert(0, internals.make_chief_aware_backup(backup_dir, os.path.join(_scratch_dir(), "backup")))


#: Callback attributes naming where a callback writes; non-chief workers write under scratch.
_WRITE_ATTRIBUTES = (("ModelCheckpoint", "filepath"), ("TensorBoard", "log_dir"), ("CSVLogger", "filename"))


def _redirect_writes(call_kwargs, scratch):
    changed = []
    for number, callback in enumerate(call_kwargs["callbacks"]):
        for class_name, attribute in _WRITE_ATTRIBUTES:
            if isinstance(callback, getattr(keras.callbacks, class_name)):
                original = getattr(callback, attribute)
                parent = os.path.join(scratch, f"{number}-{class_name}")
                os.makedirs(parent, exist_ok=True)
                target = os.path.join(parent, os.path.basename(str(original).rstrip("/\\")))
                setattr(callback, attribute, target)
                changed.append((callback, attribute, original))
    if changed:
        call_kwargs["callbacks"].append(_RestoreWrites(changed, scratch))


class _RestoreWrites(keras.callbacks.Callback):
    """Last callback of a non-chief fit: give callbacks their paths back, drop their files."""

    def __init__(self, changed, scratch):
        super().__init__()
        self.changed, self.scratch = changed, scratch

    def on_train_end(self, logs=None):
        for callback, attribute, original in self.changed:
            setattr(callback, attribute, original)
        for name in os.listdir(self.scratch):
            if name != "backup":
                shutil.rmtree(os.path.join(self.scratch, name), ignore_errors=True)


def _shuffle_arrays_alike(call_kwargs, seed):
    """Keras shuffles numpy inputs with an unseeded op, so workers would each take a
    different permutation and the element-wise shard would repeat some examples and
    drop others. Feed arrays through a tf.data pipeline shuffled with one shared seed."""
    import numpy as np

    x = call_kwargs.get("x")
    shuffle = call_kwargs.get("shuffle", True)
    if not shuffle or not _all_arrays(x) or not _all_arrays(call_kwargs.get("y"), allow_none=True) \
            or not _all_arrays(call_kwargs.get("sample_weight"), allow_none=True):
        return
    import tensorflow as tf

    parts = [p for p in (x, call_kwargs.get("y"), call_kwargs.get("sample_weight")) if p is not None]
    split = float(call_kwargs.get("validation_split") or 0.0)
    if split and call_kwargs.get("validation_data") is None:
        count = len(_first_array(x))
        at = int(np.floor(count * (1.0 - split)))
        call_kwargs["validation_data"] = tuple(_slice(p, at, None) for p in parts)
        parts = [_slice(p, 0, at) for p in parts]
    count = len(_first_array(parts[0]))
    # tf.data reads a Python list as one tensor: lists of arrays (multi-input/output) must be tuples.
    dataset = tf.data.Dataset.from_tensor_slices(tuple(keras.tree.lists_to_tuples(p) for p in parts))
    dataset = dataset.shuffle(count, seed=seed, reshuffle_each_iteration=True)
    batch_size = call_kwargs.get("batch_size") or 32
    call_kwargs.update(x=dataset.batch(batch_size), y=None, sample_weight=None, batch_size=None,
                       shuffle=False, validation_split=0.0)


def _all_arrays(value, allow_none=False):
    import numpy as np

    if value is None:
        return allow_none
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, (list, tuple)) and value:
        return all(isinstance(v, np.ndarray) for v in value)
    if isinstance(value, dict) and value:
        return all(isinstance(v, np.ndarray) for v in value.values())
    return False


def _first_array(value):
    if isinstance(value, dict):
        return next(iter(value.values()))
    if isinstance(value, (list, tuple)):
        return value[0]
    return value


def _slice(value, start, stop):
    if isinstance(value, dict):
        return {k: v[start:stop] for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(v[start:stop] for v in value)
    return value[start:stop]


_scratch = []


def _scratch_dir():
    """A per-process temporary directory for a non-chief worker's writes, removed at exit."""
    if not _scratch:
        root = os.environ.get(SCRATCH_DIR_VAR) or None
        if root:
            os.makedirs(root, exist_ok=True)
        _scratch.append(tempfile.mkdtemp(prefix="kerasdist-worker-", dir=root))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return _scratch[0]
