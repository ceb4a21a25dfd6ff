"""Each process's rows of every global batch (``batch_size`` is the global batch): in-memory inputs as one batched
``tf.data.Dataset``, and rank ``r``'s part of each batch of a dataset, PyDataset, generator or torch DataLoader.
Public through :mod:`kerasdist.plugin_tools`."""

import sys
import types

from .errors import KerasdistError


def is_dataset(value):
    """True for a ``tf.data.Dataset`` (imports nothing: no TensorFlow loaded means no dataset)."""
    tf = sys.modules.get("tensorflow")
    data = getattr(tf, "data", None) if tf is not None else None
    return data is not None and isinstance(value, data.Dataset)


def input_kind(value):
    """The ``kind`` ``kerasdist_prepare_dataset`` is called with for ``value``: "tf.data", "py_dataset",
    "generator" or "torch_dataloader"; None for anything else (in-memory arrays). Imports nothing."""
    if is_dataset(value):
        return "tf.data"
    if isinstance(value, types.GeneratorType):
        return "generator"
    keras, torch = sys.modules.get("keras"), sys.modules.get("torch")
    if keras is not None and isinstance(value, keras.utils.PyDataset):
        return "py_dataset"
    data = getattr(getattr(torch, "utils", None), "data", None)
    if data is not None and isinstance(value, data.DataLoader):
        return "torch_dataloader"
    return None


def as_arrays(value):
    """``value``, an in-memory input as Keras's array adapter takes it (a NumPy array, a dense TensorFlow, JAX or
    torch tensor, anything with ``__array__`` such as pandas, a SparseTensor, RaggedTensor or scipy sparse matrix;
    or a nested list, tuple or dict of them), with every dense leaf as a NumPy array and scipy matrices as
    SparseTensors; None when it holds anything else (a dataset, a generator, Python numbers, a None leaf)."""
    import keras

    if value is None or isinstance(value, (list, tuple, dict)) and not value:
        return None
    leaves = keras.tree.flatten(value)
    converted = [_leaf_as_array(leaf) for leaf in leaves]
    if not leaves or any(c is None for c in converted):
        return None
    return keras.tree.pack_sequence_as(value, converted)


def _leaf_as_array(leaf):
    import numpy as np

    kind, module = type(leaf).__name__, type(leaf).__module__
    if isinstance(leaf, np.ndarray):
        array = leaf
    elif module.startswith("tensorflow") and kind in ("SparseTensor", "RaggedTensor"):
        return leaf  # tf.data cuts their rows (split_batches: tf.sparse.slice)
    elif module.startswith("scipy.sparse") and hasattr(leaf, "tocoo"):
        return _scipy_as_sparse_tensor(leaf)
    elif module.startswith("jax.experimental.sparse"):
        raise KerasdistError(
            f"a JAX sparse array ({kind}) given as in-memory input cannot be split between the processes: give a "
            "tf.SparseTensor or a scipy.sparse matrix (the same rows), or a tf.data.Dataset.")
    elif hasattr(leaf, "detach") and hasattr(leaf, "cpu"):  # a torch tensor (its grad, its device left behind)
        array = leaf.detach().cpu().numpy()
    elif module.startswith("tensorflow") and hasattr(leaf, "numpy"):  # a dense tf.Tensor or tf.Variable
        array = leaf.numpy()
    elif hasattr(leaf, "__array__"):  # JAX arrays, pandas
        array = np.asarray(leaf)
    else:
        return None
    return array if array.ndim > 0 else None


def _scipy_as_sparse_tensor(matrix):
    """A scipy sparse matrix as the ``tf.SparseTensor`` Keras's adapter makes of it."""
    import numpy as np
    import tensorflow as tf

    coo = matrix.tocoo()
    indices = np.stack([coo.row, coo.col], axis=1).astype(np.int64)
    return tf.sparse.reorder(tf.SparseTensor(indices, coo.data, coo.shape))


def row_count(value):
    """The rows of an in-memory input (its first leaf's first dimension)."""
    import keras

    return int(keras.tree.flatten(value)[0].shape[0])


def _slice(value, start, stop):
    import keras

    return keras.tree.map_structure(lambda a: _rows(a, start, stop), value)


