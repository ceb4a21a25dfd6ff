"""Custom ``train_step`` models from keras.io "Customizing what happens in fit() with TensorFlow", compiled with
one word: ``first`` (its first CustomModel: compute_loss, optimizer.apply, every metric updated by hand), ``lower``
(its lower-level one: own loss function and trackers, compile with an optimizer only), ``two`` (a second optimizer
held by the model updates the last layer, as a GAN's; its log is not a metric), ``in_dict`` (``two`` with that optimizer
kept in a dict) and ``per_row`` (``first`` logging its per-row predictions): refused under multiworker, printed as
RESULT <variant> {"error": ...}; each variant named trained in turn
in this process. Prints RESULT <variant> {"w": all weights, and the history}. From keras.io "Training & evaluation
with the built-in methods" (a stock Keras model; issue 29 item 4, run with KERASDIST_STRATEGY_FREE=off too):
``true_positives`` (its CategoricalTruePositives metric, an uneven global batch, validation_data, evaluate's logs),
``loaded`` (saved after fit, keras.models.load_model, fit again), ``shuffled_arrays`` (fit(shuffle=True) after
keras.utils.set_random_seed), ``threaded`` (a PyDataset(workers=4)). Embeddings under adaptive optimizers:
mw_sparse.VARIANTS (issue 35 item 1); ``vae``: keras.io's VAE (issue 35 item 7).

    python mw_custom_step.py first,lower,two multiworker|none
"""
import kerasdist  # noqa: F401, I001  first: joins a multi-worker cluster before any TensorFlow op

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(__file__), "..", "..")]
import mw_sparse  # noqa: E402

variants = sys.argv[1].split(",")
distribute = sys.argv[2] if sys.argv[2] != "none" else None


class CustomModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class LowerLevel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class TwoOptimizers(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_optimizer = keras.optimizers.SGD(0.05)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        first, last = self.layers[1].trainable_weights, self.layers[2].trainable_weights
        gradients = tape.gradient(loss, first + last)
        self.optimizer.apply(gradients[:len(first)], first)
        self.last_optimizer.apply(gradients[len(first):], last)
        return {"step_loss": loss}  # no metric backs it: the workers' values are averaged


class OptimizerInDict(keras.Model):
    """``two`` with its second optimizer kept in a dict, where kerasdist cannot see it: refused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_name = {"last": keras.optimizers.SGD(0.05)}

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        first, last = self.layers[1].trainable_weights, self.layers[2].trainable_weights
        gradients = tape.gradient(loss, first + last)
        self.optimizer.apply(gradients[:len(first)], first)
        self.by_name["last"].apply(gradients[len(first):], last)
        return {"step_loss": loss}


class PerRowLog(CustomModel):
    """Returns its predictions (one per row of this worker's share) as a log: refused under multiworker."""

    def train_step(self, data):
        return dict(super().train_step(data), y_pred=self(data[0], training=False))


def vae():
    """keras.io's VAE (tests/test_tf_custom_steps.py: its trackers total_loss, reconstruction_loss and kl_loss, each
    fed one scalar per step; its log ``loss`` is total_loss's result), Adam: 53 images in batches of 12, the last
    batch's 5 rows give the workers 2 and 3 (issue 35 item 7)."""
    from tests.test_tf_custom_steps import _vae

    keras.utils.set_random_seed(0)
    model = _vae()
    model.compile(optimizer=keras.optimizers.Adam(0.01), distribute=distribute)
    data = np.random.default_rng(2).random((53, 4, 4, 1)).astype("float32")
    batches = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: [
        history.setdefault(f"batch_{k}", []).append(float(v)) for k, v in logs.items()])
    history = {}
    history.update(model.fit(data, epochs=2, batch_size=12, shuffle=False, verbose=0, callbacks=[batches]).history)
    w = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    print("RESULT vae " + json.dumps({"w": w.tolist(), **history}), flush=True)


class CategoricalTruePositives(keras.metrics.Metric):
    """keras.io's custom metric: add_weight in __init__, its variable as its result."""

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_weight(name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = keras.ops.reshape(keras.ops.argmax(y_pred, axis=1), (-1, 1))
        values = keras.ops.cast(keras.ops.cast(y_true, "int32") == keras.ops.cast(y_pred, "int32"), "float32")
        if sample_weight is not None:
            values = keras.ops.multiply(values, keras.ops.cast(sample_weight, "float32"))
        self.true_positives.assign_add(keras.ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


GUIDE = ("true_positives", "loaded", "shuffled_arrays", "threaded")


def guide(variant):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(3)
    x, y = rng.random((64, 5)).astype("float32"), rng.integers(0, 3, (64, 1))
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy", CategoricalTruePositives()], distribute=distribute)
    history = {}
    if variant == "threaded":
        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return 4

            def __getitem__(self, index):
                return x[index * 16:(index + 1) * 16], y[index * 16:(index + 1) * 16]

        history = model.fit(Batches(workers=4, use_multiprocessing=False), epochs=3, shuffle=False, verbose=0).history
    else:  # 15 rows a batch: 8 and 7 per worker
        history = model.fit(x, y, batch_size=15, epochs=2, shuffle=variant == "shuffled_arrays", verbose=0,
                            validation_data=(x[:21], y[:21])).history
    if variant == "loaded":  # the same file name in every process: each reads what it wrote before every reads
        path = f"{os.environ.get('TEST_SAVE_DIR', '/tmp')}/{variant}-{os.getpid()}.keras"
        model.save(path)
        model = keras.models.load_model(path, custom_objects={"CategoricalTruePositives": CategoricalTruePositives})
        history.update({f"loaded_{k}": v for k, v in model.fit(x, y, batch_size=15, epochs=1, shuffle=False,
                                                               verbose=0).history.items()})
    history.update({f"evaluate_{k}": [v] for k, v in model.evaluate(x[:37], y[:37], batch_size=10, verbose=0,
                                                                    return_dict=True).items()})
    w = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    print(f"RESULT {variant} " + json.dumps({"w": w.tolist(), **history}), flush=True)


def train(variant):
    if variant == "vae":
        return vae()
    if variant in mw_sparse.VARIANTS:
        return mw_sparse.train(variant, distribute)
    if variant in GUIDE:
        return guide(variant)
    if variant == "per_row" and distribute is None:  # only its refusal is checked
        return
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(32,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs) if variant in ("two", "in_dict") else inputs
    outputs = keras.layers.Dense(1)(hidden)
    if variant in ("first", "per_row"):
        model = (CustomModel if variant == "first" else PerRowLog)(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"], distribute=distribute)
    elif variant in ("two", "in_dict"):
        model = (TwoOptimizers if variant == "two" else OptimizerInDict)(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse", distribute=distribute)
    else:
        model = LowerLevel(inputs, outputs)
        model.compile(optimizer="sgd", distribute=distribute)
    rng = np.random.default_rng(1)
    x = rng.random((1000, 32)).astype("float32")
    y = rng.random((1000, 1)).astype("float32")
    try:
        h = model.fit(x, y, epochs=3, batch_size=64, shuffle=False, verbose=0)
    except kerasdist.KerasdistError as error:  # in_dict, per_row under multiworker: the variants after still run
        print(f"RESULT {variant} " + json.dumps({"error": str(error)}), flush=True)
        return
    w = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    print(f"RESULT {variant} " + json.dumps({"w": w.tolist(), **h.history}), flush=True)


for variant in variants:  # several models in one process, one after the other
    train(variant)
