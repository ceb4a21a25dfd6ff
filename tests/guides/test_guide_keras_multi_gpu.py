"""keras.io "Multi-GPU distributed training with TensorFlow", run as a kerasdist user would
(tests/guides/guide_keras_multi_gpu.py lists every changed line) on 2 logical CPU replicas."""

import os

import pytest

from tests.guides._harness import assert_trained_on_replicas, run_in_this_process

GUIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guide_keras_multi_gpu.py")


@pytest.fixture(scope="module")
def guide_run(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("ckpt")
    fits = []
    namespace, error = run_in_this_process(GUIDE, fits, {"GUIDE_CKPT_DIR": str(checkpoints)})
    if error is not None:
        print(f"the guide stopped: {error!r}")
    return fits, namespace, checkpoints


@pytest.mark.timeout(300)
def test_single_host_part_trains_on_2_replicas(guide_run):
    fits, namespace, _ = guide_run
    assert_trained_on_replicas(fits[0], "val_sparse_categorical_accuracy")
    loss, accuracy = namespace["model"].evaluate(namespace["test_dataset"], verbose=0)
    assert accuracy > 0.5


@pytest.mark.timeout(300)
def test_fault_tolerance_part_checkpoints_a_model_trained_on_2_replicas(guide_run):
    fits, _, checkpoints = guide_run
    assert len(fits) == 3  # part 1, then run_training twice
    created = fits[1]
    assert created["replicas"] == 2 and created["epochs"] == [0]
    assert os.listdir(checkpoints) == ["ckpt-1.keras"]


@pytest.mark.timeout(300)
def test_restored_model_resumes_training_on_2_replicas(guide_run):
    fits, _, _ = guide_run
    created, restored = fits[1], fits[2]
    print("restored:", restored)
    assert restored["strategy"] == "MirroredStrategy" and restored["replicas"] == 2
    # it resumed from the checkpoint: its first epoch starts where the created model's ended
    assert restored["history"]["loss"][0] < created["history"]["loss"][0]