def arrays_as_dataset(call_kwargs, seed=None, method="fit", keras_order=False):
    """Feed a ``fit``/``evaluate`` call's in-memory arrays as one batched ``tf.data.Dataset``.

    ``call_kwargs`` (the call's keyword arguments) is changed in place when ``x``, ``y`` and ``sample_weight`` are
    in-memory arrays (NumPy, dense TensorFlow/JAX/torch tensors, pandas, sparse or ragged tensors, or nested lists,
    tuples, dicts of them; see :func:`as_arrays`): ``validation_split`` is cut off first as Keras does (the last
    samples, before shuffling), the rest is shuffled with ``seed`` every epoch (None: kept in order) and batched by
    ``batch_size`` (default 32). The same seed gives every worker the same order, where Keras's own shuffle is
    unseeded. Returns whether it replaced the arrays. ``method`` is the Keras method called ("fit" or "evaluate").
    ``keras_order`` (with ``seed``): shuffled by Keras's own pipeline instead, whose permutation follows
    TensorFlow's global seed: processes that all called ``keras.utils.set_random_seed(s)`` draw one process's order.
    """
    named = {}
    for name in ("x", "y", "sample_weight"):
        given = call_kwargs.get(name)
        named[name] = as_arrays(given)
        if (given is not None or name == "x") and named[name] is None:
            return False
    import keras
    import tensorflow as tf

    from ._keras_internals import keras_array_batches

    parts = [p for p in named.values() if p is not None]
    split = float(call_kwargs.get("validation_split") or 0.0)
    if split and call_kwargs.get("validation_data") is None:
        rows = row_count(named["x"])
        at = int(rows * (1.0 - split))
        call_kwargs["validation_data"] = tuple(_slice(p, at, rows) for p in parts)
        parts = [_slice(p, 0, at) for p in parts]
        named = dict(zip((n for n in named if named[n] is not None), parts))
    batch_size = call_kwargs.get("batch_size") or 32
    if keras_order and seed is not None:
        batches = keras_array_batches(named["x"], named.get("y"), named.get("sample_weight"), batch_size,
                                      call_kwargs.get("shuffle", True))
    else:  # tf.data reads a Python list as one tensor: lists of arrays (multi-input/output) must be tuples.
        dataset = tf.data.Dataset.from_tensor_slices(tuple(keras.tree.lists_to_tuples(p) for p in parts))
        if seed is not None:
            dataset = dataset.shuffle(row_count(parts[0]), seed=seed, reshuffle_each_iteration=True)
        batches = dataset.batch(batch_size)
    call_kwargs.update(x=batches, y=None, sample_weight=None, batch_size=None)
    if method == "fit":
        call_kwargs.update(shuffle=False, validation_split=0.0)
        if call_kwargs.get("validation_batch_size") is None:  # Keras validates by fit's batch_size, gone from here
            call_kwargs["validation_batch_size"] = batch_size
    return True


def split_validation(call_kwargs, rank, size):
    """``fit``'s ``validation_data`` given in memory (``(x, y[, sample_weight])``, as Keras unpacks it) as rank
    ``rank``'s part of each of its batches (of ``validation_batch_size``, else ``batch_size``). Returns True when
    split; None when there is nothing to split here (no validation data, or an input of whole batches, which
    ``kerasdist_prepare_dataset`` got); False when it is neither (left as it is)."""
    import keras

    validation = call_kwargs.get("validation_data")
    if validation is None or input_kind(validation) is not None:
        return None
    try:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(validation)
    except ValueError:  # more than 3 parts: Keras's own error names them
        return False
    parts = dict(x=x, y=y, sample_weight=sample_weight,
                 batch_size=call_kwargs.get("validation_batch_size") or call_kwargs.get("batch_size"))
    if not arrays_as_dataset(parts, method="evaluate"):
        return False
    call_kwargs["validation_data"] = split_batches(parts["x"], rank, size)
    return True


def split_batches(dataset, rank, size):
    """Rank ``rank``'s part of every batch of ``dataset`` (a ``tf.data.Dataset``, a ``keras.utils.PyDataset``, a
    torch ``DataLoader`` or a generator of batches): rows ``[n*rank//size, n*(rank+1)//size)`` of a batch of
    ``n``. Each batch is split into ``size`` parts of sizes differing by at most one, so every rank runs one step
    per batch and the ranks' steps together cover the whole batch (every rank must see the same batches in the
    same order: for a shuffling DataLoader, see :func:`seed_shuffling_samplers`)."""
    if is_dataset(dataset):
        import tensorflow as tf

        def part(*element):
            structure = element[0] if len(element) == 1 else element
            rows = tf.shape(tf.nest.flatten(structure)[0], out_type=tf.int64)[0]
            start, stop = rows * rank // size, rows * (rank + 1) // size
            return tf.nest.map_structure(lambda t: _rows(t, start, stop), structure)

        return dataset.map(part)
    import keras

    if isinstance(dataset, keras.utils.PyDataset):
        return _part_of_each_batch(dataset, _RowsOfRank(rank, size))
    if input_kind(dataset) == "torch_dataloader":
        return _data_loader_part(dataset, rank, size)
    return (_rows_of_batch(batch, rank, size) for batch in dataset)


