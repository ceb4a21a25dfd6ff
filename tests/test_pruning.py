"""distribute=[..., "prune"]: TFMOT's schedule math, exact top-k masks, identical replicas, strip, errors."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist
from kerasdist_plugins import pruning


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def _replica_values(variable):
    value = variable.value
    return [v.numpy() for v in value.values] if hasattr(value, "values") else [value.numpy()]


# -- schedule math -------------------------------------------------------------

def test_polynomial_schedule_matches_tfmot_values():
    """Values TFMOT 0.8.1's PolynomialDecay(0 -> 0.8, steps 0..100, frequency 10) returned (notes, e2)."""
    spec = pruning.Prune(target_sparsity=0.8, initial_sparsity=0.0, begin_step=0, end_step=100, frequency=10)
    assert pruning.scheduled_sparsity(spec, 5, 100) == pytest.approx(0.114, abs=5e-4)
    assert pruning.scheduled_sparsity(spec, 50, 100) == pytest.approx(0.70)
    assert pruning.scheduled_sparsity(spec, 150, 100) == pytest.approx(0.80)
    assert pruning.last_pruning_step(spec, 5, 100) == 0
    assert pruning.last_pruning_step(spec, 50, 100) == 50
    assert pruning.last_pruning_step(spec, 59, 100) == 50
    assert pruning.last_pruning_step(spec, 150, 100) == 100  # no pruning after end_step


def test_end_step_is_a_pruning_step_even_off_the_frequency_grid():
    spec = pruning.Prune(target_sparsity=0.5, end_step=25, frequency=10)
    assert [pruning.last_pruning_step(spec, s, 25) for s in (9, 10, 24, 25, 99)] == [0, 10, 20, 25, 25]
    assert pruning.scheduled_sparsity(spec, 25, 25) == 0.5


def test_constant_schedule():
    spec = pruning.Prune(target_sparsity=0.6, schedule="constant", begin_step=3, frequency=5)
    assert pruning.last_pruning_step(spec, 2, None) is None
    assert [pruning.last_pruning_step(spec, s, None) for s in (3, 7, 8, 1000)] == [3, 3, 8, 998]
    assert pruning.scheduled_sparsity(spec, 3, None) == 0.6


def test_mask_keeps_exactly_the_largest_magnitudes():
    kernel = keras.Variable(np.random.default_rng(1).normal(size=(4, 8)).astype("float32"))
    mask = keras.ops.convert_to_numpy(pruning.magnitude_mask(kernel, 0.75))
    assert mask.shape == (4, 8) and mask.sum() == 8
    magnitudes = np.abs(kernel.numpy())
    assert magnitudes[mask == 1].min() > magnitudes[mask == 0].max()


# -- training -----------------------------------------------------------------------

def _train(distribute):
    x, y = _data()
    model = _dense_model()
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), distribute=distribute)
    history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)
    return model, history


def test_mirrored_pruning_equals_single_device_pruning():
    """2 CPU replicas and one device: the same masks, exact target sparsity, identical replicas."""
    spec = kerasdist.prune(target_sparsity=0.75, end_step=12, frequency=4)  # prunes at steps 0, 4, 8, 12
    single, single_history = _train([spec])
    mirrored, mirrored_history = _train(["mirrored", spec])
    assert isinstance(mirrored.distribute_strategy, tf.distribute.MirroredStrategy)
    assert mirrored.distribute_strategy.num_replicas_in_sync == 2

    single_state, mirrored_state = pruning.state_of(single), pruning.state_of(mirrored)
    assert mirrored_state.last_pruned_step == single_state.last_pruned_step == 12
    for a, b in zip(single_state.masks, mirrored_state.masks):
        replicas = _replica_values(b)
        assert len(replicas) == 2 and all(np.array_equal(replicas[0], r) for r in replicas)
        assert np.array_equal(a.numpy(), replicas[0])
    for variable in mirrored.weights:
        replicas = _replica_values(variable)
        assert all(np.array_equal(replicas[0], r) for r in replicas)
    for a, b in zip(single.weights, mirrored.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)

    # 16 steps: the target is reached at step 12 and held by the in-graph mask for steps 12..15.
    assert list(pruning.sparsity(single).values()) == list(pruning.sparsity(mirrored).values()) == [0.75, 0.75]
    for layer in mirrored.layers:
        assert int(np.sum(layer.kernel.numpy() == 0)) == 0.75 * np.prod(layer.kernel.shape)
    assert mirrored_history.history["sparsity"] == single_history.history["sparsity"]
    # epoch 0 ends at step 4, a pruning step: 0.75 - 0.75 * (1 - 4/12)**3 = 0.528, rounded per kernel
    assert mirrored_history.history["sparsity"][0] == pytest.approx(0.528, abs=1e-3)
    assert mirrored_history.history["sparsity"][-1] == 0.75


