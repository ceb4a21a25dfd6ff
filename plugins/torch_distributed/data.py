"""Each rank's share of every global batch (``batch_size`` is the global batch, as for every word).

The rule: a global batch of ``n`` rows is cut into the ranks' contiguous shares ``[n*r//W, n*(r+1)//W)``
(sizes differ by at most one), so every rank runs one step per global batch and any ``n`` is handled
exactly (training.py weights each share by its size). A rank whose share is empty (``n < W``) gets the
batch's first row as a placeholder, marked by the sample weight -0.0; it contributes nothing.

Inputs: NumPy arrays (shuffled, when ``fit(shuffle=True)``, in one process's order: keras_order.py), a
``keras.utils.PyDataset`` (batch order shuffled the same way), a torch ``DataLoader`` (iterated in every rank as
one process iterates it) and a ``tf.data.Dataset`` of known length. Where the ranks' random states differ (no seed
set), a shuffle is drawn from a seed rank 0 chose instead: the same in every rank, not one process's. Each becomes a
``keras.utils.PyDataset`` holding this rank's rows.
"""

import numpy as np

import keras

from kerasdist import KerasdistError
from kerasdist.plugin_tools import first_array, is_dataset, keras_shuffles_by_epoch, seed_shuffling_samplers

from . import keras_order
from .training import PLACEHOLDER_MARK


def share(rows, rank, world):
    return rows * rank // world, rows * (rank + 1) // world


def take_share(batch, rank, world):
    """Rank ``rank``'s rows of a global batch (a tuple ``(x[, y[, sample_weight]])`` or a structure)."""
    if not isinstance(batch, tuple):
        batch = (batch,)
    rows = len(first_array(batch[0]))
    start, stop = share(rows, rank, world)
    if stop > start:
        return tuple(_map(lambda a: a[start:stop], part) for part in batch)
    return _placeholder(tuple(_map(lambda a: a[:1], part) for part in batch[:2]))


def _placeholder(first_row):
    """A batch of ``(x[, y])``'s first row that weighs nothing (this rank's share is empty)."""
    return first_row[0], first_row[1] if len(first_row) > 1 else None, np.full((1,), PLACEHOLDER_MARK, "float32")


def _map(function, value):
    if value is None:
        return None
    return keras.tree.map_structure(lambda a: function(_as_array(a)), value)


def _as_array(value):
    if hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


class RankShare(keras.utils.PyDataset):
    """This rank's part of each global batch of a source read in order: ``part(i)`` is its part of batch i.
    Its NumPy arrays are handed to Keras as torch tensors sharing their memory (:func:`_shared_tensor`)."""

    def __init__(self, part, count, rank, world, order=None, source=None):
        super().__init__()
        self._part, self._count, self.rank, self.world = part, count, rank, world
        self._order, self._source = order, source

    def on_epoch_begin(self):
        if self._source is not None:
            self._source.on_epoch_begin()

    def on_epoch_end(self):
        """Keras's adapter calls it where its own epoch number grows (3.16 draws a pass's shuffle from that); a
        user's PyDataset gets its own call (its ``on_epoch_end`` may reorder it, as keras.io's examples do)."""
        if self._order is not None:
            self._order.epoch += 1
        if self._source is not None:
            self._source.on_epoch_end()

    def __len__(self):
        if self._count is None:
            raise TypeError("an endless RankShare has no len(); Keras reads it by steps_per_epoch")
        return self._count

    @property
    def num_batches(self):
        return self._count  # None: endless, as the user's PyDataset

    def build_batch(self):
        """Batch 0 read as one process's ``fit`` reads it to build the model: Keras iterates its ``DataLoader`` once
        (a base seed drawn from torch's global generator), then reads the pass's first batch."""
        keras_order.draw_loader_base_seed()
        return self[0]

    def __getitem__(self, index):
        if self._count is not None and index >= self._count:
            raise IndexError(index)
        return keras.tree.map_structure(_shared_tensor, self._part(index))


