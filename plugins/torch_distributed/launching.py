"""torchrun's variables as a kerasdist cluster, and the same variables for ``kerasdist launch``'s workers.

torchrun (and ``torch.distributed.launch``, TorchX, Kubeflow's PyTorchJob) give each process RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK. A TF_CONFIG or a Slurm step of several tasks is left to the
cluster_env plugin (its ranks are mapped in group.py), so a process that has both is read one way only; torchrun
inside one Slurm task (``srun --ntasks 1 torchrun ...``, or in a batch script) is read as torchrun.
"""

from kerasdist import ClusterInfo
from kerasdist.plugin_tools import keras_backend, slurm_step_tasks, split_address

from .group import torchrun_ranks


def detect(environ):
    """A :class:`kerasdist.ClusterInfo` (source "torchrun") from torchrun's variables, else None."""
    if environ.get("TF_CONFIG", "").strip() or slurm_step_tasks(environ) > 1:
        return None
    found = torchrun_ranks(environ)
    if found is None or found[1] < 2:
        return None
    rank, world, local, host, port = found
    return ClusterInfo(task_type="worker", task_index=rank, cluster={"worker": [f"{host}:{port}"] * world},
                       source="torchrun", extra={"local_rank": local})


def launch_environment(worker, environ):
    """torchrun's variables for every ``kerasdist launch`` worker (the launcher cannot know which backend the
    script picks; TensorFlow and JAX read TF_CONFIG): the rendezvous on worker 0's port, which on torch nothing
    else binds. A job known to run on torch (KERAS_BACKEND=torch) gets no TF_CONFIG, so no TensorFlow import."""
    host, port = split_address(worker.addresses[0], "worker 0's address")
    if keras_backend(environ) == "torch":
        environ.pop("TF_CONFIG", None)
    environ.update(RANK=str(worker.index), WORLD_SIZE=str(worker.count), LOCAL_RANK=str(worker.index),
                   LOCAL_WORLD_SIZE=str(worker.count), MASTER_ADDR=host, MASTER_PORT=str(port))
