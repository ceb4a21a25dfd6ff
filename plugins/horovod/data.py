"""Data: each rank's share of ``fit``/``evaluate`` input, the same number of steps on every rank.

By default ``batch_size`` is the global batch, as under every other strategy: every batch is split
between the ranks. ``batch_size_per_worker=True`` gives Horovod's own semantics: whole batches go
to ranks in turn, so the global batch is ``batch_size`` x ranks.
"""

import math
import warnings

import kerasdist
from kerasdist.plugin_tools import (arrays_as_dataset, in_shared_order, input_kind, is_dataset, split_batches,
                                    split_validation)


def shard_dataset(dataset, rank, size, what="fit"):
    """Rank ``rank``'s whole batches, the same number on every rank (a finite tail is dropped)."""
    import tensorflow as tf

    count = int(dataset.cardinality())
    if count == tf.data.UNKNOWN_CARDINALITY:
        warnings.warn(f"horovod: the {what} dataset's size is unknown, so ranks may run different numbers "
                      "of steps and stall at the end: pass steps_per_epoch= (the same on every rank) or "
                      "use a dataset of known size.", stacklevel=3)
    elif count != tf.data.INFINITE_CARDINALITY:
        usable = count // size * size
        if usable == 0:
            raise kerasdist.KerasdistError(
                f"horovod: the {what} dataset has {count} batch(es), fewer than the {size} ranks; give "
                "more data or a smaller batch size.")
        if usable < count:
            warnings.warn(f"horovod: dropping the last {count - usable} of {count} batches so that each of "
                          f"the {size} ranks runs {usable // size} steps.", stacklevel=3)
            dataset = dataset.take(usable)
    return dataset.shard(size, rank)


def shard_arrays(arrays, batch_size, rank, size, what="fit"):
    """Rank ``rank``'s whole batches of in-memory data (numpy/tensors, nested), or None if not arrays.

    Batch ``k`` of the global data goes to rank ``k % size``, so the ranks' ``k``-th steps
    together cover ``size`` consecutive batches: one step of single-process training on a
    ``size`` times larger batch.
    """
    import keras
    import numpy as np

    leaves = [a for a in keras.tree.flatten(arrays) if a is not None]
    if not leaves or not all(hasattr(a, "shape") and len(a.shape) > 0 for a in leaves):
        return None
    count = int(leaves[0].shape[0])
    batches = math.ceil(count / batch_size)
    usable = batches // size * size
    if usable == 0:
        raise kerasdist.KerasdistError(
            f"horovod: {what} got {count} samples, {batches} batch(es) of batch_size={batch_size}, fewer than "
            f"the {size} ranks; give more data or a smaller batch_size (it is per rank).")
    if usable < batches:
        warnings.warn(f"horovod: dropping {count - min(count, usable * batch_size)} of {count} {what} samples "
                      f"so that each of the {size} ranks runs {usable // size} steps.", stacklevel=3)
    starts = np.arange(rank, usable, size) * batch_size
    index = np.concatenate([np.arange(s, min(s + batch_size, count)) for s in starts])

    def take(a):
        if a is None:
            return None
        if isinstance(a, np.ndarray):
            return a[index]
        import tensorflow as tf

        return tf.gather(a, index)

    return keras.tree.map_structure(take, arrays)



def split_call_data(call_kwargs, rank, size, method, seed, keras_order=False, same_python_random=None):
    """``batch_size`` is the global batch: each rank takes its part of every batch (arrays are fed as
    a dataset shuffled alike on every rank with ``seed``; ``keras_order``, every rank having one global seed:
    by Keras's own shuffle, one process's order); validation arrays likewise. A shuffled PyDataset keeps Keras's
    own shuffle where ``same_python_random()`` (a collective) says every rank draws it alike, else ``seed``'s."""
    import keras

    shuffle = seed if method == "fit" and call_kwargs.get("shuffle", True) else None
    x = call_kwargs.get("x")
    if shuffle is not None and isinstance(x, keras.utils.PyDataset) and not (same_python_random
                                                                             and same_python_random()):
        call_kwargs.update(x=in_shared_order(x, shuffle), shuffle=False)
    elif input_kind(x) is not None:
        pass  # split by kerasdist_prepare_dataset already
    elif arrays_as_dataset(call_kwargs, shuffle, method, keras_order=keras_order):
        call_kwargs["x"] = split_batches(call_kwargs["x"], rank, size)
    elif x is not None:
        _not_split_warning(method, x)
    if method == "fit":  # datasets: kerasdist_prepare_dataset; in-memory (x, y[, sample_weight]) here
        split_validation(call_kwargs, rank, size)


def shard_call_data(call_kwargs, rank, size, method):
    """Horovod's semantics (``batch_size_per_worker=True``): whole batches of ``batch_size`` per rank."""
    import keras

    batch_size = call_kwargs.get("batch_size") or 32
    x = call_kwargs.get("x")
    if x is not None and not is_dataset(x):
        data = {k: call_kwargs.get(k) for k in ("x", "y", "sample_weight")}
        sharded = shard_arrays(data, batch_size, rank, size, method)
        if sharded is None:
            _not_split_warning(method, x)
        else:
            call_kwargs.update({k: v for k, v in sharded.items() if k in call_kwargs or v is not None})
    validation = call_kwargs.get("validation_data") if method == "fit" else None
    if validation is not None and input_kind(validation) is None:  # datasets: kerasdist_prepare_dataset
        sharded = shard_arrays(keras.utils.unpack_x_y_sample_weight(validation),
                               call_kwargs.get("validation_batch_size") or batch_size, rank, size, "validation")
        if sharded is not None:
            call_kwargs["validation_data"] = sharded


def _not_split_warning(method, x):
    warnings.warn(f"horovod: {method} input of type {type(x).__name__} is not split between ranks, so every "
                  "rank sees all of it: shard it by horovod.tensorflow.rank() yourself, or pass numpy arrays "
                  "or a tf.data.Dataset.", stacklevel=5)


def per_worker_notice(call_kwargs, size):
    """The one line saying that ``batch_size`` is per rank (``batch_size_per_worker=True``)."""
    batch_size = call_kwargs.get("batch_size")
    if batch_size is None and is_dataset(call_kwargs.get("x")):
        what = f"each rank takes whole batches of the dataset: a step trains on {size} of its batches"
    else:
        batch_size = batch_size or 32
        what = (f"batch_size={batch_size} is each rank's batch: the global batch is {batch_size * size} "
                f"({batch_size} x {size} ranks)")
    return f"kerasdist: horovod batch_size_per_worker=True: {what}, as in Horovod."
