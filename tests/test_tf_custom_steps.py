"""A model's own ``train_step`` under TensorFlow's in-process words (mirrored, central_storage) against the same
step in one plain process: keras.io's VAE (its loss an ``ops.mean``, not a ``keras.losses.Loss``), a GAN-like step
with two optimizers, the "Customizing fit()" guide's step (``compute_loss``), a loss with reduction "sum" and an
``add_loss`` model. Each fits 37 rows in batches of 8 (the last, 5 rows, splits 3 + 2), SGD, 2 epochs; weights,
every per-batch log (a callback's view), each epoch's logs and ``history`` are compared. In-process, 2 logical CPU
replicas (tests/conftest.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kerasdist

ROWS, BATCH, EPOCHS = 37, 8, 2


class Sampling(keras.layers.Layer):
    """keras.io's VAE sampling layer, its noise off (the exact variant: the replicas draw other numbers)."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        return z_mean + ops.exp(0.5 * z_log_var) * 0.0


class VAE(keras.Model):
    """keras.io "Variational AutoEncoder" (Keras 3, TensorFlow's GradientTape), on 4x4 images."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(keras.losses.binary_crossentropy(data, reconstruction),
                                                   axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def _vae():
    inputs = keras.Input((4, 4, 1))
    h = keras.layers.Dense(6, activation="relu")(keras.layers.Flatten()(inputs))
    z_mean, z_log_var = keras.layers.Dense(2)(h), keras.layers.Dense(2)(h)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
    latent = keras.Input((2,))
    decoded = keras.layers.Reshape((4, 4, 1))(keras.layers.Dense(16, activation="sigmoid")(
        keras.layers.Dense(6, activation="relu")(latent)))
    return VAE(encoder, keras.Model(latent, decoded))


class TwoOptimizers(keras.Model):
    """A GAN-like step: two optimizers (set in its own ``compile``), each training half the model on its own
    ``ops.mean`` loss."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first, self.second = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)
        self.first_tracker, self.second_tracker = keras.metrics.Mean(name="first"), keras.metrics.Mean(name="second")

    def call(self, x):
        return self.second(self.first(x))

    def compile(self, first_optimizer, second_optimizer, **kwargs):
        super().compile(**kwargs)
        self.first_optimizer, self.second_optimizer = first_optimizer, second_optimizer

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            first_loss = ops.mean(ops.square(self(x) - y))
        grads = tape.gradient(first_loss, self.first.trainable_weights)
        self.first_optimizer.apply_gradients(zip(grads, self.first.trainable_weights))
        with tf.GradientTape() as tape:
            second_loss = ops.mean(ops.abs(self(x) - y))
        grads = tape.gradient(second_loss, self.second.trainable_weights)
        self.second_optimizer.apply_gradients(zip(grads, self.second.trainable_weights))
        self.first_tracker.update_state(first_loss)
        self.second_tracker.update_state(second_loss)
        return {"first": self.first_tracker.result(), "second": self.second_tracker.result()}


class GuideModel(keras.Model):
    """keras.io "Customizing what happens in fit() with TensorFlow": compute_loss (a compiled keras Loss),
    optimizer.apply, ``{m.name: m.result()}``; its own test_step as the guide writes it."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        """The guide's "Providing your own evaluation step"."""
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _guide(activity=False):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(5, activation="tanh",
                                activity_regularizer=keras.regularizers.L2(0.1) if activity else None)(inputs)
    return GuideModel(inputs, keras.layers.Dense(1)(hidden))


def _arrays():
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(ROWS, 4, 4, 1)).astype("float32")
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    y = (x @ rng.normal(size=(3, 1))).astype("float32")
    return images, x, y


def _case(name, distribute):
    """(model, fit's x, fit's y) for the case ``name``, compiled with ``distribute``."""
    images, x, y = _arrays()
    keras.utils.set_random_seed(1)
    if name == "vae":
        model = _vae()
        model.compile(optimizer=keras.optimizers.SGD(0.05), distribute=distribute)
        return model, images, None
    if name == "two_optimizers":
        model = TwoOptimizers()
        model.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.05), distribute=distribute)
        return model, x, y
    model = _guide(activity=name == "add_loss")
    loss = keras.losses.MeanSquaredError(reduction="sum") if name == "sum_loss" else "mse"
    model.compile(optimizer=keras.optimizers.SGD(0.01 if name == "sum_loss" else 0.1), loss=loss,
                  metrics=["mae"], distribute=distribute)
    return model, x, y


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append({k: float(v) for k, v in (logs or {}).items()})

    def on_test_batch_end(self, batch, logs=None):
        self.on_train_batch_end(batch, logs)


def _fit(name, distribute):
    model, x, y = _case(name, distribute)
    batches = _BatchLogs()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[batches])
    if isinstance(model, GuideModel):  # its own test_step too
        evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[batches], return_dict=True)
        history.history.update({f"evaluate_{k}": [v] * EPOCHS for k, v in evaluated.items()})
    return model, history.history, batches.seen


def _largest_log_difference(a, b):
    assert len(a) == len(b) and all(set(x) == set(y) for x, y in zip(a, b))
    return max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in x)


CASES = ("vae", "two_optimizers", "guide", "sum_loss", "add_loss")


@pytest.fixture(scope="module")
def one_process():
    return {name: _fit(name, None) for name in CASES}


@pytest.mark.parametrize("word", ["mirrored", "central_storage", "data_parallel"])
@pytest.mark.parametrize("name", CASES)
def test_a_custom_train_step_trains_and_logs_as_one_process(one_process, name, word):
    single, single_history, single_batches = one_process[name]
    model, history, batches = _fit(name, word)
    assert model.distribute_strategy.num_replicas_in_sync == 2
    weights = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                  for a, b in zip(single.get_weights(), model.get_weights()))
    epochs = _largest_log_difference([dict(zip(single_history, v)) for v in zip(*single_history.values())],
                                     [dict(zip(history, v)) for v in zip(*history.values())])
    per_batch = _largest_log_difference(single_batches, batches)
    print(f"{name} under {word}: weights {weights:.2g}, epoch logs {epochs:.2g}, batch logs {per_batch:.2g}")
    assert weights <= 1e-6 and epochs <= 1e-5 and per_batch <= 1e-5


def test_a_custom_step_with_a_loss_of_reduction_none_is_refused_at_compile():
    """Per-row losses (reduction "none") leave the step's own reduction unknown: the replicas' gradients cannot be
    weighted as one device's. One error at compile, naming the reductions and the fix."""
    model = _guide()
    with pytest.raises(kerasdist.KerasdistError, match=r"distribute='mirrored': a custom train_step with compiled "
                                                       r"losses of reductions \['none'\].*every loss 'sum'"):
        model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="none"), distribute="mirrored")
