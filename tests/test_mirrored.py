"""distribute="mirrored": numerical equality with one device, and the MirroredStrategy tutorial flow."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist
from tests.helpers import child_env, python, run

STEPS, GLOBAL_BATCH = 20, 32


def _data(n=STEPS * GLOBAL_BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
    return x, y


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])


def _train(distribute, optimizer_factory, pretrain_steps=0):
    x, y = _data()
    model = _mlp()
    optimizer = optimizer_factory()
    if pretrain_steps:  # a model (and optimizer) trained before compile(distribute=...)
        model.compile(optimizer=optimizer, loss="mse")
        n = pretrain_steps * GLOBAL_BATCH
        model.fit(x[:n], y[:n], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        x, y = x[n:], y[n:]
    model.compile(optimizer=optimizer, loss="mse", distribute=distribute)
    model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, epochs=1, verbose=0)
    return model, optimizer


def _max_weight_difference(a, b):
    return max(float(np.max(np.abs(u.numpy() - v.numpy()))) for u, v in zip(a.weights, b.weights))


def test_two_replicas_equal_one_device_after_20_sgd_steps():
    sgd = lambda: keras.optimizers.SGD(learning_rate=0.05)  # noqa: E731
    single, _ = _train(None, sgd)
    mirrored, optimizer = _train("mirrored", sgd)
    assert mirrored.distribute_strategy.num_replicas_in_sync == 2
    assert int(optimizer.iterations.numpy()) == STEPS
    difference = _max_weight_difference(single, mirrored)
    print(f"max |w_mirrored - w_single| after {STEPS} SGD steps, global batch {GLOBAL_BATCH}: {difference:.3g}")
    assert difference <= 1e-5
    assert _max_weight_difference(single, _mlp()) > 1e-2  # training moved the weights: the test can fail


def test_model_and_adam_state_trained_before_compile_are_carried_over():
    adam = lambda: keras.optimizers.Adam(learning_rate=0.01)  # noqa: E731
    single, single_opt = _train(None, adam, pretrain_steps=5)
    mirrored, mirrored_opt = _train("mirrored", adam, pretrain_steps=5)
    assert int(mirrored_opt.iterations.numpy()) == STEPS
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in mirrored_opt.variables)
    assert _max_weight_difference(single, mirrored) <= 1e-5
    for a, b in zip(single_opt.variables, mirrored_opt.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


def test_batchnorm_statistics_dropout_seed_and_metrics_move_with_values():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.2), keras.layers.Dense(1)])
    x, y = _data(128)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=32, verbose=0)
    before = {v.path: v.numpy().copy() for v in model.variables}
    evaluation = model.evaluate(x, y, verbose=0)
    model.compile(optimizer=model.optimizer, loss="mse", metrics=["mae"], distribute="mirrored")
    for variable in model.variables:
        assert isinstance(variable.value, tf.distribute.DistributedValues), variable.path
        np.testing.assert_array_equal(before[variable.path], variable.numpy())
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), evaluation, rtol=1e-5)
    model.fit(x, y, batch_size=32, verbose=0)
    assert kerasdist.strategy_of(model) is model.distribute_strategy


class PrintLR(keras.callbacks.Callback):
    """The tutorial's custom callback: reads the optimizer's learning rate each epoch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def _decay(epoch):
    return 1e-2 if epoch < 1 else (1e-3 if epoch < 2 else 1e-4)


def _tutorial_data(n=256):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=n)
    images = rng.normal(0, 0.2, size=(n, 12, 12, 1)).astype("float32")
    for k in range(10):
        images[labels == k, k, :, 0] += 1.0
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(32), images, labels


