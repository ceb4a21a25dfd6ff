"""Model, data and reference maths shared by the horovod workers and tests/test_horovod.py."""

import numpy as np

FEATURES, HIDDEN, CLASSES = 8, 16, 3
BATCH = 16  # per rank


def build_model(hidden=HIDDEN, name=None):
    import keras

    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(CLASSES)], name=name)


def build_added_losses_model():
    """build_model's, with a kernel regularizer and add_loss of a mean over rows and of a keras.losses.Loss
    (docs/equivalence.md, "add_loss": exact on every word)."""
    import keras

    class AddedLosses(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.mean(keras.ops.square(x)) * 0.1)
            self.add_loss(keras.losses.MeanSquaredError()(keras.ops.zeros_like(x), x))
            return x

    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(
        HIDDEN, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)), AddedLosses(),
        keras.layers.Dense(CLASSES)])


def initial_weights(seed, hidden=HIDDEN):
    """Fixed initial weights (numpy, independent of Keras's seeding)."""
    rng = np.random.default_rng(seed)
    shapes = [(FEATURES, hidden), (hidden,), (hidden, CLASSES), (CLASSES,)]
    return [rng.normal(0.0, 0.5, size=s).astype("float32") for s in shapes]


def data(batches, seed=0):
    """``batches`` global batches of BATCH samples each (regression targets)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * BATCH, FEATURES)).astype("float32")
    y = np.tanh(x[:, :CLASSES] * 2.0 + rng.normal(0.0, 0.1, size=(batches * BATCH, CLASSES))).astype("float32")
    return x, y


def gradients(weights, x, y):
    """d(mean squared error)/d(weights) of the model at ``weights`` on one batch (float32)."""
    import tensorflow as tf

    w = [tf.constant(v) for v in weights]
    with tf.GradientTape() as tape:
        tape.watch(w)
        hidden = tf.tanh(tf.matmul(x, w[0]) + w[1])
        loss = tf.reduce_mean(tf.square(tf.matmul(hidden, w[2]) + w[3] - y))
    return [g.numpy() for g in tape.gradient(loss, w)]


def batch(x, y, index):
    return x[index * BATCH:(index + 1) * BATCH], y[index * BATCH:(index + 1) * BATCH]



def uneven_rows(x, y, rows=7, batch=4):
    """The first ``rows`` examples in global batches of ``batch`` as each input kind but arrays."""
    import keras
    import tensorflow as tf

    x, y = x[:rows], y[:rows]
    count = -(-rows // batch)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return count

        def __getitem__(self, index):
            return x[index * batch:(index + 1) * batch], y[index * batch:(index + 1) * batch]

    return {"py_dataset": Batches(), "generator": (Batches()[i] for i in range(count)),
            "tf_data": tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)}


def uneven_logs(compile_model):
    """Logs of evaluate and fit where a global batch splits unevenly between 2 ranks (hvd_train.py's suite case
    11; the test runs it on one process): ``compile_model(weights, optimizer)`` gives the compiled model."""
    import keras

    x, y = data(batches=1)
    rows = uneven_rows(x, y)
    model = compile_model(initial_weights(8), keras.optimizers.SGD(0.1))
    out = {kind: np.array(model.evaluate(value, verbose=0, **({"steps": 2} if kind == "generator" else {})))
           for kind, value in rows.items()}
    out["arrays"] = np.array(model.evaluate(x[:7], y[:7], batch_size=4, verbose=0))
    history = model.fit(x[:9], y[:9], batch_size=4, epochs=2, shuffle=False, verbose=0,
                        validation_data=rows["py_dataset"], validation_freq=2)
    out.update({f"fit_{k}": np.array(v) for k, v in history.history.items()})
    out["fit_weights"] = np.concatenate([np.ravel(w) for w in model.get_weights()])
    return out


def batch_logs():
    """A callback recording every train and test batch's logs as it sees them (issue 35 item 9: horovod gave each
    rank its own)."""
    import keras

    class BatchLogs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rows = []

        def on_train_batch_end(self, batch, logs=None):
            self.rows.append([float(logs[k]) for k in sorted(logs)])

        def on_test_batch_end(self, batch, logs=None):
            self.rows.append([float(logs[k]) for k in sorted(logs)])

    return BatchLogs()


def mean_loss_step_model():
    """A custom train_step whose loss is an ``ops.mean`` (no keras Loss, no compute_loss; keras.io's VAE), its
    tracker named ``total_loss`` and logged as ``loss``; its own test_step updates the tracker alike."""
    import keras
    import tensorflow as tf

    class MeanLoss(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden, self.out = keras.layers.Dense(HIDDEN, activation="tanh"), keras.layers.Dense(CLASSES)
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

        def call(self, x):
            return self.out(self.hidden(x))

        @property
        def metrics(self):
            return [self.total_loss_tracker]

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.sum(keras.ops.square(self(x) - y), axis=1))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(loss)
            return {"loss": self.total_loss_tracker.result()}

        def test_step(self, data):
            x, y = data
            self.total_loss_tracker.update_state(keras.ops.mean(keras.ops.sum(keras.ops.square(self(x) - y), axis=1)))
            return {"loss": self.total_loss_tracker.result()}

    return MeanLoss()


def embedding_model():
    import keras

    return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(10, 4),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(CLASSES)])


def issue35_cases(distribute):
    """hvd_train.py's suite case 12 (the test runs it on one process, ``distribute=None``): per-batch logs of fit
    (validation batches included) and evaluate with uneven shares; an Embedding's sparse gradients (repeated ids)
    under Adam and Adagrad; a custom step whose loss is an ``ops.mean``. 21 rows in global batches of 8: the last
    splits 3 + 2."""
    import keras

    x, y = data(batches=2)
    x, y, x_val, y_val = x[:21], y[:21], x[21:28], y[21:28]
    out = {}
    model = build_model()
    model.set_weights(initial_weights(9))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], distribute=distribute)
    logs = batch_logs()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(x_val, y_val),
              validation_batch_size=4, callbacks=[logs])
    model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[logs])
    out["batch_logs"] = np.array(logs.rows)
    ids = np.random.default_rng(3).integers(0, 5, size=(21, 6)).astype("int32")  # ids repeat within each batch
    for name, optimizer in (("adam", keras.optimizers.Adam(0.05)), ("adagrad", keras.optimizers.Adagrad(0.5))):
        keras.utils.set_random_seed(0)
        model = embedding_model()
        model.compile(optimizer=optimizer, loss="mse", distribute=distribute)
        history = model.fit(ids, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        out[f"sparse_{name}_weights"] = np.concatenate([np.ravel(w) for w in model.get_weights()])
        out[f"sparse_{name}_loss"] = np.array(history.history["loss"])
    keras.utils.set_random_seed(0)
    model = mean_loss_step_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), distribute=distribute)
    logs = batch_logs()
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[logs],
                        validation_data=(x_val, y_val), validation_batch_size=4)
    out["mean_loss_step_evaluate"] = np.array(model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[logs]))
    out["mean_loss_step_weights"] = np.concatenate([np.ravel(w) for w in model.get_weights()])
    out["mean_loss_step_loss"] = np.array(history.history["loss"] + history.history["val_loss"])
    out["mean_loss_step_batch_logs"] = np.array(logs.rows)
    return out


def data_loader_case(distribute):
    """hvd_train.py's suite case 13 (issue 35 item 10; the test runs it on one process): a shuffling torch DataLoader
    of global batches after ``torch.manual_seed(0)`` on every rank: each rank draws one process's order and takes its
    part of every batch (before: horovod always seeded the sampler with a shared seed of its own, another order).
    Returns the weights and the loss per epoch."""
    import keras
    import torch

    x, y = data(batches=8)
    model = build_model()
    model.set_weights(initial_weights(12))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], distribute=distribute)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)),
                                         batch_size=2 * BATCH, shuffle=True)
    history = model.fit(loader, epochs=2, verbose=0)
    return {"weights": np.concatenate([np.ravel(w) for w in model.get_weights()]),
            "loss": np.array(history.history["loss"])}
