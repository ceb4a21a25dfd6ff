"""Global batches that do not split evenly over the replicas (a last batch smaller than the number of
replicas, odd batch sizes) train exactly as on one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist


def _data(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _train(distribute, fit_input, **fit_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), metrics=["mae"], distribute=distribute)
    history = model.fit(*fit_input, epochs=3, verbose=0, shuffle=False, **fit_kwargs)
    evaluation = model.evaluate(*fit_input, verbose=0, **{k: v for k, v in fit_kwargs.items() if k == "batch_size"})
    return [w.numpy() for w in model.weights], history.history, evaluation


def _inputs(kind):
    x, y = _data(16 if kind == "dataset" else 37)
    if kind == "dataset":  # batches of 3 and a last batch of 1: one replica gets nothing
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(3),), {}
    return (x, y), {"batch_size": 7}  # 7 = 4 + 3 per replica, and a last batch of 2


@pytest.mark.parametrize("kind", ["dataset", "numpy"])
@pytest.mark.parametrize("distribute", ["mirrored", "data_parallel", "central_storage"])
def test_uneven_batches_train_like_one_device(distribute, kind):
    fit_input, fit_kwargs = _inputs(kind)
    reference = _train(None, fit_input, **fit_kwargs)
    weights, history, evaluation = _train(distribute, fit_input, **fit_kwargs)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference[0]))
    print(f"{distribute}, {kind}: max |w - one device| = {diff:.3g}")
    assert diff <= 1e-5
    np.testing.assert_allclose(history["loss"], reference[1]["loss"], atol=1e-5)
    np.testing.assert_allclose(history["mae"], reference[1]["mae"], atol=1e-5)
    np.testing.assert_allclose(evaluation, reference[2], atol=1e-5)


@pytest.mark.parametrize("distribute", ["mirrored", "central_storage", "data_parallel"])
def test_gradient_accumulation_equals_one_device_on_the_accumulated_batch(distribute):
    x, y = _data(64)

    def train(distribute, steps, batch):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=steps)
        model.compile(loss="mse", optimizer=optimizer, distribute=distribute)
        model.fit(x, y, batch_size=batch, epochs=2, verbose=0, shuffle=False)
        return [w.numpy() for w in model.weights], int(model.optimizer.iterations.numpy())

    reference, reference_steps = train(None, None, 16)  # one device, batch 16
    weights, steps = train(distribute, 2, 8)  # 2 replicas, global batch 8, accumulated twice
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))
    print(f"{distribute}, gradient_accumulation_steps=2 x batch 8 vs one device x batch 16: max |dw| = {diff:.3g}")
    assert diff <= 1e-5 and steps == reference_steps == 8


def test_accumulation_with_clipping_is_refused_at_compile():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1, clipnorm=1.0, gradient_accumulation_steps=2)
    with pytest.raises(kerasdist.KerasdistError, match="gradient_accumulation_steps=2 with clipnorm"):
        model.compile(loss="mse", optimizer=optimizer, distribute="mirrored")


def test_accumulation_steps_below_2_are_refused_by_keras_with_its_message():
    with pytest.raises(ValueError, match="gradient_accumulation_steps` must be an integer >= 2"):
        keras.optimizers.SGD(gradient_accumulation_steps=1)


def _bn_train(distribute):
    x, y = _data(64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), distribute=distribute)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize("distribute", [lambda: kerasdist.mirrored(sync_batch_norm=True),
                                        lambda: kerasdist.data_parallel(sync_batch_norm=True),
                                        lambda: kerasdist.central_storage(sync_batch_norm=True)],
                         ids=["mirrored", "data_parallel", "central_storage"])
def test_synchronized_batch_norm_equals_one_device_and_the_default_does_not(distribute):
    reference = _bn_train(None)
    synced = max(float(np.max(np.abs(a - b))) for a, b in zip(_bn_train(distribute()), reference))
    local = max(float(np.max(np.abs(a - b))) for a, b in zip(_bn_train("mirrored"), reference))
    print(f"BatchNormalization, 2 replicas: sync_batch_norm=True max |dw| = {synced:.3g}; default {local:.3g}")
    assert synced <= 1e-5 and local > 1e-3


@pytest.mark.parametrize("strategy", ["ps"])
def test_sync_batch_norm_where_it_cannot_work_is_named(strategy):
    with pytest.raises(kerasdist.KerasdistError, match=f"'{strategy}' has no option 'sync_batch_norm'"):
        kerasdist.spec(strategy, sync_batch_norm=True)


class _AddedLoss(keras.layers.Layer):
    """add_loss of each kind: a mean over the batch's rows, a keras.losses.Loss called in the layer, or a sum
    over the rows scaled by ``factor``."""

    def __init__(self, kind, factor=0.1, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.factor, self.mse = kind, factor, keras.losses.MeanSquaredError()

    def call(self, x):
        if self.kind == "mean":
            self.add_loss(keras.ops.mean(keras.ops.square(x)) * self.factor)
        elif self.kind == "loss_object":
            self.add_loss(self.mse(keras.ops.zeros_like(x), x))
        elif self.kind == "sum":
            self.add_loss(keras.ops.sum(x) * self.factor)
        return x


def _train_with_added_loss(distribute, kind, factor=0.1):
    x, y = _data(16)
    keras.utils.set_random_seed(0)
    regularizer = keras.regularizers.L2(0.1) if kind == "regularizer" else None
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_regularizer=regularizer),
                              _AddedLoss(kind, factor), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1), distribute=distribute)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights], history.history["loss"]


@pytest.mark.parametrize("kind", ["mean", "regularizer", "loss_object", "sum"])
def test_added_losses_train_as_documented_under_mirrored(kind):
    """docs/equivalence.md, "add_loss": a mean over rows, a weight regularizer and a Loss called in a layer
    (scaled by 1/replicas twice in stock Keras) train and log as one process; a sum over rows is averaged over
    the replicas (2 here), as one process with half the factor."""
    reference = _train_with_added_loss(None, kind, 0.05 if kind == "sum" else 0.1)
    weights, losses = _train_with_added_loss("mirrored", kind)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference[0]))
    print(f"add_loss {kind}, mirrored: max |w - one process| = {diff:.3g}, loss {losses} vs {reference[1]}")
    assert diff <= 1e-5
    np.testing.assert_allclose(losses, reference[1], atol=1e-5)
