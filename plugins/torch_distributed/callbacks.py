"""Only rank 0 writes: the other ranks drop ModelCheckpoint, TensorBoard and CSVLogger (every rank holds the
same weights and logs the same all-reduced metrics) and print nothing. BackupAndRestore: kerasdist's private,
identity-checked backup (``plugin_tools.private_backups``, as multiworker's): rank 0 writes it, the others
restore from it and write to a scratch folder; a relaunched job resumes from it."""

import itertools
import os
import tempfile

import keras

from kerasdist.plugin_tools import private_backups

WRITING_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.TensorBoard, keras.callbacks.CSVLogger)
_fits = itertools.count()


def scratch_folder(rank):
    root = os.environ.get("KERASDIST_SCRATCH_DIR") or tempfile.gettempdir()
    folder = os.path.join(root, f"kerasdist-torch-rank{rank}-{os.getpid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def only_rank0_writes(call_kwargs, rank):
    if rank == 0:
        return
    call_kwargs["verbose"] = 0
    call_kwargs["callbacks"][:] = [cb for cb in call_kwargs["callbacks"] if not isinstance(cb, WRITING_CALLBACKS)]


def add_backup(call_kwargs, spec, model, strategy):
    """The private backup (``spec.backup``), or the user's own BackupAndRestore read by every rank."""
    users = any(isinstance(cb, keras.callbacks.BackupAndRestore) for cb in call_kwargs["callbacks"])
    if spec.backup or users:
        private_backups.add_backup(call_kwargs, spec, model, strategy, next(_fits), strategy.rank == 0,
                                   scratch_folder(strategy.rank))
