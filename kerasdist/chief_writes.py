"""Callbacks that write files, and where: the one table every word uses so that only the chief writes the user's
paths (the others drop those callbacks, or write into a private scratch folder where their save is itself a
collective). Issue 35 item 2: KerasTuner's ``SaveBestEpoch``, written by every rank into one trial's folder, hit
HDF5's file lock on one rank, whose trial then failed alone while the others trained it."""

import os

#: (top-level package, class name) -> the attribute naming where that callback, or a subclass of it, writes
WRITING_CALLBACKS = {("keras", "ModelCheckpoint"): "filepath", ("keras", "TensorBoard"): "log_dir",
                     ("keras", "CSVLogger"): "filename",
                     ("keras_tuner", "SaveBestEpoch"): "filepath"}  # a trial's best-epoch weights


def write_attribute(callback):
    """The attribute naming where ``callback`` writes files, or None if it is not a known writing callback."""
    for cls in type(callback).__mro__:
        attribute = WRITING_CALLBACKS.get((cls.__module__.split(".")[0], cls.__name__))
        if attribute is not None:
            return attribute
    return None


def writes_files(callback):
    return write_attribute(callback) is not None


def redirect_writes(callbacks, scratch):
    """Point each writing callback of ``callbacks`` at a folder of its own under ``scratch`` (created 0700); returns
    what :func:`restore_writes` gives back."""
    changed = []
    for number, callback in enumerate(callbacks):
        attribute = write_attribute(callback)
        if attribute is None:
            continue
        original = getattr(callback, attribute)
        parent = os.path.join(scratch, f"{number}-{type(callback).__name__}")
        os.makedirs(parent, mode=0o700, exist_ok=True)
        setattr(callback, attribute, os.path.join(parent, os.path.basename(os.path.normpath(str(original)))))
        changed.append((callback, attribute, original))
    return changed


def restore_writes(changed):
    for callback, attribute, original in changed:
        setattr(callback, attribute, original)