# the NumPy dtypes torch.from_numpy takes as they are (Keras's own conversion changes uint32 and bfloat16)
_SHARED_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", "int8", "int16", "int32",
                                                  "int64", "uint8", "bool", "complex64", "complex128"))


def _shared_tensor(value):
    """A writable NumPy array as a torch tensor on its memory: Keras's own conversion (``np.array`` then
    ``torch.as_tensor``) would copy every batch, 4 MB a step in bench/bench_torch.py; anything else as it is."""
    if isinstance(value, np.ndarray) and value.dtype in _SHARED_DTYPES and value.flags.writeable \
            and all(s >= 0 for s in value.strides):
        import torch

        return torch.from_numpy(value)
    return value


def shared_seed():
    """A seed chosen by rank 0, the same in every rank."""
    import torch
    import torch.distributed as dist

    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    dist.broadcast(seed, src=0)
    return int(seed)


class _Order:
    """Order per pass: in order, or a new one drawn each time batch 0 is read: ``keras_draw(epoch)`` (one
    process's Keras order: its random state the same on every rank, or Keras 3.16's draw from the epoch's number,
    which :meth:`RankShare.on_epoch_end` counts as Keras's adapter counts it), else a permutation from the shared
    seed."""

    def __init__(self, size, shuffle, keras_draw=None):
        self.size, self.current, self.draw, self.epoch = size, np.arange(size), None, 0
        if shuffle and keras_draw is not None:
            self.draw = keras_draw
        elif shuffle:
            rng = np.random.default_rng(shared_seed())
            self.draw = lambda epoch: rng.permutation(size)

    def at(self, index):
        if index == 0 and self.draw is not None:
            self.current = np.asarray(self.draw(self.epoch))
        return self.current


def _keras_draws_alike(state_same_everywhere):
    return keras_shuffles_by_epoch() or state_same_everywhere()


