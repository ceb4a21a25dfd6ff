"""Worker-side behaviour: chief-only writes, a scratch folder, and numpy input that every worker shuffles
alike (the backup is in backup.py)."""

import os
import shutil

import keras
import numpy as np

from kerasdist.plugin_tools import arrays_as_dataset, restore_writes
from kerasdist.plugin_tools import redirect_writes as _redirect


def redirect_writes(call_kwargs, scratch):
    """A non-chief worker's writing callbacks write under scratch (their paths given back, their files dropped, at
    the end of fit)."""
    changed = _redirect(call_kwargs["callbacks"], scratch)
    if changed:
        call_kwargs["callbacks"].append(_RestoreWrites(changed, scratch))


class _RestoreWrites(keras.callbacks.Callback):
    """Last callback of a non-chief fit: give callbacks their paths back, drop their files."""

    def __init__(self, changed, scratch):
        super().__init__()
        self.changed, self.scratch = changed, scratch

    def on_train_end(self, logs=None):
        restore_writes(self.changed)
        for name in os.listdir(self.scratch):
            if name != "backup":
                shutil.rmtree(os.path.join(self.scratch, name), ignore_errors=True)


class ChiefFilesWritten(keras.callbacks.Callback):
    """Last callback of every worker's fit: fit returns once the chief's callbacks have written their files (one
    tiny all-reduce over the ring)."""

    def __init__(self, ring):
        super().__init__()
        self.ring = ring

    def on_train_end(self, logs=None):
        self.ring.sum_arrays(np.zeros(1))


def shuffle_arrays_alike(call_kwargs, seed, keras_order=False):
    """Keras shuffles numpy inputs with an unseeded op, so workers would each take a
    different permutation and the element-wise shard would repeat some examples and
    drop others. Feed arrays through a tf.data pipeline shuffled with one shared seed;
    ``keras_order`` (every worker set one global seed): Keras's own shuffle, one process's order."""
    if call_kwargs.get("shuffle", True):
        arrays_as_dataset(call_kwargs, seed, keras_order=keras_order)

