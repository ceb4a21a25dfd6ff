"""The seed tutorials: TensorFlow's "Distributed training with Keras" (MirroredStrategy, save and load
both ways) and kerasdist's own two-line example (MobileNetV3Small in place of ResNet50, see the guide file), each on 2 logical CPU replicas."""

import os
import runpy
import time

import keras
import numpy as np
import pytest

from tests.guides import _data
from tests.guides._harness import assert_trained_on_replicas, describe, observe, run_in_this_process

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    fits = []
    namespace, error = run_in_this_process(os.path.join(HERE, "guide_tf_distribute_keras.py"), fits,
                                           {"GUIDE_WORKDIR": str(tmp_path_factory.mktemp("tf_keras_tutorial"))})
    return fits, namespace, error


@pytest.mark.timeout(300)
def test_tutorial_trains_on_2_replicas(tutorial):
    fits, _, _ = tutorial
    assert_trained_on_replicas(fits[0], "accuracy")


@pytest.mark.timeout(300)
def test_tutorial_saved_model_loads_plain_and_distributed_with_the_same_predictions(tutorial):
    _, ns, error = tutorial
    if error is not None:
        raise error
    trained, plain, replicated = ns["model"], ns["unreplicated_model"], ns["replicated_model"]
    # load_model brings the saved distribute="mirrored" back (one log line says so), also for the tutorial's
    # "load without strategy.scope()" step; its plain compile then keeps the model's strategy, as Keras does for
    # a model built in a scope. kerasdist.load_plain(path) is the one-replica load (tests/test_save_load_word.py).
    assert describe(plain)["replicas"] == 2 and describe(replicated)["replicas"] == 2
    _assert_loaded_models_equal_the_trained_one(trained, plain, replicated, ns["eval_dataset"])


def _assert_loaded_models_equal_the_trained_one(trained, plain, replicated, eval_dataset):
    x = next(iter(eval_dataset))[0].numpy()
    expected = trained.predict(x, verbose=0)
    diffs = [float(np.max(np.abs(m.predict(x, verbose=0) - expected))) for m in (plain, replicated)]
    print("saved after distributed training: max |prediction diff| plain, distributed =", diffs)
    assert max(diffs) <= 1e-5
    accuracy = [m.evaluate(eval_dataset, verbose=0)[1] for m in (trained, plain, replicated)]
    assert accuracy[0] > 0.5 and accuracy[1] == pytest.approx(accuracy[0]) == pytest.approx(accuracy[2])


def _small_model():
    return keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(),
                             keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])


@pytest.mark.timeout(300)
def test_saved_plain_loads_and_trains_distributed(tmp_path):
    (x, y), _ = _data.load_data()
    x, y = x[:2048].astype("float32") / 255, y[:2048]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = _small_model()
    plain.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    plain.fit(x, y, batch_size=64, epochs=1, verbose=0)
    plain.save(tmp_path / "plain.keras")
    loaded = keras.models.load_model(tmp_path / "plain.keras")
    np.testing.assert_allclose(loaded.predict(x[:64], verbose=0), plain.predict(x[:64], verbose=0), atol=1e-6)
    loaded.compile(optimizer="adam", loss=loss, metrics=["accuracy"], distribute="mirrored")
    history = loaded.fit(x, y, batch_size=64, epochs=2, verbose=0).history
    print("loaded plain, trained distributed:", history)
    assert describe(loaded)["replicas"] == 2
    assert history["loss"][1] < history["loss"][0] and history["accuracy"][-1] > 0.5


@pytest.mark.timeout(300)
def test_two_line_example_trains_on_2_replicas():
    start, cpu_start = time.monotonic(), time.process_time()
    with observe([]) as fits:
        runpy.run_path(os.path.join(HERE, "guide_two_line_example.py"), run_name="__main__")
    seconds, cpu_seconds = time.monotonic() - start, time.process_time() - cpu_start
    (fit,) = fits
    print(f"MobileNetV3Small (32x32x3), 2 steps of 8 on 2 replicas: {seconds:.1f} s wall, {cpu_seconds:.1f} s CPU; {fit}")
    assert fit["strategy"] == "MirroredStrategy" and fit["replicas"] == 2
    assert np.isfinite(fit["history"]["loss"][0])


@pytest.mark.timeout(300)
def test_tutorial_saved_model_with_load_plain_for_the_plain_load(tutorial):
    """The tutorial's save/load cells with kerasdist's documented plain load (kerasdist.load_plain)."""
    import kerasdist

    _, ns, _ = tutorial
    trained, path = ns["model"], ns["path"]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = kerasdist.load_plain(path)
    plain.compile(loss=loss, optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    replicated = keras.models.load_model(path)
    replicated.compile(loss=loss, optimizer=keras.optimizers.Adam(), metrics=["accuracy"], distribute="mirrored")
    assert describe(plain)["replicas"] == 1 and describe(replicated)["replicas"] == 2
    _assert_loaded_models_equal_the_trained_one(trained, plain, replicated, ns["eval_dataset"])
