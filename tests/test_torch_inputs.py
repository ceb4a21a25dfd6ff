"""The torch data_parallel plugin's input split, in this process (a stand-in group of 2 ranks, no collective)."""

import numpy as np
import pytest

pytest.importorskip("torch")

from kerasdist_plugins import torch_distributed  # noqa: E402
from kerasdist_plugins.torch_distributed import group  # noqa: E402


def test_validation_arrays_are_cut_in_fits_batch_size():
    """Keras validates in fit's batch_size (validation_batch_size unset): with validation_steps=1 one process
    evaluates 50 rows. Before, the validation view was cut in batches of 32 (fit's batch_size was already None):
    val_loss 2.572 on both ranks where one process logs 2.866 (/tmp script, 2 ranks)."""
    x, y = np.zeros((100, 4), "float32"), np.zeros((100, 1), "float32")
    call = {"x": x, "y": y, "batch_size": 50, "validation_data": (x, y), "validation_batch_size": None,
            "shuffle": False, "callbacks": []}
    strategy = group.TorchDataParallel(rank=0, world_size=2, local_rank=0, backend="gloo", device="cpu")
    torch_distributed.kerasdist_adjust_call(method="fit", call_kwargs=call, model=None, strategy=strategy,
                                            spec=torch_distributed.TorchDataParallelSpec(backup=False))
    validation = call["validation_data"]
    assert len(validation) == 2 and int(validation[0][0].shape[0]) == 25  # rank 0's half of each 50-row batch
