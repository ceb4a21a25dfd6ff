"""Runs a guide as its user would, and records what its ``fit`` calls did.

The guide's text is not touched: ``keras.datasets.mnist.load_data`` (also reached as
``tf.keras.datasets.mnist.load_data``) returns tests/guides/_data.py's arrays, and every
``fit`` is observed (its History, at the end of training, and how the model was distributed). In a test process
both are installed on the Keras already imported (``observe``); in a child process
(``python tests/guides/_harness.py OUTDIR GUIDE [ARGS]``) they are installed when the guide itself
imports Keras (an import hook), so the guide's import order (``import kerasdist`` first, ``KERAS_BACKEND``) is kept.
"""

import builtins
import contextlib
import json
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _data  # noqa: E402


def _floats(history):
    return {k: [float(v) for v in values] for k, values in history.items()}


def describe(model):
    """How ``model`` is distributed: TensorFlow strategy and replicas, or JAX devices and layouts."""
    import keras

    info = {"backend": keras.backend.backend()}
    if info["backend"] == "tensorflow":
        strategy = model.distribute_strategy
        info.update(strategy=type(strategy).__name__, replicas=int(strategy.num_replicas_in_sync),
                    variable_devices=sorted({str(getattr(v.value, "device", "")) for v in model.weights}))
    elif info["backend"] == "jax":
        shardings = {v.path: v.value.sharding for v in model.weights}
        info["devices"] = max(len(s.device_set) for s in shardings.values())
        info["specs"] = {path: str(getattr(s, "spec", None)) for path, s in shardings.items()}
        distribution = keras.distribution.distribution()
        info["distribution"] = type(distribution).__name__ if distribution else None
    return info


def _record_history(history_class, records, keep_weights=False):
    """Make every ``History`` (each ``fit`` has one, also kerasdist's own ps loop) record itself at the
    end of training (with ``keep_weights``, also the model's weights as numpy arrays and their paths);
    returns a function that undoes it."""

    def on_train_end(self, logs=None):
        records.append({"history": _floats(self.history), "epochs": list(self.epoch), **describe(self.model)})
        if keep_weights:
            records[-1].update(weights=self.model.get_weights(), paths=[v.path for v in self.model.weights])

    history_class.on_train_end = on_train_end
    return lambda: delattr(history_class, "on_train_end")


@contextlib.contextmanager
def observe(records, keep_weights=False):
    """In this process: generated MNIST and recorded fits until the block ends."""
    import keras

    saved = keras.datasets.mnist.load_data
    keras.datasets.mnist.load_data = _data.load_data
    undo = _record_history(keras.callbacks.History, records, keep_weights)
    try:
        yield records
    finally:
        keras.datasets.mnist.load_data = saved
        undo()


def run_in_this_process(guide, records, environ=None, keep_weights=False):
    """Run ``guide`` as ``__main__`` here (under ``observe``, with ``environ`` set for the run only);
    returns its globals and the exception it raised, or None, so that what ran before a failure can
    still be checked."""
    namespace = {"__name__": "__main__", "__file__": guide}
    with open(guide) as f:
        code = compile(f.read(), guide, "exec")
    saved = {name: os.environ.get(name) for name in environ or {}}
    os.environ.update(environ or {})
    try:
        with observe(records, keep_weights):
            exec(code, namespace)
    except Exception as error:  # noqa: BLE001 (handed to the test that checks that part)
        return namespace, error
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    return namespace, None


def _patch_keras_once_imported(patch):
    """Call ``patch(keras)`` as soon as an import leaves Keras usable enough (its History callback and
    its MNIST loader exist), whoever imports it: the guide, kerasdist or TensorFlow's ``tf.keras``."""
    real_import = builtins.__import__

    def watching_import(*args, **kwargs):
        module = real_import(*args, **kwargs)
        keras = sys.modules.get("keras")
        mnist = sys.modules.get("keras.datasets.mnist")
        if builtins.__import__ is watching_import and hasattr(getattr(keras, "callbacks", None), "History") and hasattr(mnist, "load_data"):
            builtins.__import__ = real_import
            patch(keras)
        return module

    builtins.__import__ = watching_import


def run_guide(outdir, guide, args):
    """Run ``guide`` as ``__main__`` and write this process's fits to OUTDIR/fits-<pid>.json."""
    records = []

    def patch(keras):
        _record_history(keras.callbacks.History, records)
        sys.modules["keras.datasets.mnist"].load_data = _data.load_data

    _patch_keras_once_imported(patch)
    sys.argv = [guide, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(guide))
    status = 0
    try:
        runpy.run_path(guide, run_name="__main__")
    except SystemExit as exit:  # noqa: A001
        status = exit.code or 0
    finally:
        rank = {k: os.environ[k] for k in ("TF_CONFIG", "HOROVOD_RANK", "HOROVOD_SIZE") if k in os.environ}
        with open(os.path.join(outdir, f"fits-{os.getpid()}.json"), "w") as f:
            json.dump({"fits": records, "env": rank}, f)
    return status


def read_fits(outdir):
    """Every process's record, in no particular order."""
    results = []
    for name in sorted(os.listdir(outdir)):
        if name.startswith("fits-") and name.endswith(".json"):
            with open(os.path.join(outdir, name)) as f:
                results.append(json.load(f))
    return results


if __name__ == "__main__":
    sys.exit(run_guide(sys.argv[1], sys.argv[2], sys.argv[3:]))


def assert_trained_on_replicas(fit, accuracy_key, replicas=2):
    """One recorded ``fit`` ran under MirroredStrategy on ``replicas``, its loss fell and it learned (chance: 0.1)."""
    print("fit:", fit["history"])
    assert fit["strategy"] == "MirroredStrategy" and fit["replicas"] == replicas
    assert fit["history"]["loss"][1] < fit["history"]["loss"][0]
    assert fit["history"][accuracy_key][-1] > 0.5