def test_default_end_step_is_the_end_of_fit_and_strip_leaves_plain_keras():
    x, y = _data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    images = np.random.default_rng(2).normal(size=(32, 6, 6, 1)).astype("float32")
    model.compile(loss="mse", optimizer="sgd", distribute=["mirrored", kerasdist.prune(target_sparsity=0.5)])
    model.fit(images, y[:32, :2], batch_size=8, epochs=2, verbose=0)  # 8 steps: prunes at 0 and 8
    assert pruning.state_of(model).end_step == 8
    assert list(pruning.sparsity(model).values()) == [0.5, 0.5]

    pruning.strip(model)
    assert pruning.state_of(model) is None
    assert all(layer.kernel.constraint is None for layer in model.layers if hasattr(layer, "kernel"))
    assert list(pruning.sparsity(model).values()) == [0.5, 0.5]  # still exactly zero after strip
    model.fit(images, y[:32, :2], batch_size=8, epochs=1, verbose=0)  # no masks any more: weights regrow
    assert all(s < 0.5 for s in pruning.sparsity(model).values())


def test_unknown_size_input_needs_end_step():
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(16)
    model = _dense_model()
    model.compile(loss="mse", optimizer="sgd", distribute="prune")
    with pytest.raises(kerasdist.KerasdistError, match="end_step=None.*give prune\\(end_step=...\\)"):
        model.fit(dataset, epochs=1, verbose=0)


def test_layers_option_prunes_only_the_named_layers():
    model = _dense_model()
    model.compile(loss="mse", optimizer="sgd",
                  distribute=kerasdist.prune(target_sparsity=0.5, schedule="constant", layers=[model.layers[1].name]))
    x, y = _data(16)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert list(pruning.sparsity(model)) == [model.layers[1].name]
    assert float(np.mean(model.layers[0].kernel.numpy() == 0)) == 0.0


# -- errors -------------------------------------------------------------------------

def test_invalid_sparsity_is_one_clear_error():
    with pytest.raises(kerasdist.KerasdistError,
                       match=r"target_sparsity=1\.5 is not valid; give a fraction in \[0, 1\)"):
        kerasdist.prune(target_sparsity=1.5)
    with pytest.raises(kerasdist.KerasdistError, match="schedule='linear' is not valid"):
        kerasdist.prune(schedule="linear")
    with pytest.raises(kerasdist.KerasdistError, match="end_step=0 is not valid"):
        kerasdist.prune(end_step=0)


def test_model_without_prunable_layers_fails_at_compile():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Rescaling(2.0), keras.layers.Activation("relu")])
    with pytest.raises(kerasdist.KerasdistError, match="has no prunable layers.*Rescaling.*prune\\(layers="):
        model.compile(loss="mse", distribute=["mirrored", "prune"])


def test_unknown_layer_name_is_named():
    model = _dense_model()
    with pytest.raises(kerasdist.KerasdistError, match="names \\['nope'\\] that the model does not have"):
        model.compile(loss="mse", distribute=kerasdist.prune(layers=["nope"]))


def test_registered_as_an_optimization():
    row = next(r for r in kerasdist.list_plugins() if r["name"] == "prune")
    assert row["kind"] == "optimization" and row["available"], row


def test_steps_per_execution_still_reaches_the_exact_target():
    """Callbacks see every 4th step only: pruning steps in between are caught up, the target is exact."""
    x, y = _data()
    model = _dense_model()
    # One device: Keras 3.15's MirroredStrategy fails with steps_per_execution > 1 even without kerasdist.
    model.compile(loss="mse", optimizer="sgd", steps_per_execution=4,
                  distribute=kerasdist.prune(target_sparsity=0.6, end_step=14, frequency=3))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)  # 16 steps, callbacks at 0, 4, 8, 12, end
    assert pruning.state_of(model).last_pruned_step == 14
    for layer in model.layers:
        assert int(np.sum(layer.kernel.numpy() == 0)) == round(0.6 * np.prod(layer.kernel.shape))


def _weight_sparsity(model):
    kernels = [layer.kernel.numpy() for layer in pruning.state_of(model).layers]
    return sum(int(np.sum(k == 0)) for k in kernels) / sum(k.size for k in kernels)


@pytest.mark.parametrize("frequency,epochs", [(100, 20), (100, 3)], ids=["default-frequency", "shorter-than-one-period"])
def test_logged_sparsity_at_the_last_epoch_is_the_weights_own(frequency, epochs):
    x, y = _data(64)
    model = _dense_model()
    model.compile(loss="mse", optimizer="sgd",
                  distribute=kerasdist.prune(target_sparsity=0.75, frequency=frequency))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0)  # 8 steps an epoch
    logged = history.history["sparsity"]
    assert logged[-1] == _weight_sparsity(model) == 0.75, logged
    assert logged == sorted(logged)
    short = [w for w in caught if "frequency=100" in str(w.message)]
    assert bool(short) == (epochs * 8 <= frequency)
