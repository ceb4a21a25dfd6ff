"""An optimizer's clipvalue / clipnorm / global_clipnorm under TensorFlow's in-process words (mirrored,
central_storage) against one plain process: Keras clipped each replica's gradient before summing them
(clip(g1) + clip(g2), up to 0.075 off at a kernel in the fuzzer); kerasdist clips the summed gradient once.
Keras's own train_step and a custom one; 21 rows in batches of 8 (the last, 5 rows, splits 3 + 2), SGD, 2 epochs.
In-process, 2 logical CPU replicas (tests/conftest.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

ROWS, BATCH, EPOCHS = 21, 8, 2
CLIPS = {"clipvalue": 0.05, "clipnorm": 0.1, "global_clipnorm": 0.1}


class CustomStep(keras.Model):
    """The "Customizing fit()" guide's lower-level step: its own loss, tape and apply_gradients."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(y - self(x, training=True)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _data():
    rng = np.random.default_rng(7)
    return rng.normal(size=(ROWS, 5)).astype("float32"), (3 * rng.normal(size=(ROWS, 3))).astype("float32")


def _trained(clip, custom, distribute=None):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(6, activation="tanh")(inputs))
    model = (CustomStep if custom else keras.Model)(inputs, outputs)
    rng = np.random.default_rng(11)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.2, **{clip: CLIPS[clip]}), loss="mse",
                  **({"distribute": distribute} if distribute else {}))
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="module")
def one_process():
    return {(clip, custom): _trained(clip, custom) for clip in CLIPS for custom in (False, True)}


@pytest.mark.parametrize("word", ["mirrored", "central_storage"])
@pytest.mark.parametrize("custom", [False, True], ids=["keras_step", "custom_step"])
@pytest.mark.parametrize("clip", list(CLIPS))
def test_clipping_applies_to_the_global_gradient_as_in_one_process(one_process, clip, custom, word):
    trained = _trained(clip, custom, word)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(trained, one_process[(clip, custom)]))
    assert worst < 1e-6, f"{word} {clip} custom={custom}: {worst:.3g} off one process"


def _trained_embedding(distribute=None):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,), dtype="int32")
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(keras.layers.Embedding(10, 3)(inputs)))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(11)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.2, clipnorm=0.1), loss="mse",
                  **({"distribute": distribute} if distribute else {}))
    x, y = _data()
    model.fit(np.abs(x[:, :4] * 3).astype("int32") % 10, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def test_clipnorm_of_sparse_embedding_gradients_applies_to_the_global_gradient():
    """An Embedding's gradient reaches the optimizer as tf.IndexedSlices (0.070 off one process before)."""
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(_trained_embedding("mirrored"), _trained_embedding()))
    assert worst < 1e-6, f"{worst:.3g} off one process"
