"""The torch data_parallel plugin's input split, in this process (a stand-in group of 2 ranks, no collective)."""

import numpy as np
import pytest

pytest.importorskip("torch")

from kerasdist_plugins import torch_distributed  # noqa: E402
from kerasdist_plugins.torch_distributed import group  # noqa: E402


def test_validation_arrays_are_cut_in_fits_batch_size(monkeypatch):
    """Keras validates in fit's batch_size (validation_batch_size unset): with validation_steps=1 one process
    evaluates 50 rows. Before, the validation view was cut in batches of 32 (fit's batch_size was already None):
    val_loss 2.572 on both ranks where one process logs 2.866 (/tmp script, 2 ranks)."""
    x, y = np.zeros((100, 4), "float32"), np.zeros((100, 1), "float32")
    call = {"x": x, "y": y, "batch_size": 50, "validation_data": (x, y), "validation_batch_size": None,
            "shuffle": False, "callbacks": []}
    strategy = group.TorchDataParallel(rank=0, world_size=2, local_rank=0, backend="gloo", device="cpu")
    # a stand-in group of 2 has no process group: the ranks' agreement check (a collective) is tested elsewhere
    monkeypatch.setattr("kerasdist.plugin_tools.check_agreement", lambda *args, **kwargs: None)
    torch_distributed.kerasdist_adjust_call(method="fit", call_kwargs=call, model=None, strategy=strategy,
                                            spec=torch_distributed.TorchDataParallelSpec(backup=False))
    validation = call["validation_data"]
    assert len(validation) == 2 and int(validation[0][0].shape[0]) == 25  # rank 0's half of each 50-row batch


def test_a_py_dataset_without_len_and_an_endless_one_are_split():
    """Keras 3 documents ``num_batches`` (``__len__`` optional; None: endless, read by steps_per_epoch): the split
    called ``len()`` (a raw TypeError). Each rank takes its rows of every batch, and the user's epoch hooks run."""
    import keras

    from kerasdist_plugins.torch_distributed.data import from_py_dataset

    class Batches(keras.utils.PyDataset):
        def __init__(self, count):
            super().__init__()
            self.count, self.ends = count, 0

        @property
        def num_batches(self):
            return self.count

        def __getitem__(self, index):
            return np.full((4, 1), index, "float32"), np.zeros((4, 1), "float32")

        def on_epoch_end(self):
            self.ends += 1

    for count in (3, None):
        source = Batches(count)
        share = from_py_dataset(source, shuffle=False, rank=1, world=2)
        assert share.num_batches == count
        x, _ = share[2]
        assert np.asarray(x).ravel().tolist() == [2.0, 2.0]  # rank 1's 2 rows of batch 2
        share.on_epoch_end()
        assert source.ends == 1


def test_a_shuffling_sampler_inside_a_batch_sampler_is_seeded_alike_when_the_ranks_states_differ(monkeypatch):
    """Where the ranks' random states differ, each shuffling sampler gets rank 0's seed: only ``loader.sampler`` was
    seeded, so a ``batch_sampler=BatchSampler(RandomSampler(...))`` drew its own order in every rank."""
    import torch

    from kerasdist_plugins.torch_distributed import data, keras_order

    monkeypatch.setattr(keras_order, "same_everywhere", lambda *states: False)
    monkeypatch.setattr(data, "shared_seed", lambda: 1234)  # what rank 0 broadcasts
    rows = torch.utils.data.TensorDataset(torch.arange(8.0)[:, None], torch.zeros(8, 1))
    inner = torch.utils.data.RandomSampler(rows)
    loader = torch.utils.data.DataLoader(rows, batch_sampler=torch.utils.data.BatchSampler(inner, 4, False))
    data.from_data_loader(loader, rank=0, world=2)
    assert inner.generator is not None and inner.generator.initial_seed() == 1234
