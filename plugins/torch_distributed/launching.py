"""torchrun's variables as a kerasdist cluster, and the same variables for ``kerasdist launch``'s workers.

torchrun (and ``torch.distributed.launch``, TorchX, Kubeflow's PyTorchJob) give each process RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK. A TF_CONFIG or a Slurm step is left to the cluster_env
plugin (its ranks are mapped in group.py), so a process that has both is read one way only.
"""

from kerasdist import ClusterInfo
from kerasdist.plugin_tools import keras_backend, number_from_env, split_address

from .group import TORCHRUN_VARIABLES

#: What torchrun sets (cluster hints: ``kerasdist launch`` removes them from its own environment).
HINTS = TORCHRUN_VARIABLES + ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def detect(environ):
    """A :class:`kerasdist.ClusterInfo` (source "torchrun") from torchrun's variables, else None."""
    if environ.get("TF_CONFIG", "").strip() or "SLURM_PROCID" in environ:
        return None
    if not all(environ.get(name) for name in TORCHRUN_VARIABLES):
        return None
    rank = number_from_env(environ, "RANK", int)
    world = number_from_env(environ, "WORLD_SIZE", int, minimum=1)
    port = number_from_env(environ, "MASTER_PORT", int, minimum=1, maximum=65535)
    if world < 2:
        return None
    rendezvous = f"{environ['MASTER_ADDR']}:{port}"
    return ClusterInfo(task_type="worker", task_index=rank, cluster={"worker": [rendezvous] * world},
                       source="torchrun", extra={"rendezvous": rendezvous, "world_size": world,
                                                 "local_rank": number_from_env(environ, "LOCAL_RANK", int,
                                                                               default=rank)})


def launch_environment(worker, environ):
    """torchrun's variables for every ``kerasdist launch`` worker (the launcher cannot know which backend the
    script picks; TensorFlow and JAX read TF_CONFIG): the rendezvous on worker 0's port, which on torch nothing
    else binds. A job known to run on torch (KERAS_BACKEND=torch) gets no TF_CONFIG, so no TensorFlow import."""
    host, port = split_address(worker.addresses[0], "worker 0's address")
    if keras_backend(environ) == "torch":
        environ.pop("TF_CONFIG", None)
    environ.update(RANK=str(worker.index), WORLD_SIZE=str(worker.count), LOCAL_RANK=str(worker.index),
                   LOCAL_WORLD_SIZE=str(worker.count), MASTER_ADDR=host, MASTER_PORT=str(port))
