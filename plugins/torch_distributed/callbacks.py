"""Only rank 0 writes: the other ranks drop ModelCheckpoint, TensorBoard and CSVLogger (every rank holds the
same weights and logs the same all-reduced metrics) and print nothing. BackupAndRestore: kerasdist's private,
identity-checked backup (``plugin_tools.private_backups``, as multiworker's): rank 0 writes it, the others
restore from it and write to a scratch folder; a relaunched job resumes from it."""

import keras

from kerasdist.plugin_tools import private_backups

WRITING_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.TensorBoard, keras.callbacks.CSVLogger)

def only_rank0_writes(call_kwargs, rank):
    if rank == 0:
        return
    call_kwargs["verbose"] = 0
    call_kwargs["callbacks"][:] = [cb for cb in call_kwargs["callbacks"] if not isinstance(cb, WRITING_CALLBACKS)]


def add_backup(call_kwargs, spec, model, strategy):
    """The private backup (``spec.backup``), or the user's own BackupAndRestore read by every rank."""
    users = any(isinstance(cb, keras.callbacks.BackupAndRestore) for cb in call_kwargs["callbacks"])
    if spec.backup or users:
        private_backups.add_backup(call_kwargs, spec, model, strategy, private_backups.count_fit(),
                                   strategy.rank == 0, private_backups.scratch_dir())
