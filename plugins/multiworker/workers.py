"""Worker-side behaviour: chief-only writes, a scratch folder, and numpy input that every worker shuffles
alike (the backup is in backup.py)."""

import atexit
import os
import shutil
import tempfile

import keras

from .options import SCRATCH_DIR_VAR


_fits = [0]


def count_fit():
    """The index of this fit call in this process (the same on every worker)."""
    _fits[0] += 1
    return _fits[0] - 1


#: Callback attributes naming where a callback writes; non-chief workers write under scratch.
_WRITE_ATTRIBUTES = (("ModelCheckpoint", "filepath"), ("TensorBoard", "log_dir"), ("CSVLogger", "filename"))


def redirect_writes(call_kwargs, scratch):
    changed = []
    for number, callback in enumerate(call_kwargs["callbacks"]):
        for class_name, attribute in _WRITE_ATTRIBUTES:
            if isinstance(callback, getattr(keras.callbacks, class_name)):
                original = getattr(callback, attribute)
                parent = os.path.join(scratch, f"{number}-{class_name}")
                os.makedirs(parent, exist_ok=True)
                target = os.path.join(parent, os.path.basename(str(original).rstrip("/\\")))
                setattr(callback, attribute, target)
                changed.append((callback, attribute, original))
    if changed:
        call_kwargs["callbacks"].append(_RestoreWrites(changed, scratch))


class _RestoreWrites(keras.callbacks.Callback):
    """Last callback of a non-chief fit: give callbacks their paths back, drop their files."""

    def __init__(self, changed, scratch):
        super().__init__()
        self.changed, self.scratch = changed, scratch

    def on_train_end(self, logs=None):
        for callback, attribute, original in self.changed:
            setattr(callback, attribute, original)
        for name in os.listdir(self.scratch):
            if name != "backup":
                shutil.rmtree(os.path.join(self.scratch, name), ignore_errors=True)


def shuffle_arrays_alike(call_kwargs, seed):
    """Keras shuffles numpy inputs with an unseeded op, so workers would each take a
    different permutation and the element-wise shard would repeat some examples and
    drop others. Feed arrays through a tf.data pipeline shuffled with one shared seed."""
    import numpy as np

    x = call_kwargs.get("x")
    shuffle = call_kwargs.get("shuffle", True)
    if not shuffle or not _all_arrays(x) or not _all_arrays(call_kwargs.get("y"), allow_none=True) \
            or not _all_arrays(call_kwargs.get("sample_weight"), allow_none=True):
        return
    import tensorflow as tf

    parts = [p for p in (x, call_kwargs.get("y"), call_kwargs.get("sample_weight")) if p is not None]
    split = float(call_kwargs.get("validation_split") or 0.0)
    if split and call_kwargs.get("validation_data") is None:
        count = len(_first_array(x))
        at = int(np.floor(count * (1.0 - split)))
        call_kwargs["validation_data"] = tuple(_slice(p, at, None) for p in parts)
        parts = [_slice(p, 0, at) for p in parts]
    count = len(_first_array(parts[0]))
    # tf.data reads a Python list as one tensor: lists of arrays (multi-input/output) must be tuples.
    dataset = tf.data.Dataset.from_tensor_slices(tuple(keras.tree.lists_to_tuples(p) for p in parts))
    dataset = dataset.shuffle(count, seed=seed, reshuffle_each_iteration=True)
    batch_size = call_kwargs.get("batch_size") or 32
    call_kwargs.update(x=dataset.batch(batch_size), y=None, sample_weight=None, batch_size=None,
                       shuffle=False, validation_split=0.0)


def _all_arrays(value, allow_none=False):
    import numpy as np

    if value is None:
        return allow_none
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, (list, tuple)) and value:
        return all(isinstance(v, np.ndarray) for v in value)
    if isinstance(value, dict) and value:
        return all(isinstance(v, np.ndarray) for v in value.values())
    return False


def _first_array(value):
    if isinstance(value, dict):
        return next(iter(value.values()))
    if isinstance(value, (list, tuple)):
        return value[0]
    return value


def _slice(value, start, stop):
    if isinstance(value, dict):
        return {k: v[start:stop] for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(v[start:stop] for v in value)
    return value[start:stop]


_scratch = []


def scratch_dir():
    """A per-process temporary directory for a non-chief worker's writes, removed at exit."""
    if not _scratch:
        root = os.environ.get(SCRATCH_DIR_VAR) or None
        if root:
            os.makedirs(root, exist_ok=True)
        _scratch.append(tempfile.mkdtemp(prefix="kerasdist-worker-", dir=root))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return _scratch[0]
