"""Several JAX processes, one global mesh: joining (from TF_CONFIG / Slurm, as ``kerasdist launch`` sets it),
every process reading the same global batches (each device is given its rows), and writes from process 0
only."""

import contextlib
import os

import numpy as np

from kerasdist import ClusterConfigError, KerasdistError

# Callbacks that write files (plugin_tools.writes_files) run in every process (a save inside fit enters
# cross-process collectives: Keras's reference Optimizer's variables are placed on the mesh with ``jax.device_put``,
# a sharded variable is gathered), process 0 into the user's path, the others into their private scratch folder,
# removed at exit (TensorFlow's MultiWorkerMirroredStrategy convention).


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


def place_global_batch(batch, sharding):
    """The global ``jax.Array`` of ``batch``, a global batch every process reads whole: each device is given its
    rows (``sharding``), or, for a batch that does not divide over the devices of its axis (an uneven last
    batch), every device the whole batch (replicated: computed as on one device). Over several processes the
    processes' batches are compared first: they must be the same global batch."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    batch = np.asarray(batch)
    if jax.process_count() > 1:
        _check_same_batch(batch)
    if isinstance(sharding, NamedSharding) and not _divides(batch.shape, sharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec())
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def _divides(shape, sharding):
    sizes = dict(sharding.mesh.shape)
    for dim, axes in zip(shape, sharding.spec):
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            dim, rest = divmod(dim, sizes[axis])
            if rest:
                return False
    return True


def _check_same_batch(batch):
    """One clear error in every process when the processes read different batches (an unseeded shuffle,
    per-process random augmentation, other files): the global batch would silently be process 0's."""
    import zlib

    from jax.experimental import multihost_utils

    digest = np.array([zlib.crc32(np.ascontiguousarray(batch).tobytes()) & 0x7FFFFFFF,
                       batch.shape[0] if batch.ndim else -1], dtype=np.int32)
    every = np.asarray(multihost_utils.process_allgather(digest))
    if (every != every[0]).any():
        raise KerasdistError(
            f"data_parallel/hybrid over {len(every)} JAX processes: the processes read different batches here "
            f"(rows per process: {every[:, 1].tolist()}, checksums {every[:, 0].tolist()}); every process must "
            "read the same global batches (kerasdist gives each device its rows): seed every shuffle "
            "(keras.utils.set_random_seed(S) before building the data, or ds.shuffle(n, seed=S)) and read the "
            "same files in every process.")


def check_agreement(method, model, call_kwargs, word):
    """Every process starts the same ``fit``/``evaluate`` on the same model (kerasdist's agreement check, issue 35):
    else one error naming both sides in every process, before this call's first collective (before: a process that left a
    fit for the next KerasTuner trial's model waited in that fit's first collective while the other trained on:
    a hang)."""
    from kerasdist.plugin_tools import check_agreement as check

    count, index = process_count()
    # each next epoch at the end of the one before: Keras resets the metrics (their zeros placed on the global
    # mesh, a collective) before on_epoch_begin
    check(method, model, call_kwargs, rank=index, size=count, sum_arrays=sum_arrays, word=word, epoch_check="end")


def sum_arrays(*arrays):
    """The processes' sums of float64 arrays, exact, in one ``process_allgather``: each array travels as its bits
    (int32; JAX without x64 would make float64 float32) and is summed here."""
    from jax.experimental import multihost_utils

    arrays = [np.ascontiguousarray(np.asarray(a, dtype=np.float64)) for a in arrays]
    bits = np.concatenate([a.reshape(-1) for a in arrays]).view(np.int32)
    every = np.ascontiguousarray(np.asarray(multihost_utils.process_allgather(bits))).view(np.float64)
    summed = every.reshape(-1, bits.size // 2).sum(axis=0)
    ends = np.cumsum([a.size for a in arrays])[:-1]
    return [part.reshape(a.shape) for part, a in zip(np.split(summed, ends), arrays)]


def share_random_state():
    """NumPy's global random state of process 0 in every process (Keras shuffles NumPy inputs with it):
    every process then draws process 0's permutation, which with ``keras.utils.set_random_seed`` is the one
    a single process draws."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = np.concatenate([keys.view(np.int32), np.array([position, has_gauss], dtype=np.int32),
                            np.array([cached], dtype=np.float64).view(np.int32)])
    state = np.asarray(multihost_utils.broadcast_one_to_all(state))
    np.random.set_state((kind, state[:-4].view(np.uint32), int(state[-4]), int(state[-3]),
                         float(state[-2:].view(np.float64)[0])))


def quiet_other_processes(method, call_kwargs):
    _, index = process_count()
    if index != 0:
        call_kwargs["verbose"] = 0


@contextlib.contextmanager
def chief_writes(method, call_kwargs):
    """During ``fit``, the writing callbacks of a process other than 0 write into its scratch folder (their paths
    restored after), and a BackupAndRestore there restores from process 0's folder but writes its own. A ``fit``
    returns in every process once process 0's files are written (a next ``fit`` may read its backup)."""
    count, index = process_count()
    if count == 1 or method != "fit":
        yield
        return
    if index == 0:
        yield
        _wait_for_every_process()
        return
    import keras

    from kerasdist.plugin_tools import make_chief_aware_backup, private_backups, redirect_writes, restore_writes

    scratch = private_backups.scratch_dir()
    callbacks = call_kwargs["callbacks"]
    for position, callback in enumerate(callbacks):
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            callbacks[position] = make_chief_aware_backup(
                callback.backup_dir, os.path.join(scratch, "backup"), save_freq=callback.save_freq,
                double_checkpoint=callback.double_checkpoint, delete_checkpoint=callback.delete_checkpoint)
    redirected = redirect_writes(callbacks, scratch)
    try:
        yield
    finally:
        restore_writes(redirected)
    _wait_for_every_process()


def _wait_for_every_process():
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("kerasdist: fit's files written")