@pytest.mark.timeout(300)
def test_tutorial_flow_callbacks_checkpoints_save_and_load(tmp_path):
    train, images, labels = _tutorial_data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12, 12, 1)), keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"], distribute="mirrored")
    print_lr = PrintLR()
    checkpoints = tmp_path / "ckpt_{epoch}.weights.h5"
    model.fit(train, epochs=3, verbose=0, callbacks=[
        keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs")),
        keras.callbacks.ModelCheckpoint(filepath=str(checkpoints), save_weights_only=True),
        keras.callbacks.LearningRateScheduler(_decay), print_lr])
    assert print_lr.seen == pytest.approx([1e-2, 1e-3, 1e-4])
    assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "ckpt_*"))) == [
        "ckpt_1.weights.h5", "ckpt_2.weights.h5", "ckpt_3.weights.h5"]
    assert glob.glob(str(tmp_path / "logs" / "train" / "events.out.tfevents.*"))

    reference = model.evaluate(train, verbose=0)
    model.load_weights(str(tmp_path / "ckpt_3.weights.h5"))
    np.testing.assert_allclose(model.evaluate(train, verbose=0), reference, rtol=1e-5)
    assert reference[1] > 0.5

    saved = tmp_path / "m.keras"
    model.save(saved)
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", labels)
    code = (  # a process that never imports kerasdist
        "import sys, numpy as np, keras\n"
        f"m = keras.models.load_model({str(saved)!r})\n"
        f"x, y = np.load({str(tmp_path / 'x.npy')!r}), np.load({str(tmp_path / 'y.npy')!r})\n"
        "print('EVAL', *m.evaluate(x, y, batch_size=32, verbose=0))\n"
        "print('KERASDIST_LOADED', 'kerasdist' in sys.modules)\n")
    out = run(python("-c", code), timeout=180, env=child_env()).stdout
    plain = [float(v) for v in out.split("EVAL", 1)[1].split()[:2]]
    assert "KERASDIST_LOADED False" in out
    np.testing.assert_allclose(plain, reference, rtol=1e-5)

    loaded = keras.models.load_model(saved)
    loaded.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   optimizer=loaded.optimizer, metrics=["accuracy"], distribute="mirrored")
    assert loaded.distribute_strategy.num_replicas_in_sync == 2
    np.testing.assert_allclose(loaded.evaluate(train, verbose=0), reference, rtol=1e-5)
    predictions = loaded.predict(images[:40], verbose=0)
    np.testing.assert_allclose(predictions, model.predict(images[:40], verbose=0), atol=1e-5)
    loaded.fit(train, epochs=1, verbose=0)  # and it keeps training under the strategy


def test_steps_per_execution_that_keras_cannot_run_is_refused_with_the_fix():
    with pytest.raises(kerasdist.KerasdistError, match="steps_per_execution=4.*use steps_per_execution=1"):
        _mlp().compile(loss="mse", optimizer="sgd", steps_per_execution=4, distribute="mirrored")


def test_validation_data_and_extra_keyword_arguments_reach_keras():
    x, y = _data(128)
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], distribute="mirrored")
    history = model.fit(x, y, validation_data=(x, y), batch_size=32, epochs=2, verbose=0)
    assert {"val_loss", "val_mae", "loss", "mae"} <= set(history.history)
    assert len(history.history["val_loss"]) == 2
    result = model.evaluate(x, y, verbose=0, return_dict=True)
    assert result["loss"] == pytest.approx(model.evaluate(x, y, verbose=0)[0])


def _transfer_learning(distribute, x, y):
    """keras.io "Transfer learning & fine-tuning": a frozen base, compile, fit; unfreeze, compile, fit."""
    keras.utils.set_random_seed(4)
    base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh")], name="base")
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(1)(base(inputs, training=False)))
    base.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", distribute=distribute)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    frozen = [w.numpy() for w in base.weights]
    base.trainable = True
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", distribute=distribute)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return model, max(float(np.max(np.abs(a - w.numpy()))) for a, w in zip(frozen, base.weights))


def test_a_base_unfrozen_after_a_frozen_compile_trains_as_in_one_process():
    """Issue 29: a base frozen at the compile that moved it got untrainable tf.Variables; unfrozen and
    compiled again it was updated by 0, silently."""
    x, y = _data(4 * GLOBAL_BATCH)
    single, single_moved = _transfer_learning(None, x, y)
    mirrored, mirrored_moved = _transfer_learning("mirrored", x, y)
    difference = _max_weight_difference(single, mirrored)
    print(f"base moved in phase 2: one process {single_moved:.3g}, mirrored {mirrored_moved:.3g}; max |dw| "
          f"{difference:.3g}")
    assert single_moved > 1e-3 and difference <= 1e-5


def test_an_unbuilt_model_whose_input_leaves_a_dimension_unknown_builds_from_one_batch():
    """The structure cannot build it (a Dense would keep a last dimension of None): one batch is read, as Keras
    reads it (in another order than one process when the data reshuffle: docs/equivalence.md)."""
    x, y = _data(64)
    batches = tf.data.Dataset.from_generator(lambda: ((x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)),
                                             output_signature=(tf.TensorSpec((None, None), tf.float32),
                                                               tf.TensorSpec((None, 1), tf.float32)))
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", distribute="mirrored")
    model.fit(batches, epochs=1, verbose=0)
    assert [tuple(w.shape) for w in model.weights] == [(6, 4), (4,), (4, 1), (1,)]


