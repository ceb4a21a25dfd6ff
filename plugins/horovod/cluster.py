"""Which launcher started this process (horovodrun, mpirun), read from its environment."""

import importlib.util

import kerasdist
from kerasdist.plugin_tools import number_from_env

_LAUNCH_VARS = (  # (rank, size, local rank, local size, launcher)
    ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "horovodrun"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpirun"),
)


def detect(environ):
    """The :class:`kerasdist.ClusterInfo` of a Horovod launch, or None."""
    for rank_var, size_var, local_rank_var, local_size_var, launcher in _LAUNCH_VARS:
        if rank_var not in environ:
            continue
        if launcher != "horovodrun" and ("TF_CONFIG" in environ or importlib.util.find_spec("horovod") is None):
            return None  # an MPI launch, but not a Horovod one
        rank, size = _int_var(environ, rank_var), _int_var(environ, size_var, default=1)
        if not 0 <= rank < size:
            raise kerasdist.ClusterConfigError(
                f"{rank_var}={rank} is not a rank of {size_var}={size}: the launcher's environment "
                "is inconsistent; start the job with `horovodrun -np N python script.py`.")
        extra = {"size": size, "launcher": launcher,
                 "local_rank": _int_var(environ, local_rank_var, default=0),
                 "local_size": _int_var(environ, local_size_var, default=1)}
        return kerasdist.ClusterInfo(task_type="worker", task_index=rank,
                                     cluster={"worker": [f"horovod-rank-{i}" for i in range(size)]},
                                     source="horovod", extra=extra)
    return None


def _int_var(environ, name, default=None):
    try:
        return number_from_env(environ, name, int, default)
    except kerasdist.ClusterConfigError as exc:
        raise kerasdist.ClusterConfigError(f"{exc} It is set by horovodrun/mpirun: do not set it by hand.") from None
