"""keras.io "Distributed training with Keras 3" (DataParallel, ModelParallel with a LayoutMap) on JAX with
8 host CPU devices, in a child process (the Keras backend is fixed per process)."""

import importlib.util
import json
import os
import textwrap

import pytest

from tests.guides._harness import read_fits
from tests.helpers import PYTHON, ROOT, child_env, run

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                                   reason="needs jax: pip install 'kerasdist[jax]' (make test installs it)")]

HARNESS = os.path.join(ROOT, "tests", "guides", "_harness.py")
GUIDE = os.path.join(ROOT, "tests", "guides", "guide_keras_distribution_jax.py")
JAX_ENV = {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


@pytest.fixture(scope="module")
def guide_fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax_guide")
    run([PYTHON, HARNESS, str(out), GUIDE], timeout=240, env=child_env(**JAX_ENV))
    (process,) = read_fits(out)
    return process["fits"]


@pytest.mark.timeout(300)
def test_data_parallel_replicates_every_weight_on_8_devices_and_trains(guide_fits):
    data_parallel = guide_fits[0]
    print("DataParallel:", data_parallel)
    assert data_parallel["devices"] == 8
    # replicated (stock Keras under set_distribution writes P(None, None), as kerasdist now does)
    assert set(data_parallel["specs"].values()) <= {"P()", "P(None,)", "P(None, None)"}, data_parallel["specs"]
    loss = data_parallel["history"]["loss"]
    assert loss[2] < loss[1] < loss[0]


@pytest.mark.timeout(300)
def test_model_parallel_trains(guide_fits):
    model_parallel = guide_fits[1]
    print("ModelParallel:", model_parallel)
    assert model_parallel["devices"] == 8
    loss = model_parallel["history"]["loss"]
    assert loss[2] < loss[1] < loss[0]


@pytest.mark.timeout(300)
def test_model_parallel_shards_d1_as_its_layout_map_says(guide_fits):
    specs = guide_fits[1]["specs"]
    assert specs["d1/kernel"] == "P(None, 'model')", specs


HYBRID = textwrap.dedent("""
    import json, sys
    import keras
    import kerasdist
    import numpy as np
    from keras import layers

    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
    y = layers.Dropout(0.4)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2")(y)
    model = keras.Model(inputs=inputs, outputs=y)
    model.compile(loss="mse", distribute=kerasdist.hybrid(
        mesh={"data": 2, "model": 4},
        layout={"d1/kernel": (None, "model"), "d1/bias": ("model",), "d2/output": ("data", None)}))
    x, labels = np.random.normal(size=(128, 28, 28, 1)), np.random.normal(size=(128, 10))
    history = model.fit(x, labels, batch_size=16, epochs=3, verbose=0)
    specs = {v.path: str(v.value.sharding.spec) for v in model.weights}
    json.dump({"loss": history.history["loss"], "specs": specs}, open(sys.argv[1], "w"))
""")


@pytest.mark.timeout(300)
def test_the_guides_layout_as_kerasdist_hybrid(tmp_path):
    script, out = tmp_path / "hybrid.py", tmp_path / "hybrid.json"
    script.write_text(HYBRID)
    run([PYTHON, str(script), str(out)], timeout=240, env=child_env(**JAX_ENV))
    result = json.loads(out.read_text())
    print("kerasdist.hybrid with the guide's layout:", result)
    assert result["specs"]["d1/kernel"] == "P(None, 'model')"
    assert result["loss"][-1] < result["loss"][0]
