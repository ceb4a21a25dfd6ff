"""kerasdist.batch_split's PyDataset wrappers, and plugin_tools' PyDataset refusal under a strategy of several
replicas in one process, in this process (no launch, no model)."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import kerasdist  # noqa: E402
from kerasdist.plugin_tools import (in_shared_order, read_py_datasets_in_one_processs_order,  # noqa: E402
                                    split_batches)


class NumBatchesOnly(keras.utils.PyDataset):
    """A PyDataset as Keras 3 documents it: ``num_batches`` (no ``__len__``), and an ``on_epoch_begin``."""

    def __init__(self, count=4):
        super().__init__()
        self.count, self.begun, self.ended = count, 0, 0

    @property
    def num_batches(self):
        return self.count

    def __getitem__(self, index):
        return np.full((2, 1), index, "float32"), np.zeros((2, 1), "float32")

    def on_epoch_begin(self):
        self.begun += 1

    def on_epoch_end(self):
        self.ended += 1


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split_first"])
def test_in_shared_order_takes_num_batches_and_calls_the_users_epoch_hooks(split):
    user = NumBatchesOnly()
    shared = in_shared_order(split_batches(user, 0, 2) if split else user, seed=3)  # was: TypeError (no len())
    assert shared.num_batches == 4
    shared.on_epoch_begin()
    first = sorted(int(shared[i][0][0, 0]) for i in range(4))
    shared.on_epoch_end()
    assert first == [0, 1, 2, 3] and (user.begun, user.ended) == (1, 1)  # on_epoch_begin was dropped


def test_in_shared_order_leaves_an_infinite_py_dataset_as_it_is():
    user = NumBatchesOnly(count=None)
    assert in_shared_order(user, seed=3) is user  # Keras never shuffles an infinite PyDataset


def test_a_threaded_infinite_py_dataset_is_refused_naming_why_and_fixes_that_apply():
    class Threaded(NumBatchesOnly):
        def __init__(self):
            keras.utils.PyDataset.__init__(self, workers=4)
            self.count = None

    call = {"x": Threaded(), "steps_per_epoch": 5, "shuffle": False}  # an infinite one needs steps_per_epoch
    with pytest.raises(kerasdist.KerasdistError) as refused:
        read_py_datasets_in_one_processs_order("fit", call, "mirrored")
    message = str(refused.value)
    assert "num_batches=None" in message and "workers=1" in message
    assert "leave steps_per_epoch out" not in message  # was advised: impossible here, and shuffle is already False
