"""Worker-side behaviour: chief-only writes, a scratch folder, and numpy input that every worker shuffles
alike (the backup is in backup.py)."""

import os
import shutil

import keras

from kerasdist.plugin_tools import arrays_as_dataset


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


def shuffle_arrays_alike(call_kwargs, seed, keras_order=False):
    """Keras shuffles numpy inputs with an unseeded op, so workers would each take a
    different permutation and the element-wise shard would repeat some examples and
    drop others. Feed arrays through a tf.data pipeline shuffled with one shared seed;
    ``keras_order`` (every worker set one global seed): Keras's own shuffle, one process's order."""
    if call_kwargs.get("shuffle", True):
        arrays_as_dataset(call_kwargs, seed, keras_order=keras_order)

