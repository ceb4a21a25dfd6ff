"""What a process knows about the cluster it belongs to."""

import dataclasses


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