def from_arrays(x, y, sample_weight, batch_size, shuffle, rank, world):
    """Only this rank's rows of each global batch are read: a view of the arrays when not shuffled."""
    if sample_weight is not None and y is None:
        raise KerasdistError("data_parallel (torch): sample_weight without y is not supported; give y.")
    size = len(first_array(x))
    count = -(-size // batch_size)
    keras_draw = shuffle and _keras_draws_alike(keras_order.torch_state_same_everywhere) and (
        lambda epoch: keras_order.array_permutation(size, batch_size, shuffle, epoch))
    order = _Order(size, shuffle, keras_draw or None)
    parts = [x] + [p for p in (y, sample_weight) if p is not None]

    def my_part(index):
        begin = index * batch_size
        start, stop = share(min(batch_size, size - begin), rank, world)
        keep = slice(start, stop) if stop > start else slice(0, 1)  # an empty share: a placeholder row
        if order.draw is None:  # in order: a slice (a view, no copy)
            rows = slice(begin + keep.start, begin + keep.stop)
        else:
            rows = order.at(index)[begin:begin + batch_size][keep]
        picked = tuple(keras.tree.map_structure(lambda a: np.asarray(a)[rows], p) for p in parts)
        return picked if stop > start else _placeholder(picked)

    return RankShare(my_part, count, rank, world, order)


def from_py_dataset(dataset, shuffle, rank, world):
    count = dataset.num_batches  # Keras 3's documented length (``__len__`` optional); None: endless, never shuffled
    if count is None:
        return RankShare(lambda index: take_share(dataset[index], rank, world), None, rank, world, source=dataset)
    keras_draw = shuffle and _keras_draws_alike(keras_order.python_state_same_everywhere) and (
        lambda epoch: keras_order.py_dataset_order(count, epoch))
    order = _Order(count, shuffle, keras_draw or None)
    return RankShare(lambda index: take_share(dataset[int(order.at(index)[index])], rank, world), count, rank, world,
                     order, source=dataset)


def from_iterable(make_iterator, count, rank, world, after_pass=None):
    """A source read in order (a DataLoader, a tf.data.Dataset): batch 0 starts a new pass; ``after_pass()`` runs
    once its last batch is read."""
    current = {}

    def batch(index):
        if index == 0 or "it" not in current:
            current["it"] = iter(make_iterator())
        read = _as_tuple(next(current["it"]))
        if after_pass is not None and index == count - 1:
            after_pass()
        return read

    return RankShare(lambda index: take_share(batch(index), rank, world), count, rank, world)


def _as_tuple(batch):
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 3:
        return tuple(batch)
    return (batch,)


def from_data_loader(loader, rank, world):
    """One process's passes (keras_order.py) where every rank holds the same generator states; else a shuffling
    sampler without its own generator gets one seeded by rank 0."""
    import torch

    sampler = getattr(loader, "sampler", None)
    generators = [g for g in (loader.generator, getattr(sampler, "generator", None)) if g is not None]
    if keras_order.same_everywhere(torch.get_rng_state(), *(g.get_state() for g in generators)):
        own_generator = loader.generator is not None
        return from_iterable(lambda: keras_order.start_pass(loader, keep_global_state=not own_generator),
                             len(loader), rank, world, after_pass=(lambda: iter(loader)) if own_generator else None)
    seed_shuffling_samplers(loader, shared_seed())  # the same order in every rank (a batch_sampler's sampler too)
    return from_iterable(lambda: loader, len(loader), rank, world)


def from_tf_dataset(dataset, rank, world, name):
    count = int(dataset.cardinality())
    if count < 0:
        raise KerasdistError(f"{name}: a tf.data.Dataset of unknown or infinite length cannot be split into the "
                             "ranks' shares; give it a known length (e.g. .take(n) or .apply("
                             "tf.data.experimental.assert_cardinality(n))).")
    return from_iterable(dataset.as_numpy_iterator, count, rank, world)


def rank_view(method, value, call_kwargs, rank, world, name):
    """``value`` (``x`` of ``fit``/``evaluate``) as this rank's :class:`RankShare`, or None to leave it."""
    import torch

    shuffle = call_kwargs.get("shuffle", True) if method == "fit" else False  # True, False or "batch"
    shuffle = False if shuffle is None else shuffle
    if isinstance(value, RankShare):
        return None
    if is_dataset(value):
        return from_tf_dataset(value, rank, world, name)
    if isinstance(value, torch.utils.data.DataLoader):
        return from_data_loader(value, rank, world)
    if isinstance(value, keras.utils.PyDataset):
        return from_py_dataset(value, shuffle, rank, world)
    if is_arrays(value):
        return from_arrays(value, call_kwargs.get("y"), call_kwargs.get("sample_weight"),
                           int(call_kwargs.get("batch_size") or 32), shuffle, rank, world)
    return None


def is_arrays(value):
    leaves = keras.tree.flatten(value) if value is not None else []
    return bool(leaves) and all(isinstance(a, np.ndarray) or hasattr(a, "__array__") and not hasattr(a, "cardinality")
                                for a in leaves)


def split_validation(call_kwargs):
    """``validation_split`` of in-memory arrays cut off as Keras does (the last rows, before shuffling)."""
    split = float(call_kwargs.get("validation_split") or 0.0)
    x = call_kwargs.get("x")
    if not split or call_kwargs.get("validation_data") is not None or not is_arrays(x):
        return
    at = int(np.floor(len(first_array(x)) * (1.0 - split)))
    parts = [p for p in (x, call_kwargs.get("y"), call_kwargs.get("sample_weight")) if p is not None]
    call_kwargs["validation_data"] = tuple(keras.tree.map_structure(lambda a: a[at:], p) for p in parts)
    for key, part in zip(("x", "y", "sample_weight"), (x, call_kwargs.get("y"), call_kwargs.get("sample_weight"))):
        if part is not None:
            call_kwargs[key] = keras.tree.map_structure(lambda a: a[:at], part)
    call_kwargs["validation_split"] = 0.0
