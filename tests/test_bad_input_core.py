"""Bad values for the core and `kerasdist launch`/`env`: one clear KerasdistError each, raised in seconds."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist


def _model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])


def test_equal_specs_share_one_strategy_and_both_train():
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    strategies = []
    for distribute in ("mirrored", kerasdist.mirrored(devices=["/cpu:1", "/device:CPU:0"]), "mirrored"):
        model = _model()
        model.compile(loss="mse", optimizer="sgd", distribute=distribute)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        strategies.append(model.distribute_strategy)
    assert strategies[0] is strategies[1] is strategies[2]
    shared = _model()  # data_parallel on TensorFlow is the same MirroredStrategy
    shared.compile(loss="mse", optimizer="sgd", distribute="data_parallel")
    assert shared.distribute_strategy is strategies[0]


def test_a_second_different_strategy_over_the_same_devices_is_refused():
    _model().compile(loss="mse", optimizer="sgd", distribute="mirrored")
    start = time.monotonic()
    with pytest.raises(kerasdist.StrategyConflictError, match="second MirroredStrategy over") as info:
        _model().compile(loss="mse", optimizer="sgd", distribute=kerasdist.mirrored(cross_device_ops="reduce_to_one"))
    assert "cross_device_ops='reduce_to_one'" in str(info.value) and "another process" in str(info.value)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("make", [
    lambda: tf.distribute.MirroredStrategy(["/gpu:0", "/gpu:1"]),
    lambda: tf.distribute.OneDeviceStrategy("/gpu:3"),
    lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:9"]),
], ids=["mirrored-gpus", "one-gpu", "missing-cpu"])
def test_a_users_strategy_over_missing_devices_fails_at_compile(make):
    strategy = make()
    start = time.monotonic()
    with pytest.raises(kerasdist.KerasdistError, match=r"do not exist here; available") as info:
        _model().compile(loss="mse", optimizer="sgd", distribute=strategy)
    assert type(strategy).__name__ in str(info.value)
    assert time.monotonic() - start < 5


def _cli_error(argv, capsys):
    from kerasdist import cli

    start = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - start < 5
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--port-base", "65535", "-n", "2"], ["--port-base 65535 with -n 2", "at most 65534"]),
    (["--port-base", "-5", "-n", "1"], ["--port-base -5"]),
    (["--host", "nohost.invalid", "-n", "1"], ["--host 'nohost.invalid' does not resolve", "127.0.0.1"]),
], ids=["port-base-past-65535", "negative-port-base", "unknown-host"])
def test_bad_launch_values_are_named(argv, words, capsys):
    from tests.test_launch import CHILD

    err = _cli_error(["launch", *argv, CHILD, "ok", "."], capsys)
    assert err.startswith("kerasdist launch: error: ") and "Traceback" not in err
    assert all(word in err for word in words), err


@pytest.mark.parametrize("tf_config,words", [
    ("{bad", ["TF_CONFIG is not valid JSON", "'{bad'"]),
    ('{"cluster": {"worker": ["127.0.0.1:abc"]}, "task": {"type": "worker", "index": 0}}',
     ["'127.0.0.1:abc'", "host:port"]),
], ids=["not-json", "port-abc"])
def test_env_with_a_bad_tf_config_names_it(tf_config, words, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    err = _cli_error(["env"], capsys)
    assert err.startswith("kerasdist env: error: ") and all(word in err for word in words), err


@pytest.mark.parametrize("value", ["4096", "0", "two"])
def test_cpu_replicas_out_of_bounds_is_refused(value):
    from kerasdist.devices import cpu_replicas_from_env

    with pytest.raises(kerasdist.KerasdistError, match=f"KERASDIST_CPU_REPLICAS='{value}' is not valid: give a "
                                                       "whole number from 1 to"):
        cpu_replicas_from_env({"KERASDIST_CPU_REPLICAS": value})


def test_join_timeout_nan_is_named_at_import():
    from tests.helpers import child_env, python, run

    tf_config = '{"cluster": {"worker": ["127.0.0.1:2", "127.0.0.1:3"]}, "task": {"type": "worker", "index": 0}}'
    start = time.monotonic()
    out = run(python("-c", "import kerasdist"), timeout=60, check=False,
              env=child_env(TF_CONFIG=tf_config, KERASDIST_JOIN_TIMEOUT="nan")).stdout
    assert "ClusterConfigError: KERASDIST_JOIN_TIMEOUT='nan' is not valid: give a number >= 0" in out
    assert time.monotonic() - start < 30
