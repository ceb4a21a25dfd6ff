"""Two MirroredStrategy objects over the same devices in one process (issue 19).

Each MirroredStrategy numbers its collective ops from the same keys; TensorFlow's runtime pins each key's
shape, so the second strategy's first all-reduce of another shape aborted every collective ("Shape
mismatch in the collective instance 100"). kerasdist gives every MirroredStrategy it trains with keys of
its own.
"""

import keras
import numpy as np
import tensorflow as tf

from kerasdist._keras_internals.collectives import collective_group_keys

BATCH = 16


def _data(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8 * BATCH, 6)).astype("float32")
    return x, (x @ rng.normal(size=(6, 1))).astype("float32")


def _model(width, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(1)])


def _compiled(width, seed, distribute):
    model = _model(width, seed)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", distribute=distribute)
    return model


def _fit(model, seed):
    model.fit(*_data(seed), batch_size=BATCH, shuffle=False, verbose=0)


def _assert_same_weights(model, alone):
    for a, b in zip(model.get_weights(), alone.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_users_strategy_and_mirrored_train_in_turn_as_each_model_alone():
    """Model A with the user's MirroredStrategy, model B with distribute="mirrored" (another model: other
    all-reduce shapes), then A again: each ends where it ends trained alone on one device."""
    users = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    a, b = _compiled(16, 1, users), _compiled(40, 2, "mirrored")
    _fit(a, 1)
    _fit(b, 2)
    _fit(a, 3)
    assert a.distribute_strategy is users and b.distribute_strategy is not users
    assert not collective_group_keys(users) & collective_group_keys(b.distribute_strategy)

    a_alone, b_alone = _compiled(16, 1, None), _compiled(40, 2, None)
    _fit(a_alone, 1)
    _fit(a_alone, 3)
    _fit(b_alone, 2)
    _assert_same_weights(a, a_alone)
    _assert_same_weights(b, b_alone)
    assert max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), _model(16, 1).get_weights())) > 1e-2


def test_two_users_strategies_and_a_hand_written_one_train_in_turn():
    """Two strategy objects of the user's passed as distribute=, and a third used by plain Keras code
    (its keys are TensorFlow's defaults): none aborts another's collectives."""
    first, second = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) for _ in range(2))
    a, b = _compiled(8, 3, first), _compiled(24, 4, second)
    hand_written = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with hand_written.scope():
        c = _model(12, 5)
        c.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for model, seed in ((a, 1), (c, 2), (b, 3), (a, 4), (c, 5)):
        _fit(model, seed)
    b_alone = _compiled(24, 4, None)
    _fit(b_alone, 3)
    _assert_same_weights(b, b_alone)
