"""distribute="tpu": everything up to the TPU itself, and the errors without one."""

import os
import socket

import keras
import pytest
import tensorflow as tf

import kerasdist
import kerasdist_plugins.tpu as tpu_plugin
from runif import run_if
from tests.helpers import free_port


def _model():
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])


def test_listed_unavailable_here_with_the_reason():
    row = next(r for r in kerasdist.list_plugins() if r["name"] == "tpu")
    assert row["kind"] == "strategy" and row["available"] is False
    assert "no TPU here" in row["reason"] and "TPU_NAME" in row["reason"]


def test_compile_without_tpu_is_a_clear_error():
    with pytest.raises(kerasdist.PluginUnavailableError, match="'tpu' cannot run here: no TPU here"):
        _model().compile(loss="mse", distribute="tpu")


def test_auto_does_not_pick_tpu_without_one():
    assert tpu_plugin.kerasdist_auto_strategy(kerasdist.ClusterInfo.local()) is None


def test_absent_reason_sees_tpu_name_and_tpu_vm_devices(tmp_path):
    assert tpu_plugin.tpu_absent_reason({"TPU_NAME": "my-tpu"}) is None
    (tmp_path / "accel0").touch()
    assert tpu_plugin.tpu_absent_reason({}, device_glob=str(tmp_path / "accel*")) is None
    assert tpu_plugin.tpu_absent_reason({}, device_glob=str(tmp_path / "none*"))


def test_unreachable_tpu_address_fails_fast_instead_of_hanging(monkeypatch):
    address = f"grpc://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("TPU_NAME", address)
    with pytest.raises(kerasdist.PluginUnavailableError, match="not reachable") as info:
        _model().compile(loss="mse", distribute="tpu")
    assert address in str(info.value)


def test_local_tpu_missing_is_wrapped(monkeypatch):
    monkeypatch.setenv("TPU_NAME", "local")
    with pytest.raises(kerasdist.PluginUnavailableError, match="no usable TPU at tpu='local'"):
        _model().compile(loss="mse", distribute=kerasdist.tpu(tpu="local"))


def test_strategy_built_from_resolver_up_to_the_hardware(monkeypatch):
    """TPU hardware is mocked at its boundary (initialize + TPUStrategy); the plugin's code is real."""
    calls = []

    class FakeStrategy:
        def __init__(self, resolver):
            calls.append(("strategy", resolver))

    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", lambda r: calls.append(("init", r)))
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: calls.append(("connect", r)))
    monkeypatch.setattr(tf.distribute, "TPUStrategy", FakeStrategy)
    strategy = tpu_plugin.kerasdist_create_strategy(kerasdist.tpu(tpu="local", zone="us-central1-b"))
    assert isinstance(strategy, FakeStrategy)
    assert [name for name, _ in calls] == ["init", "strategy"]  # local: no remote connect
    resolver = calls[0][1]
    assert isinstance(resolver, tf.distribute.cluster_resolver.TPUClusterResolver)
    assert calls[1][1] is resolver

    calls.clear()
    with socket.socket() as listener:  # a reachable grpc:// address: connect, then initialize
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = f"grpc://127.0.0.1:{listener.getsockname()[1]}"
        tpu_plugin.kerasdist_create_strategy(kerasdist.tpu(tpu=target))
    assert [name for name, _ in calls] == ["connect", "init", "strategy"]
    assert calls[0][1].master() == target


@run_if(tpu=True)
def test_trains_on_a_real_tpu():
    model = _model()
    model.compile(loss="mse", optimizer="sgd", distribute="tpu")
    assert isinstance(model.distribute_strategy, tf.distribute.TPUStrategy)
    model.fit(tf.ones((64, 2)), tf.ones((64, 1)), batch_size=8, verbose=0)
    assert os.environ.get("TPU_NAME") or True
