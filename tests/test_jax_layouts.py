"""hybrid in the keras.io guide's form ("Distributed training with Keras 3"): the user's mesh axis names
(the batch on "data") and layer-output rules ("d2/output"), and the guide's own ModelParallel/DataParallel
objects passed as distribute=, on 8 JAX host devices in their own process."""

import importlib.util
import json
import os

import pytest

import kerasdist
from tests.helpers import ROOT, child_env, python, run

WORKER = os.path.join(ROOT, "tests", "workers", "jax_guide_layout.py")
JAX_ENV = {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    if importlib.util.find_spec("jax") is None:
        pytest.skip("needs jax: pip install 'kerasdist[jax]' (make test installs it)")
    out = tmp_path_factory.mktemp("guide") / "guide.json"
    run(python(WORKER, str(out)), timeout=240, env=child_env(**JAX_ENV))
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_guide_mesh_splits_the_batch_over_data_and_applies_d2_output(guide):
    result = guide["guide"]
    assert result["data_layouts"] and all(axes[0] == "data" and set(axes[1:]) <= {None}
                                          for axes in result["data_layouts"]), result["data_layouts"]
    assert result["d2_output_is_data_none"], result["d2_output"]  # the sharding inside the traced step
    assert result["kernel_spec"] == "P(None, 'model')" and result["bias_spec"] == "P('model',)"
    assert not result["warnings"], result["warnings"]
    print(f"guide's hybrid (data=2, model=4) vs one device, SGD, 2 epochs: max |dw| = {result['max_weight_diff']:.3g}")
    assert result["max_weight_diff"] <= 1e-5


@pytest.mark.timeout(300)
def test_the_guides_model_parallel_object_as_distribute_applies_its_layout_map(guide):
    """distribute=keras.distribution.ModelParallel(layout_map=..., batch_dim_name="data") for a model built
    outside it: laid out as the equivalent kerasdist.hybrid (before: d1/kernel stayed replicated)."""
    result = guide["guide_model_parallel_object"]
    assert result["kernel_spec"] == "P(None, 'model')" and result["bias_spec"] == "P('model',)", result
    assert result["data_layouts"] and all(axes[0] == "data" and set(axes[1:]) <= {None}
                                          for axes in result["data_layouts"]), result["data_layouts"]
    assert result["d2_output_is_data_none"], result["d2_output"]
    assert not result["warnings"], result["warnings"]
    print(f"the guide's ModelParallel object vs one device, SGD, 2 epochs: max |dw| = {result['max_weight_diff']:.3g}")
    assert result["max_weight_diff"] <= 1e-5
    data_parallel = guide["guide_data_parallel_object"]
    assert data_parallel["kernel_spec"] == "P(None, None)" and data_parallel["max_weight_diff"] <= 1e-5, data_parallel
    assert "gives ('model',) (1 dimensions) for d1/kernel of shape (784, 200)" in guide["model_parallel_rule_rank"]


@pytest.mark.timeout(300)
def test_an_output_rule_lays_out_the_layer_output_and_an_unmatched_one_is_warned_about(guide):
    other = guide["output_rule_on_model_axis"]  # not what GSPMD would pick by itself: the rule did it
    assert other["d2_output_is_none_model"] and not other["warnings"], other
    unused = guide["unused_output_rule"]
    assert any("['d9/output'] match no variable and no layer output" in w and "d2/output" in w for w in unused), unused
    assert "'d2/output' gives ('data',) (1 dimensions) for d2/output of shape (None, 10)" in guide["output_rule_rank"]


@pytest.mark.parametrize("mesh, batch_axis, expected", [
    ({"data": 2, "model": 4}, None, "data"),      # Keras's rule: the first axis
    ({"model": 4, "batch": 2}, None, "batch"),    # an axis named "batch" wins
    ({"model": 8}, None, "batch"),                # one axis: pure model parallelism, a "batch" axis of 1 is added
    (None, None, "batch"),
    ({"x": 2, "y": 4}, "y", "y"),
])
def test_which_mesh_axis_the_batch_is_split_along(mesh, batch_axis, expected):
    from kerasdist_plugins.keras_distribution.layout import batch_axis_of

    assert batch_axis_of(mesh, batch_axis) == expected


@pytest.mark.parametrize("options, words", [
    ({"mesh": {"data": 2, "model": 4}, "batch_axis": "batch"}, ["batch_axis='batch'", "['data', 'model']"]),
    ({"batch_axis": ""}, ["batch_axis=''", "mesh axis name"]),
    ({"mesh": {"data": 2}, "layout": [("d1/kernel", (None, "data"))]}, ["layout=[", "path regex"]),
])
def test_bad_batch_axis_or_layout_is_one_clear_error(options, words):
    with pytest.raises(kerasdist.KerasdistError) as info:
        kerasdist.hybrid(**options)
    assert all(word in str(info.value) for word in words), str(info.value)
