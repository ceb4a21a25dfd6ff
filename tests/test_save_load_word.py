"""A model saved after ``compile(distribute=...)`` comes back from ``keras.models.load_model`` compiled with it
(the keras.io multi-GPU guide's fault-tolerance part), ``kerasdist.load_plain`` loads it without, and stock
Keras without kerasdist still loads the file."""

import json
import logging
import os
import zipfile

import keras
import numpy as np
import tensorflow as tf

import kerasdist
from kerasdist.saving import KEY
from kerasdist.session import session_of
from tests.helpers import child_env, python, run


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _get_compiled_model(distribute="mirrored"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", distribute=distribute)
    return model


class FirstBatchLoss(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if not hasattr(self, "loss"):
            self.loss = logs["loss"]


def _saved(tmp_path, distribute="mirrored"):
    x, y = _data()
    model = _get_compiled_model(distribute)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    return model, path


def _compile_config(path):
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("config.json"))["compile_config"]


def test_the_guides_checkpoint_restore_trains_on_two_replicas_from_the_saved_state(tmp_path, caplog):
    checkpoint_dir = str(tmp_path / "ckpt")
    os.makedirs(checkpoint_dir)
    x, y = _data()

    def make_or_restore_model():  # the guide's, with distribute= in compile instead of strategy.scope()
        checkpoints = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
        if checkpoints:
            return keras.models.load_model(max(checkpoints, key=os.path.getctime))
        return _get_compiled_model()

    first_losses, models = [], []
    for _ in range(2):
        model = make_or_restore_model()
        first = FirstBatchLoss()
        callbacks = [first, keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"))]
        with caplog.at_level(logging.WARNING, logger="kerasdist"):
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
        first_losses.append(first.loss)
        models.append(model)

    restored = models[1]
    assert restored.distribute_strategy.num_replicas_in_sync == 2
    assert kerasdist.strategy_of(restored) is kerasdist.strategy_of(models[0])
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in restored.optimizer.variables + restored.weights)
    assert first_losses[1] < first_losses[0]  # it went on from the checkpoint
    restored_lines = [r.getMessage() for r in caplog.records if "as it was saved" in r.getMessage()]
    assert len(restored_lines) == 1 and "distribute='mirrored'" in restored_lines[0], restored_lines


def test_the_restored_model_equals_the_saved_one_and_load_plain_loads_it_without(tmp_path):
    model, path = _saved(tmp_path)
    x, y = _data()
    restored = keras.models.load_model(path)
    plain = kerasdist.load_plain(path)
    assert kerasdist.strategy_of(plain) is None and plain.compiled
    assert plain.distribute_strategy.num_replicas_in_sync == 1
    assert keras.ops.convert_to_numpy(restored.optimizer.iterations) == 4
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    # one step on the same batch: distributed (2 replicas) == one device
    np.testing.assert_allclose(restored.train_on_batch(x[:16], y[:16]), plain.train_on_batch(x[:16], y[:16]),
                               rtol=1e-5)
    np.testing.assert_allclose(restored.get_weights()[0], plain.get_weights()[0], atol=1e-6)


def test_stock_keras_without_kerasdist_loads_and_predicts_the_file(tmp_path):
    model, path = _saved(tmp_path)
    assert _compile_config(path)["optimizer"][KEY] == [
        {"name": "mirrored", "options": {"devices": None, "cross_device_ops": "auto", "sync_batch_norm": False}}]
    x, _ = _data()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    code = (  # a process that never imports kerasdist
        "import sys, numpy as np, keras\n"
        f"m = keras.models.load_model({path!r})\n"
        f"diff = np.abs(m.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0) - "
        f"np.load({str(tmp_path / 'expected.npy')!r})).max()\n"
        "print('LOADED', m.compiled, type(m.optimizer).__name__, int(m.optimizer.iterations), diff)\n"
        "config = m.get_compile_config()\n"
        "try:\n"
        "    m.compile_from_config({**config, 'distribute': 'mirrored'})\n"
        "except TypeError as exc:\n"
        "    print('A TOP-LEVEL KEY IS REFUSED', exc)\n"
        "print('KERASDIST_LOADED', 'kerasdist' in sys.modules)\n")
    out = run(python("-c", code), timeout=180, env=child_env()).stdout
    loaded = out.split("LOADED ", 1)[1].split()
    assert loaded[:3] == ["True", "Adam", "4"], out
    assert float(loaded[3]) < 1e-6, out
    assert "A TOP-LEVEL KEY IS REFUSED" in out  # why the plan rides in the optimizer's entry
    assert "KERASDIST_LOADED False" in out


def test_specs_with_options_travel_and_clone_model_stays_plain(tmp_path):
    spec = kerasdist.mirrored(devices=["/cpu:0", "/cpu:1"]) + kerasdist.prune(target_sparsity=0.25, frequency=1)
    _, path = _saved(tmp_path, spec)
    restored = keras.models.load_model(path)
    plan = session_of(restored).plan
    assert plan.describe() == "mirrored + prune"
    assert list(plan.strategy.devices) == ["/cpu:0", "/cpu:1"]
    assert plan.optimizations[0].target_sparsity == 0.25 and plan.optimizations[0].frequency == 1
    clone = keras.models.clone_model(restored)  # as before: compiled plain, free to take another distribute=
    assert clone.compiled and kerasdist.strategy_of(clone) is None
    assert clone.distribute_strategy.num_replicas_in_sync == 1


def test_a_strategy_object_or_a_function_option_is_not_saved_and_says_so(tmp_path, caplog):
    x, y = _data()
    cases = {"object": tf.distribute.OneDeviceStrategy("/cpu:0"),
             "function": ["mirrored", kerasdist.prune(layers=lambda layer: True, frequency=1)]}
    for name, distribute in cases.items():
        model = _get_compiled_model(distribute)
        with caplog.at_level(logging.WARNING, logger="kerasdist"):
            for epoch in range(2):
                model.save(tmp_path / f"{name}-{epoch}.keras")
        notes = [r.getMessage() for r in caplog.records if "is not saved with the model" in r.getMessage()]
        assert len(notes) == 1, notes  # once per model, not once per save
        assert "OneDeviceStrategy object cannot be saved" in notes[0] if name == "object" else "layers=" in notes[0]
        caplog.clear()
        assert KEY not in _compile_config(tmp_path / f"{name}-0.keras")["optimizer"]
        assert kerasdist.strategy_of(keras.models.load_model(tmp_path / f"{name}-0.keras")) is None


def test_a_saved_plan_that_cannot_run_here_loads_plain_with_the_reason(tmp_path, caplog):
    _, path = _saved(tmp_path)
    edited = str(tmp_path / "gpus.keras")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(edited, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "config.json":
                config = json.loads(data)
                config["compile_config"]["optimizer"][KEY][0]["options"]["devices"] = ["/gpu:0", "/gpu:1"]
                data = json.dumps(config)
            target.writestr(item, data)
    with caplog.at_level(logging.WARNING, logger="kerasdist"):
        loaded = keras.models.load_model(edited)
    assert kerasdist.strategy_of(loaded) is None and loaded.compiled
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "cannot run here" in messages and "/gpu:0" in messages, messages
