"""distribute="central_storage": numerically equal to one device; bad devices named."""

import keras
import pytest
import tensorflow as tf

import kerasdist
from tests.test_mirrored import STEPS, _max_weight_difference, _mlp, _train


def test_two_replicas_equal_one_device_after_20_sgd_steps():
    sgd = lambda: keras.optimizers.SGD(learning_rate=0.05)  # noqa: E731
    single, _ = _train(None, sgd)
    central, optimizer = _train("central_storage", sgd)
    strategy = central.distribute_strategy
    assert isinstance(strategy, tf.distribute.experimental.CentralStorageStrategy)
    assert strategy.num_replicas_in_sync == 2 and int(optimizer.iterations.numpy()) == STEPS
    assert _max_weight_difference(single, central) <= 1e-5
    assert _max_weight_difference(single, _mlp()) > 1e-2


def test_unknown_parameter_device_is_named():
    with pytest.raises(kerasdist.KerasdistError, match="central_storage.*'/gpu:3'"):
        _mlp().compile(loss="mse", distribute=kerasdist.central_storage(parameter_device="/gpu:3"))
