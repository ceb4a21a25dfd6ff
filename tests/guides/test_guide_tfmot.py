"""TensorFlow Model Optimization's "Pruning in Keras" and "Quantization aware training in Keras" examples,
with kerasdist's prune() and quantize() in place of TFMOT's API, on 2 logical CPU replicas
(tests/guides/guide_tfmot_pruning.py and guide_tfmot_qat.py list every changed line)."""

import os
import runpy

import pytest

from tests.guides._harness import observe

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(guide):
    with observe([]) as fits:
        namespace = runpy.run_path(os.path.join(HERE, guide), run_name="__main__")
    return fits, namespace


@pytest.mark.timeout(300)
def test_pruning_example_reaches_80_percent_sparsity_on_2_replicas():
    from kerasdist_plugins import pruning

    fits, ns = _run("guide_tfmot_pruning.py")
    baseline, pruned = fits
    print("pruning example:", pruned["history"], "accuracy", ns["model_for_pruning_accuracy"])
    assert baseline["replicas"] == 1  # the guide's baseline is plain Keras
    assert pruned["strategy"] == "MirroredStrategy" and pruned["replicas"] == 2
    assert pruned["history"]["sparsity"][-1] == pytest.approx(0.8, abs=0.005)
    sparsity = pruning.sparsity(ns["model_for_export"])
    assert len(sparsity) == 2 and all(v == pytest.approx(0.8, abs=0.01) for v in sparsity.values()), sparsity
    # "minimal loss in test accuracy after pruning, compared to the baseline"
    assert ns["model_for_pruning_accuracy"] > 0.5 and ns["baseline_model_accuracy"] > 0.5
    assert ns["model_for_pruning_accuracy"] >= ns["baseline_model_accuracy"] - 0.05
    assert os.path.getsize(ns["pruned_tflite_file"]) > 0 and os.path.getsize(ns["pruned_keras_file"]) > 0


@pytest.mark.timeout(300)
def test_qat_example_trains_on_2_replicas_and_its_int8_file_keeps_the_accuracy():
    fits, ns = _run("guide_tfmot_qat.py")
    baseline, q_aware = fits
    print("QAT example: Keras", ns["q_aware_model_accuracy"], "int8 file", ns["test_accuracy"],
          "bytes float/int8", os.path.getsize(ns["float_file"]), os.path.getsize(ns["quant_file"]))
    assert baseline["replicas"] == 1
    assert q_aware["strategy"] == "MirroredStrategy" and q_aware["replicas"] == 2
    # "minimal to no loss in test accuracy", and "the accuracy from TensorFlow persists to the TFLite backend"
    assert ns["q_aware_model_accuracy"] > 0.5
    assert ns["q_aware_model_accuracy"] >= ns["baseline_model_accuracy"] - 0.05
    assert abs(ns["test_accuracy"] - ns["q_aware_model_accuracy"]) <= 0.02
    # "4x smaller": 3.5x here (the file keeps float input/output and the model is tiny)
    assert os.path.getsize(ns["quant_file"]) * 3 < os.path.getsize(ns["float_file"])
