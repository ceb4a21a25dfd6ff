"""Do all ranks hold the same random state? (issue 29: "the same shuffle order").

When every process ran the same script after ``keras.utils.set_random_seed(s)``, each holds the state one process
would hold, and can make exactly the draws one process's Keras makes (Python's ``random`` shuffles a PyDataset's
batches; Keras's initializers draw their seeds from it too). This compares a digest of such a state across the
ranks with one small collective of any framework: ``sum_arrays(a, b)`` returning the ranks' sums of two float64
arrays (the multiworker ring's ``sum_arrays``, or an all-reduce / all-gather of the plugin's own).
"""

import hashlib
import pickle
import random


def digest_pieces(*states):
    """A 64-bit digest of ``states`` (anything picklable, or arrays/tensors with ``.numpy()``) as four 16-bit
    pieces in float64: their sums and sums of squares over up to 2**20 ranks are exact."""
    import numpy as np  # imported when used: `kerasdist plugins` runs without NumPy

    digest = hashlib.sha256()
    for state in states:
        digest.update(np.asarray(state.numpy()).tobytes() if hasattr(state, "numpy") else pickle.dumps(state))
    bits = int.from_bytes(digest.digest()[:8], "little")
    return int_pieces(bits)


def int_pieces(value):
    """An integer's low 64 bits as four 16-bit pieces in float64 (NaN for ``None``: never the same)."""
    import numpy as np  # imported when used: `kerasdist plugins` runs without NumPy

    if value is None:
        return np.full(4, np.nan)
    bits = int(value) % 2 ** 64
    return np.array([(bits >> shift) & 0xFFFF for shift in (0, 16, 32, 48)], dtype=np.float64)


def same_everywhere(mine, sum_arrays, size):
    """Whether every one of ``size`` ranks holds ``mine`` (pieces from :func:`digest_pieces`): sum x_i = n m and
    sum x_i^2 = n m^2 give sum (x_i - m)^2 = 0. Every rank must call it at the same point."""
    import numpy as np  # imported when used: `kerasdist plugins` runs without NumPy

    mine = np.asarray(mine, dtype=np.float64)
    total, squares = (np.asarray(a, dtype=np.float64) for a in sum_arrays(mine, mine ** 2))
    return bool(np.all(total == mine * size) and np.all(squares == mine ** 2 * size))


def python_random_same_everywhere(sum_arrays, size):
    """Whether every rank's Python ``random`` state (where Keras draws a PyDataset's shuffle) is the same."""
    return same_everywhere(digest_pieces(random.getstate()), sum_arrays, size)


def sum_by_all_gather(all_gather_object):
    """A ``sum_arrays`` from an all-gather of Python objects (``horovod.allgather_object``, torch's
    ``all_gather_object`` wrapped to return the list)."""
    import numpy as np  # imported when used: `kerasdist plugins` runs without NumPy

    def sum_arrays(*arrays):
        gathered = all_gather_object([np.asarray(a).tolist() for a in arrays])
        return [np.sum([np.asarray(rank[i], dtype=np.float64) for rank in gathered], axis=0)
                for i in range(len(arrays))]

    return sum_arrays


def data_loader_states(loader):
    """The torch generator states a ``DataLoader``'s pass draws from: torch's global generator (a shuffling
    sampler without ``generator=`` seeds itself from it, and so does the pass's base seed), the loader's and its
    samplers' own."""
    import torch

    samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    generators = [g for g in (getattr(loader, "generator", None), *(getattr(s, "generator", None) for s in samplers))
                  if g is not None]
    return [torch.get_rng_state(), *(g.get_state() for g in generators)]


def data_loader_draws_alike(loader, sum_arrays, size):
    """Whether every rank's ``loader`` draws one process's batches in one process's order: every rank holds the
    same generator states (the same script after ``keras.utils.set_random_seed``, or torch's fixed default seed).
    Where not, seed its shuffling samplers with one shared seed (``seed_shuffling_samplers``)."""
    return same_everywhere(digest_pieces(*data_loader_states(loader)), sum_arrays, size)