def test_predict_and_evaluate_on_fewer_rows_than_replicas_equal_one_device():
    """A replica given no rows (one image; a last batch of 1) used to fail in TensorFlow's conv + BatchNormalization
    graph ("Incompatible shapes", stock MirroredStrategy too): TensorFlow's oneDNN convolution on an empty batch."""
    images = np.random.default_rng(0).normal(size=(3, 8, 8, 3)).astype("float32")

    def conv_bn(distribute):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"], distribute=distribute)
        return model

    plain, mirrored = conv_bn(None), conv_bn("mirrored")
    targets = np.ones((3, 2), "float32")
    for rows, batch_size in ((1, None), (3, None), (3, 2)):
        expected = plain.predict(images[:rows], batch_size=batch_size, verbose=0)
        got = mirrored.predict(images[:rows], batch_size=batch_size, verbose=0)
        assert got.shape == expected.shape == (rows, 2)
        np.testing.assert_allclose(got, expected, atol=1e-6)
        expected = plain.evaluate(images[:rows], targets[:rows], batch_size=batch_size, verbose=0)
        got = mirrored.evaluate(images[:rows], targets[:rows], batch_size=batch_size, verbose=0)
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_models_own_predict_step_is_left_alone():
    """A model's own ``predict_step`` is not wrapped: its outputs need not be one per input row (here two), which
    the wrapper for replicas given no rows used to cut to the replica's rows."""

    class TwoRowsEach(keras.Sequential):
        def predict_step(self, data):
            outputs = self(data[0] if isinstance(data, tuple) else data, training=False)
            return tf.concat([outputs, outputs * 2], 0)

    def model(distribute):
        keras.utils.set_random_seed(0)
        model = TwoRowsEach([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", distribute=distribute)
        return model

    plain, mirrored = model(None), model("mirrored")
    assert not getattr(mirrored.predict_step, "_kerasdist_empty_replicas", False)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    expected = plain.predict(x, batch_size=4, verbose=0)
    got = mirrored.predict(x, batch_size=4, verbose=0)
    assert got.shape == expected.shape == (8, 2)
    np.testing.assert_allclose(np.sort(got, 0), np.sort(expected, 0), atol=1e-6)


@pytest.mark.parametrize("word", ["mirrored", "data_parallel"])
def test_jit_compile_on_cpu_replicas_is_refused_at_compile_and_auto_trains_without_xla(word):
    """KerasHub getting-started's custom model (an Embedding first) with jit_compile=True died at the first step
    with TensorFlow's raw "resource .../replica_1 located in device CPU:1 from device CPU:0" (stock
    MirroredStrategy too): XLA compiles every replica's step for the first CPU. central_storage trains it
    (tests/test_central_storage.py). TensorFlow's data_parallel is a MirroredStrategy too (before: the raw error)."""
    x = np.random.default_rng(0).integers(0, 20, size=(16, 5))
    y = np.zeros((16, 1), "float32")

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])

    refused = model()
    with pytest.raises(kerasdist.KerasdistError, match=rf"distribute='{word}' on CPU replicas cannot train with "
                                                       r"jit_compile=True.*jit_compile=False or 'auto'"):
        refused.compile(optimizer="sgd", loss="mse", jit_compile=True, distribute=word)
    auto = model()
    auto.compile(optimizer="sgd", loss="mse", jit_compile="auto", distribute=word)
    auto.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert auto.jit_compile is False


def test_a_users_own_mirrored_strategy_object_trains_an_uneven_last_batch_as_the_word():
    """distribute=tf.distribute.MirroredStrategy(...) (issue 35): 239 rows in batches of 32, SGD, 2 epochs. Before:
    3.6e-3 off one device, silently (Keras weighs the replicas' 8 and 7 rows equally), as the word now."""
    x, y = _data(239)

    def trained(distribute):
        model = _mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute=distribute)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return model

    single = trained(None)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    difference = _max_weight_difference(single, trained(strategy))
    print(f"a user's MirroredStrategy object vs one device, uneven last batch: max |dw| = {difference:.3g}")
    assert difference <= 1e-5
