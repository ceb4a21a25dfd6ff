"""Keras 3.16 (keras-nightly): its torch trainer wraps the model in DistributedDataParallel by itself once
torch.distributed is initialised (keras-team/keras#23316), averaging every rank's gradient with the same weight,
and sums every metric state over the ranks in ``get_metrics_result``. kerasdist turns both off for the models it
distributes and averages once, itself (each rank weighted by its rows, synchronized BatchNormalization): training
and logs equal one process. Run by ``make test-keras-nightly``; skipped on Keras 3.15 (whose trainer has no DDP:
the torch equivalence rows cover it).
"""

import importlib.util
import os

import numpy as np
import pytest

from helpers import PYTHON, ROOT, child_env, run, torch_env, torchrun_two


def keras_version():
    from kerasdist._keras_internals.versions import installed_keras_version

    return installed_keras_version() or "0"


def keras_trainer_wraps_ddp():
    from kerasdist.plugin_tools import keras_wraps_ddp

    return keras_wraps_ddp()


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
              pytest.mark.skipif(not keras_trainer_wraps_ddp(),
                                 reason=f"Keras {keras_version()}: the trainer's own DDP comes with 3.16 "
                                        "(make test-keras-nightly)")]

WORKER = os.path.join(ROOT, "tests", "workers", "torch_nightly_ddp.py")


@pytest.mark.timeout(400)
def test_the_trainers_own_ddp_is_off_and_training_equals_one_process(tmp_path):
    plain = str(tmp_path / "plain")
    run([PYTHON, WORKER, plain, "none"], timeout=180, env=child_env(**torch_env()))
    out = str(tmp_path / "ddp")
    for code, output in torchrun_two([WORKER, out, "data_parallel"]):
        assert code == 0, output[-4000:]
    expected = np.load(f"{plain}-rank0.npz")
    for rank in range(2):
        got = np.load(f"{out}-rank{rank}.npz")
        print(f"rank {rank}: DDP wraps per module {got['wrapped'].tolist()}, kerasdist averaging "
              f"{int(got['kerasdist_averages'])}")
        assert int(got["wrapped"].max()) == 0, "the trainer's DistributedDataParallel wrapped the model"
        assert int(got["ddp_of_ddp"]) == 0, "a DistributedDataParallel was wrapped in another"
        assert int(got["kerasdist_averages"]) == 1, "kerasdist did not average the gradients itself"
        difference = max(float(np.abs(expected[f"w{i}"] - got[f"w{i}"]).max())
                         for i in range(sum(n.startswith("w") and n[1:].isdigit() for n in expected.files)))
        print(f"rank {rank}: max |w - w_one_process| = {difference:.3g}")
        assert difference <= 1e-5
        np.testing.assert_allclose(got["logs"], expected["logs"], atol=1e-5, rtol=1e-6)  # summed once