def _rows_of_batch(batch, rank, size):
    import keras

    first = next(leaf for leaf in keras.tree.flatten(batch) if leaf is not None)
    rows = int(first.shape[0])
    start, stop = rows * rank // size, rows * (rank + 1) // size
    return keras.tree.map_structure(lambda t: None if t is None else _rows(t, start, stop), batch)


class _RowsOfRank:
    """A batch's rows of one rank (a class, not a closure: a DataLoader's worker processes may pickle it)."""

    def __init__(self, rank, size, collate=None):
        self.rank, self.size, self.collate = rank, size, collate

    def __call__(self, batch):
        return _rows_of_batch(batch if self.collate is None else self.collate(batch), self.rank, self.size)


def _rows(tensor, start, stop):
    """Rows ``[start, stop)`` of an array or a dense, ragged or sparse tensor."""
    if type(tensor).__name__ != "SparseTensor":  # TensorFlow is imported only for what it made
        return tensor[start:stop]
    import tensorflow as tf

    rest = tensor.dense_shape[1:]
    start, stop = tf.cast(start, tf.int64), tf.cast(stop, tf.int64)
    part = tf.sparse.slice(tensor, tf.concat([[start], tf.zeros_like(rest)], 0), tf.concat([[stop - start], rest], 0))
    if tensor.shape.rank is not None:  # tf.sparse.slice forgets the static shape past the rows
        part.set_shape([None] + tensor.shape[1:].as_list())
    return part


def _part_of_each_batch(dataset, part):
    import keras

    class PartOfEachBatch(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                             max_queue_size=dataset.max_queue_size)

        def __len__(self):
            return len(dataset)

        @property
        def num_batches(self):
            return dataset.num_batches

        def __getitem__(self, index):
            return part(dataset[index])

        def on_epoch_begin(self):
            dataset.on_epoch_begin()

        def on_epoch_end(self):
            dataset.on_epoch_end()

    return PartOfEachBatch()


def in_shared_order(dataset, seed):
    """``dataset`` (a ``keras.utils.PyDataset``) with its batches in an order shuffled each epoch from ``seed``: the
    same in every process given the same seed (not one process's order: for processes whose Python ``random``
    states differ, where Keras's own shuffle would differ). Feed it with ``shuffle=False``. An infinite one
    (``num_batches`` None) is returned as it is: Keras never shuffles it."""
    import keras
    import numpy as np

    count = dataset.num_batches  # not len(): a PyDataset may define num_batches only
    if count is None:
        return dataset

    class SharedOrder(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                             max_queue_size=dataset.max_queue_size)
            self.epoch = 0
            self.order = np.random.default_rng([seed, 0]).permutation(count)

        def __len__(self):
            return count

        def __getitem__(self, index):
            return dataset[int(self.order[index])]

        def on_epoch_begin(self):
            dataset.on_epoch_begin()

        def on_epoch_end(self):
            dataset.on_epoch_end()
            self.epoch += 1
            self.order = np.random.default_rng([seed, self.epoch]).permutation(count)

    return SharedOrder()


#: DataLoader arguments that decide its batches: given anew (the batch sampler, or the batch size of an iterable)
_BATCHING = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn")


def _data_loader_part(loader, rank, size):
    """A DataLoader over ``loader``'s dataset and batches (its sampler, worker processes, pinning kept) whose
    collate function keeps rank ``rank``'s rows of each batch it collates."""
    import inspect

    import torch

    kept = {name: getattr(loader, name) for name in inspect.signature(torch.utils.data.DataLoader).parameters
            if name not in _BATCHING and hasattr(loader, name)}
    if kept.get("multiprocessing_context") is None:
        kept.pop("multiprocessing_context", None)
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        batching = dict(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_sampler is not None:
        batching = dict(batch_sampler=loader.batch_sampler)
    else:  # batch_size=None: each sample is a batch
        batching = dict(batch_size=None, sampler=loader.sampler)
    collate = _RowsOfRank(rank, size, loader.collate_fn)
    return torch.utils.data.DataLoader(loader.dataset, collate_fn=collate, **batching, **kept)


def seed_shuffling_samplers(loader, seed):
    """Give a torch ``DataLoader``'s samplers that draw from torch's global generator (a ``shuffle=True``
    loader's RandomSampler made without ``generator=``) a generator seeded with ``seed``: the same batches in
    the same order in every process that gives the same seed. Returns whether it seeded one."""
    import torch

    seeded = False
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler",
                                                                None)):
        if sampler is not None and getattr(sampler, "generator", False) is None:
            sampler.generator = torch.Generator().manual_seed(int(seed))
            seeded = True
    return seeded
