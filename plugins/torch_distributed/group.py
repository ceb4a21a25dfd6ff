"""The torch.distributed process group behind distribute="data_parallel" on PyTorch, and its strategy object.

Where the ranks come from, first that applies: a process group the user already initialised; torchrun's
(or ``kerasdist launch``'s) RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; a TF_CONFIG or Slurm cluster
detected by kerasdist (rank = task order, chief first; the rendezvous on the first task's address). One
process alone is a group of one (no collective runs). gloo on CPU, NCCL when CUDA is available.
"""

import contextlib
import datetime
import os

from kerasdist import ClusterConfigError
from kerasdist.plugin_tools import number_from_env, port_is_free, split_address

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: The torch.distributed backends a spec may name (None: gloo on CPU, NCCL with CUDA).
TORCH_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


class TorchDataParallel:
    """What ``compile(distribute="data_parallel")`` runs under on PyTorch: one replica per process.

    ``scope()`` places nothing (every process holds every weight); ``num_replicas_in_sync`` is the world size."""

    def __init__(self, rank, world_size, local_rank, backend, device):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.backend, self.device = backend, device

    @property
    def num_replicas_in_sync(self):
        return self.world_size

    @property
    def is_chief(self):
        return self.rank == 0

    def scope(self):
        return contextlib.nullcontext()

    def __repr__(self):
        return (f"TorchDataParallel(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device!r})")


def torchrun_ranks(environ):
    """``(rank, world_size, local_rank, master_host, master_port)`` from torchrun's variables, or None when
    they are not all set; a bad value raises :class:`kerasdist.ClusterConfigError` naming it."""
    if not all(environ.get(name) for name in TORCHRUN_VARIABLES):
        return None
    rank = number_from_env(environ, "RANK", int)
    world = number_from_env(environ, "WORLD_SIZE", int, minimum=1)
    port = number_from_env(environ, "MASTER_PORT", int, minimum=1, maximum=65535)
    if rank >= world:
        raise ClusterConfigError(f"RANK={rank} is not below WORLD_SIZE={world}; give each process a rank "
                                 f"in 0..{world - 1} (torchrun and kerasdist launch do).")
    local = number_from_env(environ, "LOCAL_RANK", int, default=rank)
    return rank, world, local, environ["MASTER_ADDR"], port


def ranks_from(cluster, environ):
    """``(rank, world_size, local_rank, master_host, master_port)`` of this process, or None for one process."""
    found = torchrun_ranks(environ)
    if found is not None:
        return found
    if cluster is None or cluster.is_local or cluster.has_parameter_servers:
        return None
    tasks = list(cluster.cluster.get("chief", ())) + list(cluster.cluster.get("worker", ()))
    if len(tasks) < 2:
        return None
    rank = (0 if cluster.task_type == "chief" else cluster.task_index + len(cluster.cluster.get("chief", ())))
    host, port = split_address(tasks[0], "the first task's address")
    local = number_from_env(environ, "SLURM_LOCALID", int, default=0) if cluster.source == "slurm" else rank
    return rank, len(tasks), local, host, port


def join(cluster, backend=None, timeout_s=300.0, environ=None):
    """The process group of this job (initialised here unless the user did), as a :class:`TorchDataParallel`."""
    import torch
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dist.is_available() and dist.is_initialized():
        local = number_from_env(environ, "LOCAL_RANK", int, default=dist.get_rank())
        return TorchDataParallel(dist.get_rank(), dist.get_world_size(), local, dist.get_backend(), device)
    found = ranks_from(cluster, environ)
    if found is None:
        return TorchDataParallel(0, 1, 0, None, device)
    rank, world, local, host, port = found
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(local % torch.cuda.device_count())  # one GPU per process
    if rank == 0 and not environ.get("TORCHELASTIC_RUN_ID") and not port_is_free(port, host):
        raise ClusterConfigError(
            f"data_parallel (torch): the rendezvous port {port} on {host} is already in use, so rank 0 cannot "
            "serve torch.distributed's store there; give a free MASTER_PORT (or leave the ports to `kerasdist "
            "launch` / torchrun), or stop what listens on it.")
    try:
        # torchrun's agent serves the store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): env:// finds it
        init = "env://" if environ.get("TORCHELASTIC_RUN_ID") else f"tcp://{_host(host)}:{port}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:
        raise ClusterConfigError(
            f"data_parallel (torch): rank {rank} of {world} could not join the process group at {host}:{port} "
            f"(backend {backend!r}, timeout {timeout_s:g} s): {type(exc).__name__}: {exc}. Start every process "
            "with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE (torchrun and kerasdist launch do).") from exc
    return TorchDataParallel(rank, world, local, backend, device)


def _host(host):
    return f"[{host}]" if ":" in host else host

