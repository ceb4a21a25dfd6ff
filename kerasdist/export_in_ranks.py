"""``kerasdist.export`` called in every rank of a job of several processes (torch.distributed, JAX processes):
rank 0 writes, every rank returns its result or raises its error. Used by :func:`kerasdist.exporting.export`."""

import contextlib
import os

from .errors import KerasdistError


class _Processes:
    """The ranks of the job this process belongs to: ``rank``, ``size``, ``broadcast(obj)`` (rank 0's object
    in every rank; a collective every rank enters)."""

    def __init__(self, rank, size, broadcast, what):
        self.rank, self.size, self.broadcast, self.what = rank, size, broadcast, what


def _job_processes():
    """The job of several processes this process trains in (torch.distributed's default group, JAX's processes),
    or None for one process. TensorFlow's multi-worker strategies are not looked at here."""
    import sys

    backend = _backend()
    if backend == "torch" and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            def broadcast(value):
                box = [value]
                dist.broadcast_object_list(box, src=0)
                return box[0]

            return _Processes(dist.get_rank(), dist.get_world_size(), broadcast, "torch.distributed ranks")
    if backend == "jax" and "jax" in sys.modules:
        import jax

        if jax.process_count() > 1:
            return _Processes(jax.process_index(), jax.process_count(), _jax_broadcast, "JAX processes")
    return None


@contextlib.contextmanager
def _random_state_kept():
    """Python's, NumPy's and torch's global random states as they were: loading the copy in rank 0 may draw seeds
    for its initializers (Keras's ``make_default_seed``), which would leave rank 0's state unlike the other ranks'
    (and one process's, which loads no copy)."""
    import random
    import sys

    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    torch = sys.modules.get("torch")
    generator = torch.random.get_rng_state() if torch is not None else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        if generator is not None:
            torch.random.set_rng_state(generator)


def _jax_broadcast(value):
    """Process 0's picklable ``value`` in every JAX process (its length, then its bytes)."""
    import pickle

    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8) if value is not None else np.zeros(0, np.uint8)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([len(data)], np.int64)))[0])
    padded = np.zeros(size, np.uint8)
    padded[:min(size, len(data))] = data[:size]
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(padded)).astype(np.uint8).tobytes())


def _export_in_rank0(job, entry, model, filepath, options):
    """``kerasdist.export`` called in every rank of a job (as a torch or Lightning script calls a checkpoint
    save): every rank saves the model to a private file (a collective where weights are sharded: fsdp gathers
    them, JAX processes hold one global array), rank 0 loads its copy, a plain one-process model, and exports
    it to ``filepath`` (with ``verify_with=``, against that copy); every rank then returns rank 0's
    ExportResult, or raises rank 0's error. Only rank 0 writes ``filepath``; no two processes write one file."""
    import tempfile

    error = result = None
    with tempfile.TemporaryDirectory(prefix=f"kerasdist-export-rank{job.rank}-") as folder, _random_state_kept():
        copy = os.path.join(folder, "model.keras")
        try:
            model.save(copy)  # every rank: the gathers of sharded weights are collectives
        except Exception as exc:  # noqa: BLE001 (every rank must reach the broadcast below)
            error = KerasdistError(
                f"export(format={entry.name!r}) in a job of {job.size} {job.what}: rank 0 exports a copy of the "
                f"model saved by every rank, but model.save failed in rank {job.rank} ({type(exc).__name__}: {exc}); "
                "make every custom layer serializable (keras.saving.register_keras_serializable, get_config).")
            error.__cause__ = exc
        if job.rank == 0 and error is None:
            try:
                import keras

                result = entry.factory(keras.saving.load_model(copy, compile=False), filepath, **options)
            except Exception as exc:  # noqa: BLE001 (raised below, after the other ranks heard of it)
                error = exc
        outcome = job.broadcast(("ok", result) if job.rank != 0 or error is None
                                else ("error", f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    if outcome[0] == "error":
        raise KerasdistError(f"export(format={entry.name!r}) in a job of {job.size} {job.what}: rank 0, which "
                             f"writes {os.fspath(filepath)} for every rank, failed: {outcome[1]}")
    return outcome[1]


def _backend():
    from .backend import keras_backend

    return keras_backend()
