"""A ``keras.utils.PyDataset`` read by batch index under a strategy of several replicas in one process (part of
kerasdist._keras_internals).

Keras feeds a PyDataset to TensorFlow through ``tf.data.Dataset.from_generator`` over one shared loader (the
threaded ``OrderedEnqueuer`` queue, which also draws each epoch's shuffle when it starts). At an epoch's end Keras
makes the next epoch's iterator before ``on_epoch_end`` and, without ``steps_per_epoch``, makes another one at the
next epoch's start. Under MirroredStrategy or CentralStorageStrategy an iterator starts reading the moment it is
made (its multi-device prefetch): the iterator that is never used started the loader from tf.data's thread and
took queued batches, and whether that start landed before or after the main thread's stop decided whether the
epoch's shuffle was drawn once or twice (issue 29: another batch order from the second epoch, in some runs only).

Here such a PyDataset becomes ``tf.data.Dataset.range(num_batches)`` mapped through ``dataset[order[i]]``
(``workers`` parallel calls, deterministic), so a batch depends only on its position, however far and by whichever
iterator the strategy reads; the order is drawn on the main thread in ``on_epoch_begin``, once per epoch, with
``random.shuffle`` of the batch indices when fit shuffles: where and how one process's Keras draws it.
"""

import random
import weakref

from . import versions

_INDEXED = weakref.WeakSet()  # the PyDatasets kerasdist reads by index
_ORDER_ATTR = "_kerasdist_batch_order"
_PATCHES = {}


def read_by_index(py_dataset):
    """Read ``py_dataset`` by batch index in every later ``fit``/``evaluate``/``predict`` (see the module);
    False when this Keras lacks a piece that needs, or the dataset has no known number of batches."""
    if versions.missing("py_dataset_tf_dataset", "py_dataset_epoch_begin"):
        return False
    if py_dataset.num_batches is None:
        return False
    _install()
    _INDEXED.add(py_dataset)
    return True


def _install():
    if _PATCHES:
        return
    for piece, replacement in (("py_dataset_tf_dataset", _get_tf_dataset),
                               ("py_dataset_epoch_begin", _on_epoch_begin)):
        owner, name = versions.owner_of(piece)
        _PATCHES[piece] = (owner, name, getattr(owner, name))
        setattr(owner, name, replacement)


def uninstall():
    """Restore Keras's own methods (tests)."""
    while _PATCHES:
        _, (owner, name, original) = _PATCHES.popitem()
        setattr(owner, name, original)


def _original(piece):
    return _PATCHES[piece][2]


def _is_indexed(adapter):
    """Registered, of known length, and whole (3.16 can shard a PyDataset's batches: Keras's own way then)."""
    return (adapter.py_dataset in _INDEXED and adapter.py_dataset.num_batches is not None
            and getattr(adapter, "_num_data_shards", 1) == 1)


def _on_epoch_begin(adapter):
    _original("py_dataset_epoch_begin")(adapter)
    if _is_indexed(adapter):
        order = list(range(adapter.py_dataset.num_batches))
        if adapter.shuffle:  # as Keras's loader draws it, once per epoch: Python's random (3.15), or a
            epoch = getattr(adapter, "_epoch", None)  # random.Random seeded by the adapter's epoch count (3.16)
            (random if epoch is None else random.Random(epoch)).shuffle(order)
        setattr(adapter, _ORDER_ATTR, order)


def _get_tf_dataset(adapter):
    dataset = _original("py_dataset_tf_dataset")(adapter)  # computes Keras's output signature
    if not _is_indexed(adapter):
        return dataset
    import numpy as np
    import tensorflow as tf

    signature = adapter._output_signature
    specs = tf.nest.flatten(signature)
    if not all(type(spec) is tf.TensorSpec for spec in specs):  # ragged or sparse batches: Keras's own way
        return dataset
    adapter.enqueuer = None  # never started: batches come from the map below, and no epoch starts or stops it
    count = adapter.py_dataset.num_batches
    if getattr(adapter, _ORDER_ATTR, None) is None:
        setattr(adapter, _ORDER_ATTR, list(range(count)))

    def read(index):
        batch = adapter._standardize_batch(adapter.py_dataset[getattr(adapter, _ORDER_ATTR)[int(index)]])
        # copies: a tensor over the user's own array memory may be written in place by a kernel that reuses it
        return [np.array(leaf, dtype=spec.dtype.as_numpy_dtype) for leaf, spec in zip(tf.nest.flatten(batch), specs)]

    def batch_at(index):
        leaves = tf.py_function(read, [index], Tout=[spec.dtype for spec in specs])
        for leaf, spec in zip(leaves, specs):
            leaf.set_shape(spec.shape)
        return tf.nest.pack_sequence_as(signature, leaves)

    workers = max(int(adapter.py_dataset.workers or 1), 1)
    return tf.data.Dataset.range(count).map(batch_at, num_parallel_calls=workers, deterministic=True)
