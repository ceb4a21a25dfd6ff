"""distribute="central_storage": numerically equal to one device (mixed precision, BatchNormalization,
Dropout and metrics included); bad devices named."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist
from tests.test_mirrored import STEPS, _max_weight_difference, _mlp, _train
from tests.test_mirrored_inputs import check_py_datasets_train_in_one_processs_shuffled_order


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


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _loss_scaled_run(distribute, x, y, batch_size=16, initial_scale=256.0):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                                            initial_scale, dynamic_growth_steps=3),
                  distribute=distribute)
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
    optimizer = model.optimizer
    return ([w.numpy() for w in model.weights], float(optimizer.dynamic_scale.numpy()),
            int(optimizer.step_counter.numpy()), int(optimizer.iterations.numpy()))


def test_mixed_float16_loss_scale_grows_and_counts_as_on_one_device(mixed_float16):
    """8 steps with dynamic_growth_steps=3: the scale doubles twice and the counter ends at 2 (a scale
    low enough that no step overflows)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype("float32"), rng.normal(size=(128, 1)).astype("float32")
    weights, scale, counter, steps = _loss_scaled_run(None, x, y)
    theirs, their_scale, their_counter, their_steps = _loss_scaled_run("central_storage", x, y)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, theirs))
    print(f"central_storage, mixed_float16: max |dw| = {diff:.3g}, scale {their_scale}, counter {their_counter}")
    assert (their_scale, their_counter, their_steps) == (scale, counter, steps) == (256.0 * 4, 2, 8)
    assert diff <= 2.0 ** -11 * max(float(np.abs(w).max()) for w in weights)


@pytest.mark.parametrize("distribute", ["central_storage", "mirrored"])
def test_an_overflow_in_one_replicas_share_skips_the_step_for_every_replica(mixed_float16, distribute):
    """The second half of the batch (replica 1's share) is beyond float16's range: one device skips the
    step and halves the scale; so must both replicas (Keras alone takes replica 0's finite answer and
    applies NaN: what stock MirroredStrategy does)."""
    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    x[8:] = 1e5
    weights, scale, _, _ = _loss_scaled_run(None, x, y, initial_scale=32768.0)
    theirs, their_scale, _, _ = _loss_scaled_run(distribute, x, y, initial_scale=32768.0)
    assert their_scale == scale == 32768.0 / 2
    for a, b in zip(weights, theirs):
        np.testing.assert_array_equal(a, b)


def _batch_norm_run(distribute):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), distribute=distribute)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights]


def test_batch_norm_and_dropout_without_sync_train_as_mirrored():
    """Per-replica statistics, as mirrored's default; the moving statistics are the first replica's, the
    values a MirroredStrategy's primary copy holds (the ones it saves)."""
    mirrored, central = _batch_norm_run("mirrored"), _batch_norm_run("central_storage")
    diff = max(float(np.abs(a - b).max()) for a, b in zip(mirrored, central))
    print(f"BatchNormalization + Dropout, central_storage vs mirrored: max |dw| = {diff:.3g}")
    assert diff <= 1e-6


def test_metrics_and_evaluate_equal_one_device_over_many_steps():
    """Keras's metric update ``assign(total + x)`` once summed the old total once per replica."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")

    def run(distribute):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), metrics=["mae"], distribute=distribute)
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False).history
        return history["loss"] + history["mae"] + model.evaluate(x, y, batch_size=8, verbose=0)

    np.testing.assert_allclose(run("central_storage"), run(None), rtol=0, atol=1e-5)


def test_a_py_dataset_trains_in_one_processs_shuffled_order():
    """Issue 29: as under mirrored (tests/test_mirrored.py), a threaded and a plain PyDataset read by batch index;
    before: 5 runs of 5 off (max |dw| 0.2 to NaN), the matrix's 0.026 and val_loss 0.41 in 2 runs of 4."""
    check_py_datasets_train_in_one_processs_shuffled_order("central_storage", runs=2)


def test_jit_compile_trains_as_one_process():
    """KerasHub getting-started's custom model (an Embedding first) with jit_compile=True, which mirrored refuses
    (XLA on CPU replicas): under central_storage the variables live on one device and XLA trains it exactly."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, size=(37, 5)), rng.normal(size=(37, 1)).astype("float32")

    def fit(distribute, jit_compile):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=jit_compile,
                      distribute=distribute)
        return model, model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]

    single, single_losses = fit(None, False)
    central, losses = fit("central_storage", True)
    assert central.jit_compile is True
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(single.get_weights(), central.get_weights())) <= 1e-6
    assert np.allclose(single_losses, losses, atol=1e-6)
