"""The training function tests/test_ray.py hands to Ray Train (shipped to the workers by value).

A linear model on fixed data, SGD on the global batch; every rank appends "start" and each epoch it begins to
``<out>/epochs-<rank>.log``. With ``crash_epoch``, rank 1 SIGKILLs itself as that epoch begins, once (the marker
file says it happened). Nothing is reported to Ray here: kerasdist does it.
"""

import os

FEATURES, EXAMPLES, GLOBAL_BATCH, LEARNING_RATE = 4, 64, 16, 0.05


def data():
    import numpy as np

    rng = np.random.default_rng(7)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = (x @ np.array([[1.5], [-2.0], [0.5], [3.0]], "float32") + 0.25).astype("float32")
    kernel = rng.normal(scale=0.1, size=(FEATURES, 1)).astype("float32")
    return x, y, kernel


def one_process_weights(epochs):
    """Plain SGD on the mean squared error, global batches in order (float64): what ``fit`` must give."""
    import numpy as np

    x, y, kernel = data()
    w, b = kernel.astype("float64"), np.zeros(1)
    for _ in range(epochs):
        for start in range(0, EXAMPLES, GLOBAL_BATCH):
            xb, yb = x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]
            error = xb @ w + b - yb
            w, b = w - LEARNING_RATE * 2 * xb.T @ error / len(xb), b - LEARNING_RATE * 2 * error.mean(0)
    return [w, b]


def train(config):
    os.environ["KERAS_BACKEND"] = config["backend"]
    import kerasdist  # noqa: F401  first: joins the cluster Ray described (TF_CONFIG) before any TensorFlow op

    import keras
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    log = os.path.join(config["out"], f"epochs-{rank}.log")
    with open(log, "a") as f:
        f.write("start\n")
    with open(os.path.join(config["out"], f"tf_config-{rank}.json"), "w") as f:
        f.write(os.environ.get("TF_CONFIG", "{}"))  # the addresses Ray gave the workers

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            with open(log, "a") as f:
                f.write(f"{epoch}\n")
            marker = config.get("crash_marker")
            if epoch == config.get("crash_epoch") and rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), 9)

    x, y, kernel = data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.set_weights([kernel, model.get_weights()[1] * 0])
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse", distribute=config["distribute"])
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=config["epochs"], shuffle=False, verbose=0,
              callbacks=[Record()])
