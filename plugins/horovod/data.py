"""Data: each rank's share of ``fit``/``evaluate`` input, the same number of steps on every rank."""

import math
import warnings

import kerasdist
from kerasdist.plugin_tools import is_dataset


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



def shard_call_data(call_kwargs, rank, size, method):
    batch_size = call_kwargs.get("batch_size") or 32
    x = call_kwargs.get("x")
    if x is not None and not is_dataset(x):
        data = {k: call_kwargs.get(k) for k in ("x", "y", "sample_weight")}
        sharded = shard_arrays(data, batch_size, rank, size, method)
        if sharded is None:
            warnings.warn(f"horovod: {method} input of type {type(x).__name__} is not sharded, so every rank "
                          "sees all of it: shard it by horovod.tensorflow.rank() yourself, or pass numpy "
                          "arrays or a tf.data.Dataset.", stacklevel=4)
        else:
            call_kwargs.update({k: v for k, v in sharded.items() if k in call_kwargs or v is not None})
    validation = call_kwargs.get("validation_data") if method == "fit" else None
    if validation is not None:
        if is_dataset(validation):
            call_kwargs["validation_data"] = shard_dataset(validation, rank, size, "validation")
        else:
            sharded = shard_arrays(tuple(validation), call_kwargs.get("validation_batch_size") or batch_size,
                                   rank, size, "validation")
            if sharded is not None:
                call_kwargs["validation_data"] = sharded
