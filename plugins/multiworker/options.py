"""The multiworker spec, its environment variables and its option checks."""

import dataclasses
from typing import Optional

import kerasdist
from kerasdist import ClusterConfigError, KerasdistError
from kerasdist.plugin_tools import number_from_env, private_backups

COMMUNICATION_VAR = "KERASDIST_COMMUNICATION"
BYTES_PER_PACK_VAR = "KERASDIST_BYTES_PER_PACK"
COLLECTIVE_TIMEOUT_VAR = "KERASDIST_COLLECTIVE_TIMEOUT"
JOIN_TIMEOUT_VAR = "KERASDIST_JOIN_TIMEOUT"
#: "off": communication "auto" keeps the TCP ring on CPU workers without measuring it against TensorFlow's.
PROBE_VAR = "KERASDIST_TRANSPORT_PROBE"
BACKUP_DIR_VAR = "KERASDIST_BACKUP_DIR"
#: "on": train under the default strategy, gradients over the TCP ring in one message per step (issue 22).
STRATEGY_FREE_VAR = "KERASDIST_STRATEGY_FREE"
#: Parent of non-chief workers' temporary write directories (kerasdist launch removes it at the end).
SCRATCH_DIR_VAR = private_backups.SCRATCH_DIR_VAR
DEFAULT_JOIN_TIMEOUT = 300.0
_COMMUNICATIONS = ("auto", "tcp", "ring", "nccl")
_SHARD_POLICIES = ("auto", "data", "file", "off")



@dataclasses.dataclass
class MultiWorker(kerasdist.StrategySpec):
    """``tf.distribute.MultiWorkerMirroredStrategy`` over the detected cluster.

    Collective options are fixed when the process joins the cluster (at
    ``import kerasdist``), so they are read from the environment there
    (``KERASDIST_COMMUNICATION``, ``KERASDIST_BYTES_PER_PACK``,
    ``KERASDIST_COLLECTIVE_TIMEOUT``; ``kerasdist launch`` sets them from its
    flags). Giving different values here is an error.

    :param communication: "auto" (when every worker trains on one CPU device, kerasdist's TCP
        ring or TensorFlow's collectives, whichever a short probe at the first ``fit``/``evaluate`` finds
        faster for a gradient-sized all-reduce, rank 0 deciding for all; ``KERASDIST_TRANSPORT_PROBE=off``
        skips the probe and keeps the ring; on GPUs TensorFlow's choice), "tcp" (always the TCP
        ring, no probe: gradients and per-step logs over plain sockets, the rest over TensorFlow's
        collectives), "ring" (TensorFlow's gRPC ring for everything) or "nccl" (GPUs).
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
    :param sync_batch_norm: BatchNormalization statistics over the whole global batch (one
        all-reduce over TensorFlow's collectives per layer and step); off by default.
    """

    communication: Optional[str] = None
    bytes_per_pack: Optional[int] = None
    timeout_seconds: Optional[float] = None
    shard_policy: str = "auto"
    backup: bool = True
    backup_dir: Optional[str] = None
    sync_batch_norm: bool = False
    shuffle_seed: int = 1337


@dataclasses.dataclass(frozen=True)
class CollectiveOptions:
    """The options a strategy was created with."""

    communication: str = "auto"
    bytes_per_pack: int = 0
    timeout_seconds: Optional[float] = None
    probe: bool = True  # "auto" measures the TCP ring against TensorFlow's collectives

    @classmethod
    def from_env(cls, environ):
        communication = environ.get(COMMUNICATION_VAR, "auto").strip().lower() or "auto"
        if communication not in _COMMUNICATIONS:
            raise ClusterConfigError(f"{COMMUNICATION_VAR}={communication!r} is not valid; choose one of "
                                     f"{', '.join(_COMMUNICATIONS)}.")
        probe = environ.get(PROBE_VAR, "on").strip().lower() or "on"
        if probe not in ("on", "off"):
            raise ClusterConfigError(f"{PROBE_VAR}={probe!r} is not valid; choose on (communication auto measures "
                                     "the TCP ring against TensorFlow's collectives, the default) or off (auto "
                                     "keeps the ring on CPU workers unmeasured).")
        return cls(communication, number_from_env(environ, BYTES_PER_PACK_VAR, int, 0),
                   number_from_env(environ, COLLECTIVE_TIMEOUT_VAR, float, None), probe == "on")

    def tf_options(self):
        import tensorflow as tf

        implementation = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                          "tcp": tf.distribute.experimental.CommunicationImplementation.AUTO,
                          "ring": tf.distribute.experimental.CommunicationImplementation.RING,
                          "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.bytes_per_pack, timeout_seconds=self.timeout_seconds,
            implementation=implementation[self.communication])





def check_spec(spec):
    if spec.communication is not None and spec.communication.lower() not in _COMMUNICATIONS:
        raise KerasdistError(f"multiworker: communication={spec.communication!r} is not valid; choose one of "
                             f"{', '.join(_COMMUNICATIONS)}.")
    if spec.shard_policy.lower() not in _SHARD_POLICIES:
        raise KerasdistError(f"multiworker: shard_policy={spec.shard_policy!r} is not valid; choose one of "
                             f"{', '.join(_SHARD_POLICIES)}.")


def check_options_match(spec, options):
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
