"""The coordinator side of tests/test_ps.py: ``ps_train.py MODE OUT_JSON [WORKERS_JSON PS_JSON]``.

exact: 1 worker + 1 ps given as kerasdist.ps(workers=, ps=): errors that must come before any step,
       then SGD training from a Dataset, a dataset function and NumPy arrays, each compared with the
       same training on one device; evaluate/predict compared too.
async: the cluster from TF_CONFIG (this process is the chief), 2 workers: convergence figures. Every
       step prints "kerasdist-test-step" on the worker that runs it (tf.print runs where the op runs).
hold:  the cluster from TF_CONFIG; compile, print a ready line, then sleep until killed.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kerasdist  # noqa: E402  (first: it may set up the process)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FEATURES, BATCH, SAMPLES = 4, 16, 96
STEPS = SAMPLES // BATCH


def data(seed=0, samples=SAMPLES):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = (np.tanh(x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")) + 0.5).astype("float32")
    return x, y


def build(seed=1):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0.0, 0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    return model


def compile_kwargs():
    return {"optimizer": keras.optimizers.SGD(0.05), "loss": "mse", "metrics": ["mae"]}


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append(["train_begin"])

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(["epoch_end", epoch, {k: float(v) for k, v in (logs or {}).items()}])

    def on_train_end(self, logs=None):
        self.events.append(["train_end"])


def error_of(fn):
    start = time.monotonic()
    try:
        fn()
    except kerasdist.KerasdistError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return None


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def exact(out, out_path, workers, ps):
    x, y = data()
    spec = kerasdist.ps(workers=workers, ps=ps, connect_timeout=120)
    reference = build()
    reference.compile(**compile_kwargs())
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    ref_weights = reference.get_weights()
    ref_eval = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    ref_pred = reference.predict(x, batch_size=BATCH, verbose=0)

    model = build()
    model.compile(**compile_kwargs(), distribute=spec)
    out["strategy"] = type(kerasdist.strategy_of(model)).__mro__[1].__name__
    out["variable_devices"] = sorted({v.value.device for v in model.weights})
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    out["errors"] = {
        "no_steps": error_of(lambda: model.fit(finite.repeat(), epochs=1, verbose=0)),
        "generator": error_of(lambda: model.fit((b for b in [(x, y)]), steps_per_epoch=2, verbose=0)),
        "class_weight": error_of(lambda: model.fit(x, y, class_weight={0: 1.0}, verbose=0)),
        "other_cluster": error_of(lambda: build().compile(
            loss="mse", distribute=kerasdist.ps(workers=workers, ps=[workers[0]]))),
    }
    recorder = Recorder()
    start = time.monotonic()
    history = model.fit(finite, epochs=2, steps_per_epoch=STEPS, callbacks=[recorder], verbose=0)
    out["fit_seconds"] = time.monotonic() - start
    out["history_type"] = type(history).__name__
    out["history"] = history.history
    out["ref_history"] = ref_history
    out["events"] = recorder.events
    out["iterations"] = int(model.optimizer.iterations.numpy())
    out["diff_dataset"] = max_diff(model.get_weights(), ref_weights)
    ps_eval = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    out["eval"], out["ref_eval"] = ps_eval, ref_eval
    out["diff_predict"] = float(np.max(np.abs(model.predict(x, batch_size=BATCH, verbose=0) - ref_pred)))
    out["evaluate_list"] = model.evaluate(x, y, batch_size=BATCH, verbose=0)

    numpy_model = build()
    numpy_model.compile(**compile_kwargs(), distribute=spec)
    checkpoint = os.path.join(os.path.dirname(out_path), "ps.weights.h5")
    print("fit with the default verbose:", flush=True)
    numpy_model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                    callbacks=[keras.callbacks.ModelCheckpoint(checkpoint, save_weights_only=True)])
    out["diff_numpy"] = max_diff(numpy_model.get_weights(), ref_weights)
    restored = build(seed=7)
    restored.load_weights(checkpoint)
    out["diff_checkpoint"] = max_diff(restored.get_weights(), numpy_model.get_weights())

    fn_model = build()
    fn_model.compile(**compile_kwargs(), distribute=spec)
    seen_contexts = []

    def dataset_fn(input_context):
        seen_contexts.append(type(input_context).__name__)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()

    val = fn_model.fit(dataset_fn, epochs=2, steps_per_epoch=STEPS, validation_data=(x, y), verbose=0)
    out["diff_dataset_fn"] = max_diff(fn_model.get_weights(), ref_weights)
    out["dataset_fn_contexts"] = sorted(set(seen_contexts))
    out["val_history"] = val.history
    out["errors"]["exhausted"] = error_of(lambda: fn_model.fit(
        lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).take(2), steps_per_epoch=4, verbose=0))


class CountingModel(keras.Sequential):
    def train_step(self, data):
        tf.print("kerasdist-test-step", output_stream=sys.stderr)
        return super().train_step(data)


def asynchronous(out):
    x, y = data(seed=3, samples=512)
    model = CountingModel([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute="auto")
    out["strategy"] = type(kerasdist.strategy_of(model)).__mro__[1].__name__
    out["cluster"] = kerasdist.detect_cluster().as_dict()
    out["initial_loss"] = float(model.evaluate(x, y, batch_size=128, verbose=0))

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512).batch(32).repeat()

    start = time.monotonic()
    history = model.fit(dataset_fn, epochs=6, steps_per_epoch=25, verbose=0)
    out["fit_seconds"] = time.monotonic() - start
    out["history"] = history.history
    out["iterations"] = int(model.optimizer.iterations.numpy())
    out["final_loss"] = float(model.evaluate(x, y, batch_size=128, verbose=0))


def main():
    mode, path = sys.argv[1], sys.argv[2]
    out = {}
    if mode == "hold":  # join the cluster (TF_CONFIG), then wait to be killed
        build().compile(distribute="auto", **compile_kwargs())
        print("kerasdist-test-coordinator-ready", flush=True)
        time.sleep(600)
    if mode == "exact":
        exact(out, path, json.loads(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        asynchronous(out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print("done", flush=True)


if __name__ == "__main__":
    main()
