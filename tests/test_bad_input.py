"""Bad option values, empty inputs and bad export arguments: one KerasdistError each, naming the value, raised
in seconds and before anything runs (the cluster/launch/env cases are in test_bad_input_core.py)."""

import os
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])


def _compile(distribute):
    return lambda: _model().compile(loss="mse", optimizer="sgd", distribute=distribute)


def _raises(action, words, error=kerasdist.KerasdistError):
    start = time.monotonic()
    with pytest.raises(error) as info:
        action()
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert all(word in message for word in words), message
    return message


OPTION_CASES = {
    "mirrored-devices-a-string": (lambda: kerasdist.mirrored(devices="/cpu:0"), ["devices='/cpu:0'", "a list of strings"]),
    "mirrored-devices-numbers": (lambda: kerasdist.mirrored(devices=[0, 1]), ["devices=[0, 1]", "a list of strings"]),
    "mirrored-duplicate-devices": (_compile(kerasdist.spec("mirrored", devices=["/cpu:0", "/device:CPU:0"])),
                                   ["names a device twice"]),
    "mirrored-nccl-on-cpu": (_compile(kerasdist.spec("mirrored", cross_device_ops="nccl")),
                             ["cross_device_ops='nccl' needs GPUs", "'auto'"]),
    "multiworker-communication-5": (lambda: kerasdist.multiworker(communication=5), ["communication=5", "a string"]),
    "multiworker-shard-policy-none": (lambda: kerasdist.multiworker(shard_policy=None), ["shard_policy=None"]),
    "prune-layers-5": (lambda: kerasdist.prune(layers=5), ["layers=5", "a list of strings or a function"]),
    "ps-workers-a-string": (lambda: kerasdist.ps(workers="host:2222"), ["workers='host:2222'", "a list of strings"]),
    "ps-connect-timeout-nan": (lambda: kerasdist.ps(connect_timeout=float("nan")), ["connect_timeout=nan"]),
    "horovod-shard-no": (lambda: kerasdist.horovod(shard="no"), ["shard='no'", "True or False"]),
    "hybrid-mesh-not-a-dict": (lambda: kerasdist.hybrid(mesh=[2, 4]), ["mesh=[2, 4]"]),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_a_bad_option_value_is_named(case):
    action, words = OPTION_CASES[case]
    _raises(action, words)


def test_numpy_scalars_are_accepted_for_numbers():
    assert kerasdist.prune(target_sparsity=np.float32(0.5)).target_sparsity == 0.5
    assert kerasdist.ps(workers=["h:1"], ps=["h:2"], connect_timeout=np.float64(3.0)).connect_timeout == 3.0
    assert kerasdist.prune(frequency=np.int64(10)).frequency == 10
    assert kerasdist.horovod(shard=np.bool_(False)).shard is not True


def _empty_dataset():
    return tf.data.Dataset.from_tensor_slices((np.zeros((0, 4), "float32"), np.zeros((0, 2), "float32"))).batch(2)


EMPTY_CASES = {
    "arrays-fit": (lambda m: m.fit(np.zeros((0, 4)), np.zeros((0, 2)), verbose=0), ["fit: x has 0 examples"]),
    "arrays-evaluate": (lambda m: m.evaluate(np.zeros((0, 4)), np.zeros((0, 2)), verbose=0),
                        ["evaluate: x has 0 examples"]),
    "dict-predict": (lambda m: m.predict({"x": np.zeros((0, 4))}, verbose=0), ["predict: x has 0 examples"]),
    "dataset-fit": (lambda m: m.fit(_empty_dataset(), verbose=0), ["fit: the tf.data.Dataset", "is empty"]),
}


@pytest.mark.parametrize("distribute", ["mirrored", "central_storage"])
@pytest.mark.parametrize("case", list(EMPTY_CASES))
def test_an_empty_input_is_named_before_any_strategy_runs(case, distribute):
    model = _model()
    model.compile(loss="mse", optimizer="sgd", distribute=distribute)
    action, words = EMPTY_CASES[case]
    _raises(lambda: action(model), words)


@pytest.fixture
def read_only_folder(tmp_path):
    if os.getuid() == 0:
        return "/proc/self"  # root may write anywhere else
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    return str(folder)


EXPORT_CASES = {
    "int8-data-wrong-shape": ("litert-int8", {"representative_data": np.zeros((8, 5), "float32")},
                              ["representative_data", "shape (8, 5)", "input (4,)"]),
    "int8-generator-wrong-shape": ("litert-int8", {"representative_data": lambda: iter([[np.zeros((1, 7), "float32")]])},
                                   ["shape (1, 7)", "input (4,)"]),
    "onnx-int8-data-wrong-shape": ("onnx-int8", {"representative_data": np.zeros((8, 3), "float32")},
                                   ["shape (8, 3)", "input (4,)"]),
    "empty-verify-with": ("litert", {"verify_with": np.zeros((0, 4), "float32")}, ["verify_with", "no examples"]),
    "verify-with-wrong-shape": ("onnx", {"verify_with": np.zeros((2, 9), "float32")},
                                ["verify_with", "shape (2, 9)", "input (4,)"]),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_bad_export_arguments_are_named_before_any_file_is_written(case, tmp_path):
    format, options, words = EXPORT_CASES[case]
    _raises(lambda: kerasdist.export(_model(), str(tmp_path / "out.bin"), format=format, **options), words)
    assert not os.listdir(tmp_path)


def test_a_missing_or_read_only_folder_is_named_before_converting(tmp_path, read_only_folder):
    missing = tmp_path / "no" / "such"
    _raises(lambda: kerasdist.export(_model(), str(missing / "m.tflite"), format="litert"),
            [f"the folder {missing} does not exist"])
    _raises(lambda: kerasdist.export(_model(), os.path.join(read_only_folder, "m.onnx"), format="onnx"),
            [f"cannot write to {read_only_folder}"])


def test_compile_inside_another_strategys_scope_names_both_strategies():
    """Keras users write compile inside ``with strategy.scope()``: the same strategy is fine; another one
    is one KerasdistError naming both and the fix (TensorFlow's own error was a raw RuntimeError)."""
    theirs = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    same, other, another = _model(), _model(), _model()  # built outside any scope
    with theirs.scope():
        same.compile(loss="mse", optimizer="sgd", distribute=theirs)
        assert same.distribute_strategy is theirs
        _raises(lambda: other.compile(loss="mse", distribute="mirrored"),
                ["distribute='mirrored'", "inside `with strategy.scope()` of MirroredStrategy",
                 "another strategy object, MirroredStrategy", "Call compile outside the scope", "distribute=strategy"])
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        _raises(lambda: another.compile(loss="mse", distribute=theirs),
                ["of OneDeviceStrategy(['/device:CPU:0'])", "MirroredStrategy(['/device:CPU:0', '/device:CPU:1'])"])


def test_mirrored_devices_that_name_no_device_are_refused_when_the_spec_is_made():
    _raises(lambda: kerasdist.mirrored(devices=["bogus"]),
            ["devices=['bogus']", "'bogus' is not a device name", "'/gpu:0'", "'/device:CPU:1'"])
    _raises(lambda: kerasdist.spec("mirrored", devices=["/cpu:0", "/gpu:x"]), ["'/gpu:x' is not a device name"])
    _raises(lambda: kerasdist.mirrored(devices=[]), ["devices=[] names no device", "None for the default devices"])
    _raises(lambda: kerasdist.central_storage(compute_devices=[]),
            ["central_storage: compute_devices=[] names no device", "None for the default devices"])
    _raises(lambda: kerasdist.spec("central_storage", compute_devices=["cpu zero"]), ["'cpu zero' is not a device name"])


def test_an_optimization_named_twice_is_refused_before_the_model_is_touched():
    model = _model()
    _raises(lambda: model.compile(loss="mse", distribute=["mirrored", kerasdist.prune(),
                                                          kerasdist.prune(target_sparsity=0.9)]),
            ["the optimization 'prune' twice", "target_sparsity=0.5", "target_sparsity=0.9", "kerasdist.prune(...)"])
    assert not model.compiled and kerasdist.strategy_of(model) is None
    _raises(lambda: kerasdist.prune() + kerasdist.prune(frequency=5), ["'prune' twice", "frequency=5"])


def test_an_export_path_that_is_a_folder_is_named_before_converting(tmp_path, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("the converter ran")

    monkeypatch.setattr(tf.lite.TFLiteConverter, "from_keras_model", no_conversion)
    monkeypatch.setattr(keras.Model, "export", no_conversion)
    for format in ("litert", "litert-int8", "onnx"):
        _raises(lambda: kerasdist.export(_model(), str(tmp_path), format=format,
                                         **({"representative_data": np.zeros((4, 4), "float32")}
                                            if format == "litert-int8" else {})),
                [f"export(format={format!r}): {tmp_path} is a folder", "os.path.join(folder, 'model.bin')"])
    assert not os.listdir(tmp_path)
