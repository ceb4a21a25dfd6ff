"""predict over the ranks: each rank predicts its contiguous share of the rows of in-memory arrays, and every
rank gets every prediction, in the input's order (``all_gather_object``). Other inputs (a DataLoader, a
PyDataset, tf.data) are predicted whole in every rank: the same predictions everywhere."""

import numpy as np

import keras

from kerasdist.plugin_tools import first_array

from .data import is_arrays, share


def predict(call, call_kwargs, rank, world):
    import torch.distributed as dist

    x = call_kwargs.get("x")
    if not is_arrays(x):
        return call(**call_kwargs)
    rows = len(first_array(x))
    start, stop = share(rows, rank, world)
    empty = stop <= start
    mine = keras.tree.map_structure(lambda a: np.asarray(a)[start:stop], x)
    if empty:
        mine = keras.tree.map_structure(lambda a: np.asarray(a)[:1], x)
    result = call(**dict(call_kwargs, x=mine))
    if empty:
        result = keras.tree.map_structure(lambda a: a[:0], result)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts, axis=0), *gathered)
