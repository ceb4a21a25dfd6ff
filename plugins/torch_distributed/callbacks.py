"""Only rank 0 writes: the other ranks drop ModelCheckpoint, TensorBoard and CSVLogger (every rank holds the
same weights and logs the same all-reduced metrics), print nothing, and read a BackupAndRestore backup
without writing one (they restore from rank 0's folder and write to a scratch folder, as multiworker's
non-chief workers do)."""

import os
import tempfile

import keras

from kerasdist.plugin_tools import make_chief_aware_backup

WRITING_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.TensorBoard, keras.callbacks.CSVLogger)


def scratch_folder(rank):
    root = os.environ.get("KERASDIST_SCRATCH_DIR") or tempfile.gettempdir()
    folder = os.path.join(root, f"kerasdist-torch-rank{rank}-{os.getpid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def only_rank0_writes(method, call_kwargs, rank):
    if rank == 0:
        return
    call_kwargs["verbose"] = 0
    callbacks = call_kwargs["callbacks"]
    kept = []
    for callback in callbacks:
        if isinstance(callback, WRITING_CALLBACKS):
            continue
        if isinstance(callback, keras.callbacks.BackupAndRestore) and method == "fit":
            callback = make_chief_aware_backup(
                callback.backup_dir, os.path.join(scratch_folder(rank), "backup"), save_freq=callback.save_freq,
                double_checkpoint=callback.double_checkpoint, delete_checkpoint=callback.delete_checkpoint)
        kept.append(callback)
    callbacks[:] = kept
