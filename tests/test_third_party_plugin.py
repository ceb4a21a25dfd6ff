"""A real plugin package, pip-installed, is discovered through its entry point and trains."""

import json
import os
import shutil

import pytest

from tests.helpers import ROOT, child_env, python, run

PACKAGE = os.path.join(ROOT, "examples", "kerasdist-example-plugin")

TRAIN = """
import json, numpy as np, keras, kerasdist
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(loss="mse", optimizer="sgd", distribute="onedevice")
history = model.fit(np.ones((16, 3)), np.ones((16, 1)), epochs=2, verbose=0)
spec = kerasdist.onedevice(device="/cpu:1")
print("RESULT", json.dumps({"strategy": type(model.distribute_strategy).__name__,
                            "loss": history.history["loss"], "device": spec.device}))
"""


@pytest.fixture
def installed_plugin(tmp_path):
    pip = python("-m", "pip", "--disable-pip-version-check", "-q")
    source = shutil.copytree(PACKAGE, tmp_path / "package")  # building in place leaves build/ behind
    run(pip + ["install", "--no-deps", "--no-build-isolation", str(source)], timeout=300)
    try:
        yield
    finally:
        run(pip + ["uninstall", "-y", "kerasdist-example-plugin"], timeout=120)


@pytest.mark.timeout(600)
def test_pip_installed_plugin_is_listed_and_trains(installed_plugin):
    out = run(python("-m", "kerasdist.cli", "plugins", "--json"), timeout=120).stdout
    rows = {r["name"]: r for r in json.loads(out[out.index("["):])}
    assert rows["onedevice"]["package"] == "kerasdist-example-plugin"
    assert rows["onedevice"]["kind"] == "strategy" and rows["onedevice"]["available"] is True

    out = run(python("-c", TRAIN), timeout=180, env=child_env()).stdout
    result = json.loads(out.split("RESULT", 1)[1])
    assert result["strategy"] == "OneDeviceStrategy" and result["device"] == "/cpu:1"
    assert result["loss"][1] < result["loss"][0]

    disabled = run(python("-c", TRAIN), timeout=180, check=False,
                   env=child_env(KERASDIST_DISABLE_PLUGINS="onedevice")).stdout
    assert "disabled by KERASDIST_DISABLE_PLUGINS" in disabled
