"""Fails loudly when a Keras release changes the private attributes kerasdist relies on.

Everything checked here is used only in kerasdist/_keras_internals.py.
"""

import keras
import numpy as np
import tensorflow as tf

from kerasdist import _keras_internals as internals


def test_running_keras_is_a_checked_version():
    assert internals.keras_version_checked(), (
        f"Keras {keras.__version__} is not among {internals.CHECKED_KERAS_VERSIONS}: re-check every private "
        "attribute in kerasdist/_keras_internals.py against it, run this file, then add the version.")


def _model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization(),
                             keras.layers.Dropout(0.5)])


def test_model_records_strategy_at_construction():
    assert internals.bound_strategy(_model()) is None
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        assert internals.bound_strategy(_model()) is strategy


def test_optimizer_records_strategy_and_indexes_variables_by_backing_id():
    optimizer = keras.optimizers.SGD()
    assert internals.optimizer_strategy(optimizer) is tf.distribute.get_strategy()
    model = _model()
    optimizer.build(model.trainable_variables)
    keys = set(optimizer._trainable_variables_indices)
    assert keys == {v.value._unique_id for v in model.trainable_variables}
    assert optimizer._trainable_variables == model.trainable_variables


def test_variable_initialize_rebuilds_backing_value_from_a_tensor():
    variable = keras.Variable(np.ones((2,), "float32"))
    old = variable._value
    variable._initialize(tf.convert_to_tensor(old.read_value()))
    assert variable._value is not old
    variable._initialize(old)  # a tf.Variable is kept as is: why internals pass a tensor
    assert variable._value is old


def test_move_keeps_identity_and_values_and_mirrors_everything():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    model = _model()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    before = [v.numpy().copy() for v in model.variables]
    identities = [id(v) for v in model.variables]
    internals.move_to_strategy(model, strategy, optimizer)
    assert [id(v) for v in model.variables] == identities
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in model.variables)
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in optimizer.variables)
    for old, new in zip(before, model.variables):
        np.testing.assert_array_equal(old, new.numpy())
    assert internals.bound_strategy(model) is strategy
    assert internals.optimizer_strategy(optimizer) is strategy
    assert set(optimizer._trainable_variables_indices) == {
        optimizer._var_key(v) for v in model.trainable_variables}
