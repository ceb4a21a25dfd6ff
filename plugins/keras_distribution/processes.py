"""Several JAX processes, one global mesh: joining (from TF_CONFIG / Slurm, as ``kerasdist launch`` sets it),
each process's part of every global batch, and writes from process 0 only."""

import numpy as np

from kerasdist import ClusterConfigError, KerasdistError
from kerasdist.plugin_tools import first_array, is_dataset

#: Callbacks that write files: process 0 keeps them, the others drop them (every process holds the same
#: replicated state, and a sharded one is saved by process 0 through Keras's own gathering).
WRITING_CALLBACKS = ("ModelCheckpoint", "TensorBoard", "CSVLogger", "BackupAndRestore")


def is_process_cluster(cluster):
    return (not cluster.is_local and not cluster.has_parameter_servers and cluster.source in ("tf_config", "slurm")
            and cluster.task_type in ("chief", "worker"))


def join(cluster):
    """``keras.distribution.initialize`` for this process: the coordinator is the first task's address."""
    import keras

    tasks = list(cluster.cluster.get("chief", ())) + list(cluster.cluster.get("worker", ()))
    process_id = (0 if cluster.task_type == "chief" else
                  cluster.task_index + len(cluster.cluster.get("chief", ())))
    try:
        keras.distribution.initialize(job_addresses=",".join(tasks), num_processes=len(tasks), process_id=process_id)
    except Exception as exc:  # jax raises RuntimeError/ValueError with its own words
        raise ClusterConfigError(f"data_parallel/hybrid: joining the JAX cluster {tasks} as process {process_id} failed: "
                                 f"{type(exc).__name__}: {exc}. Start every process with the same TF_CONFIG cluster "
                                 "(kerasdist launch -n N does), before any JAX computation.") from exc


def process_count():
    import jax

    return jax.process_count(), jax.process_index()


def batch_part(count, index, batch_axis_size):
    """``(parts, part)``: into how many parts the processes split each global batch, and this process's.
    One part per process; with a batch axis smaller than the process count (``{"model": 8}`` over two
    processes), one per batch slice, the processes of a slice feeding the same rows (the batch axis is
    the mesh's outermost, so a slice is held by consecutive processes)."""
    if batch_axis_size % count == 0:
        return count, index
    if count % batch_axis_size == 0:
        return batch_axis_size, index // (count // batch_axis_size)
    raise KerasdistError(f"the batch axis of size {batch_axis_size} cannot be split among {count} JAX processes; "
                         f"give it a size that is a multiple or a divisor of {count}.")


def split_inputs(call_kwargs, spec_name, batch_axis_size):
    """Give this process its rows of every global batch (NumPy inputs), and the per-process batch size."""
    count, index = process_count()
    if count == 1:
        return
    parts, part = batch_part(count, index, batch_axis_size)
    x = call_kwargs.get("x")
    if is_dataset(x) or (x is not None and not isinstance(x, (np.ndarray, list, tuple, dict))):
        raise KerasdistError(f"{spec_name} over {count} JAX processes: give NumPy arrays (each process then takes "
                             f"its part of every global batch), not {type(x).__name__}.")
    batch = call_kwargs.get("batch_size") or 32
    if batch % parts:
        raise KerasdistError(f"{spec_name}: batch_size={batch} is the global batch; it must divide among the {parts} "
                             f"process groups; give a multiple of {parts}.")
    size = len(first_array(x))
    order = np.arange(size)
    if call_kwargs.get("shuffle", True) is not False:  # one permutation, the same in every process
        order = np.random.default_rng(len(order)).permutation(size)
    rows = []
    for start in range(0, size, batch):
        in_batch = min(batch, size - start)
        if in_batch % parts:
            raise KerasdistError(f"{spec_name}: the last batch has {in_batch} examples, which do not divide among "
                                 f"the {parts} process groups; use a number of examples divisible by {parts}.")
        share = in_batch // parts
        rows.extend(order[start + part * share:start + (part + 1) * share])
    rows = np.asarray(rows, dtype=np.int64)
    for key in ("x", "y", "sample_weight"):
        if call_kwargs.get(key) is not None:
            call_kwargs[key] = _take(call_kwargs[key], rows)
    call_kwargs["batch_size"] = batch // parts
    call_kwargs["shuffle"] = False


def quiet_other_processes(method, call_kwargs):
    _, index = process_count()
    if index == 0:
        return
    call_kwargs["verbose"] = 0
    if method == "fit":
        call_kwargs["callbacks"][:] = [cb for cb in call_kwargs["callbacks"]
                                       if type(cb).__name__ not in WRITING_CALLBACKS]


def _take(value, rows):
    if isinstance(value, dict):
        return {k: _take(v, rows) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_take(v, rows) for v in value)
    return np.asarray(value)[rows]
