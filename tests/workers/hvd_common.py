"""Model, data and reference maths shared by the horovod workers and tests/test_horovod.py."""

import numpy as np

FEATURES, HIDDEN, CLASSES = 8, 16, 3
BATCH = 16  # per rank


def build_model(hidden=HIDDEN):
    import keras

    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


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
