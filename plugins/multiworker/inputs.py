"""Strategy-free multiworker input: every worker takes its rows of each global batch (``batch_size`` is the
global batch, as under the strategy), from batches every worker reads alike; an input it cannot split is refused."""

import keras

from kerasdist import KerasdistError
from kerasdist.plugin_tools import (arrays_as_dataset, data_loader_draws_alike, in_shared_order, input_kind,
                                    int_pieces, python_random_same_everywhere, same_everywhere, seed_shuffling_samplers,
                                    keras_shuffles_by_epoch, split_batches, split_validation, tf_global_seed)


def split_call_data(call_kwargs, ring, method, seed):
    """``batch_size`` is the global batch: in-memory arrays (tensors too) become a dataset shuffled alike on every
    worker (as one process's ``fit`` shuffles them when every worker set the same global seed), and each worker
    takes its part of every batch (datasets, PyDatasets, generators, DataLoaders: ``split_dataset`` already did).
    Any other input is refused: every worker would train on all of it."""
    rank, size = ring.rank, ring.size
    x = call_kwargs.get("x")
    shuffle = seed if method == "fit" and call_kwargs.get("shuffle", True) else None
    if shuffle is not None and isinstance(x, keras.utils.PyDataset) and not _same_python_random(ring):
        call_kwargs.update(x=in_shared_order(x, shuffle), shuffle=False)  # Keras's own shuffle differs per worker
    if x is not None and input_kind(x) is None:
        keras_order = shuffle is not None and _same_global_seed(ring)
        if not arrays_as_dataset(call_kwargs, shuffle, method, keras_order=keras_order):
            raise _not_split_error("x", x, method)
        call_kwargs["x"] = split_batches(call_kwargs["x"], rank, size)
    if method == "fit" and split_validation(call_kwargs, rank, size) is False:
        raise _not_split_error("validation_data", call_kwargs["validation_data"], method)


def _not_split_error(name, value, method):
    what = type(value).__name__
    if isinstance(value, (list, tuple, dict)):
        what += " holding " + ", ".join(sorted({type(leaf).__name__ for leaf in keras.tree.flatten(value)}))
    return KerasdistError(
        f"distribute='multiworker' (strategy-free): {method}'s {name} ({what}) cannot be split between the workers, "
        "so every worker would train on all of it. Give in-memory arrays or tensors (NumPy, tf/JAX/torch tensors, "
        "pandas, sparse; or lists, tuples, dicts of them" + (", validation_data as (x, y[, sample_weight])"
                                                             if name == "validation_data" else "")
        + "), a tf.data.Dataset, a keras.utils.PyDataset, a generator or a torch DataLoader of global batches, or "
        "set KERASDIST_STRATEGY_FREE=off (MultiWorkerMirroredStrategy).")


def _same_global_seed(ring):
    """Whether every worker has one TensorFlow global seed (``keras.utils.set_random_seed`` with the same value):
    then each draws one process's shuffle of arrays; else (unset, or seeds differing) the workers share
    ``shuffle_seed``'s order. One small ring message; every worker asks at the same call. Keras 3.16 draws each
    epoch's shuffle from the epoch's number alone: one process's order whatever the seeds, no message."""
    if keras_shuffles_by_epoch():
        return True
    seed = tf_global_seed()
    return seed is not None and same_everywhere(int_pieces(seed), ring.sum_arrays, ring.size)


def _same_python_random(ring):
    """Whether every worker's Python ``random`` state is the same (the same script after
    ``keras.utils.set_random_seed``): then Keras's own shuffle of a PyDataset's batches (``random.shuffle``) draws
    one process's order on every worker; else the workers share ``shuffle_seed``'s order. One small ring message
    (none on Keras 3.16: ``random.Random(epoch)``, the same everywhere)."""
    return keras_shuffles_by_epoch() or python_random_same_everywhere(ring.sum_arrays, ring.size)


def split_dataset(dataset, kind, ring, seed):
    """This worker's part of every batch of a ``tf.data.Dataset``, ``keras.utils.PyDataset``, generator or torch
    ``DataLoader``. A dataset is made deterministic; a shuffling DataLoader draws one process's order where every
    worker holds the same torch generator states, else its shuffling sampler is seeded with ``seed``: every worker
    must slice the same batch."""
    if kind == "tf.data":
        import tensorflow as tf

        options = tf.data.Options()
        options.deterministic = True
        dataset = dataset.with_options(options)
    elif kind == "torch_dataloader":
        if not data_loader_draws_alike(dataset, ring.sum_arrays, ring.size):
            seed_shuffling_samplers(dataset, seed)  # else every worker draws one process's order
    elif kind not in ("py_dataset", "generator"):
        return None
    return split_batches(dataset, ring.rank, ring.size)
