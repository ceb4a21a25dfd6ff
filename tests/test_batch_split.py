"""kerasdist.batch_split's PyDataset wrappers, and plugin_tools' PyDataset refusal under a strategy of several
replicas in one process, in this process (no launch, no model)."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import kerasdist  # noqa: E402
from kerasdist.plugin_tools import (arrays_as_dataset, in_shared_order,  # noqa: E402
                                    read_py_datasets_in_one_processs_order, split_batches, split_validation)


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


@pytest.mark.parametrize("validation", ["validation_data", "validation_split"])
def test_validation_arrays_keep_fits_batch_size_after_the_arrays_become_a_dataset(validation):
    x, y = np.arange(200, dtype="float32").reshape(100, 2), np.zeros((100, 1), "float32")
    call = {"x": x, "y": y, "batch_size": 50, "shuffle": True, "validation_batch_size": None,
            **({"validation_data": (x, y)} if validation == "validation_data" else {"validation_split": 0.5})}
    arrays_as_dataset(call, seed=1, method="fit")
    assert call["validation_batch_size"] == 50  # Keras's own validation batch: fit's batch_size
    split_validation(call, 0, 1)  # as multiworker and horovod split it: was batches of 32 (Keras's default)
    rows = [int(batch[0].shape[0]) for batch in call["validation_data"]]
    assert rows == ([50, 50] if validation == "validation_data" else [50])
