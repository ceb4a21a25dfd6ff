"""One process's shuffle order in every rank (issue 29: "the same shuffle order").

When every rank holds the same random state (after ``keras.utils.set_random_seed``, or torch's fixed default seed),
each rank makes exactly the draws one process's Keras makes, on the same generator, at the same points, and takes
its share of each global batch: the global order is one process's. Plain Keras on torch draws

- arrays (``fit(shuffle=True)``): a ``RandomSampler`` per pass: its seed from torch's global generator when the
  pass's first batch is read (after the pass's ``DataLoader`` drew its base seed, which the rank's own pass draws too);
  ``shuffle="batch"``: one ``torch.randperm`` per batch;
- a ``keras.utils.PyDataset``: ``random.shuffle`` of its batch indices (Python's ``random``) at each pass;
- a torch ``DataLoader``: one ``iter(loader)`` per pass, plus one more after each full pass (Keras's epoch iterator
  makes the next epoch's iterator at once), each drawing a base seed from the loader's generator.

When the states differ, the ranks fall back to one order drawn from a seed rank 0 chose (not one process's order).
Keras 3.16 draws the shuffles of arrays and PyDatasets from the epoch's number alone (a generator seeded with it, at
each pass; the number grows at each epoch's end): every rank makes those draws whatever its random state.
"""

import random

from kerasdist.plugin_tools import keras_shuffles_by_epoch


def same_everywhere(*states):
    """Whether every rank holds the same ``states`` (torch generator states, ``random.getstate()``): one all-reduce
    of their digest's pieces and squares (kerasdist's ``same_everywhere``)."""
    import torch.distributed as dist
    from kerasdist.plugin_tools import digest_pieces
    from kerasdist.plugin_tools import same_everywhere as pieces_same_everywhere

    return pieces_same_everywhere(digest_pieces(*states), _sum_arrays, dist.get_world_size())


def _sum_arrays(*arrays):
    """The ranks' sums of float64 arrays, in one all-reduce."""
    import numpy as np
    import torch
    import torch.distributed as dist

    sizes = [np.size(a) for a in arrays]
    both = torch.from_numpy(np.concatenate([np.ravel(a) for a in arrays]).astype(np.float64))
    dist.all_reduce(both)
    return np.split(both.numpy(), np.cumsum(sizes)[:-1])


def torch_state_same_everywhere():
    import torch

    return same_everywhere(torch.get_rng_state())


def python_state_same_everywhere():
    return same_everywhere(random.getstate())


def array_permutation(size, batch_size, shuffle, epoch):
    """One pass's row order as one process's Keras draws it (array_data_adapter.get_torch_dataloader): from
    torch's global generator (3.15), or from a generator seeded with the epoch's number (3.16)."""
    import numpy as np
    import torch

    generator = torch.Generator().manual_seed(int(epoch)) if keras_shuffles_by_epoch() else None
    if shuffle == "batch":
        order = []
        for begin in range(0, size, batch_size):
            batch = list(range(begin, min(begin + batch_size, size)))
            order += [batch[i] for i in torch.randperm(len(batch), generator=generator)]
        return np.asarray(order, dtype=np.int64)
    if generator is not None:
        return torch.randperm(size, generator=generator).numpy()
    return np.asarray(list(torch.utils.data.RandomSampler(range(size))), dtype=np.int64)


def py_dataset_order(count, epoch):
    """One pass's batch order as one process's Keras draws it (py_dataset_adapter): ``random.shuffle`` (3.15),
    ``random.Random(epoch).shuffle`` (3.16)."""
    indices = list(range(count))
    (random.Random(epoch) if keras_shuffles_by_epoch() else random).shuffle(indices)
    return indices


def draw_loader_base_seed():
    """The draw ``iter(DataLoader)`` makes from torch's global generator (a loader without its own generator)."""
    import torch

    torch.empty((), dtype=torch.int64).random_()


def start_pass(loader, keep_global_state):
    """``iter(loader)`` as one process's pass makes it. ``keep_global_state``: the loader draws its base seed from
    torch's global generator, which the rank's own pass (Keras's wrapper of this rank's share) drew already: put the
    global state back so that the sampler's draws are one process's."""
    import torch

    if not keep_global_state:
        return iter(loader)
    state = torch.get_rng_state()
    iterator = iter(loader)
    torch.set_rng_state(state)
    return iterator
