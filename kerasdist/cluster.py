"""What a process knows about the cluster it belongs to."""

import dataclasses
import importlib.metadata

#: Entry-point group in which plugins declare the environment variables that mean "this process is
#: part of a cluster" (entry name = variable, value = the plugin reading it). Read from package
#: metadata, so ``import kerasdist`` loads plugins early only when one of these is set.
CLUSTER_HINT_GROUP = "kerasdist.cluster_hints"
#: kerasdist's own hint, for clusters that a third-party plugin detects by other means.
GENERIC_CLUSTER_HINT = "KERASDIST_CLUSTER"
#: Step ids Slurm gives to steps that are not an srun's tasks (the batch script 0xfffffffe, extern, interactive...).
SLURM_FIRST_SPECIAL_STEP_ID = 0xFFFFFFF0


def cluster_hint_variables():
    """The environment variable names that make ``import kerasdist`` detect a cluster."""
    names = {ep.name for ep in importlib.metadata.entry_points(group=CLUSTER_HINT_GROUP)}
    return sorted(names | {GENERIC_CLUSTER_HINT})


def slurm_step_tasks(environ):
    """How many tasks the srun step this process runs in has: 0 outside one (no ``SLURM_STEP_NUM_TASKS``, or
    the batch script's, extern or another special step). A count that is not a whole number is a
    :class:`kerasdist.ClusterConfigError`."""
    count = environ.get("SLURM_STEP_NUM_TASKS", "").strip()
    step = environ.get("SLURM_STEP_ID", "").strip()
    if not count or (step.isdigit() and int(step) >= SLURM_FIRST_SPECIAL_STEP_ID):
        return 0
    if not count.isdigit():
        from .errors import ClusterConfigError

        raise ClusterConfigError(f"Slurm: SLURM_STEP_NUM_TASKS={count!r} is not a whole number.")
    return int(count)


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """A resolved cluster: ``cluster`` maps job names to ``host:port`` lists."""

    task_type: str = "worker"
    task_index: int = 0
    cluster: dict = dataclasses.field(default_factory=dict)
    source: str = "local"
    rpc_layer: str = "grpc"
    extra: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def local(cls):
        return cls()

    @property
    def is_local(self):
        return self.source == "local"

    @property
    def num_workers(self):
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ())) or 1

    @property
    def has_parameter_servers(self):
        return bool(self.cluster.get("ps"))

    @property
    def is_chief(self):
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    def as_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LaunchWorker:
    """One worker of ``kerasdist launch``, as ``kerasdist_launch_environment`` sees it."""

    index: int
    count: int
    host: str
    addresses: tuple  # one "host:port" per worker, free when the launcher picked them

    @property
    def address(self):
        return self.addresses[self.index]
