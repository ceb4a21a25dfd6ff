"""kerasdist.quantize / tensorrt / prune options: what tensorrt(sparsity="2:4") asks of the plan, and each bad
option or model refused at compile with one error naming it (in-process, no training)."""

import keras
import numpy as np
import pytest

import kerasdist
from kerasdist_plugins import qat

# -- what tensorrt(sparsity="2:4") asks of the plan ---------------------------------------------------

TWO_OF_FOUR = {"target_sparsity": 0.5, "pattern": "2:4", "schedule": "constant"}


def _plan_names(distribute):
    from kerasdist.manager import get_system
    from kerasdist.resolve import resolve_plan

    system = get_system()
    return resolve_plan(distribute, system, system.detect_cluster())


def test_tensorrt_sparsity_asks_the_plan_for_the_prune_plugin():
    plan = _plan_names(["mirrored", kerasdist.tensorrt(sparsity="2:4"), kerasdist.quantize(layers=["x"])])
    assert [spec.name for spec in plan.specs] == ["mirrored", "tensorrt", "prune", "quantize"]
    assert plan.optimizations[1] == kerasdist.prune(**TWO_OF_FOUR)
    assert [spec.name for spec in _plan_names(kerasdist.tensorrt()).specs] == ["tensorrt"]
    same = _plan_names([kerasdist.tensorrt(sparsity="2:4"), kerasdist.prune(**TWO_OF_FOUR)])  # a saved plan's shape
    assert [spec.name for spec in same.specs] == ["tensorrt", "prune"]
    with pytest.raises(kerasdist.KerasdistError, match=r"gives Prune\(target_sparsity=0.8.*but 'tensorrt' "
                                                       r"\(TensorRT\(sparsity='2:4'.*needs Prune\(target_sparsity=0.5"):
        _plan_names([kerasdist.tensorrt(sparsity="2:4"), kerasdist.prune(target_sparsity=0.8)])


def test_a_model_compiled_with_tensorrt_sparsity_saves_and_loads_its_plan_once(tmp_path):
    from kerasdist.session import session_of

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="fc")])
    model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.tensorrt(sparsity="2:4"))
    model.save(tmp_path / "trt.keras")
    loaded = keras.saving.load_model(tmp_path / "trt.keras")
    assert [spec.name for spec in session_of(loaded).plan.specs] == ["tensorrt", "prune"]


@pytest.mark.parametrize("variable, value, why", [
    ("KERASDIST_DISABLE_PLUGINS", "pruning", r"no loaded plugin registers; not loaded here: .*plugin 'pruning' "
                                             r"\(disabled by KERASDIST_DISABLE_PLUGINS"),
    ("KERASDIST_LOAD_PLUGINS", "mirrored,qat", r"no loaded plugin registers; not loaded here: .*plugin 'pruning' "
                                               r"\(disabled by KERASDIST_DISABLE_PLUGINS / KERASDIST_LOAD_PLUGINS"),
    ("KERASDIST_DISABLE_PLUGINS", "prune", r"of plugin 'pruning', which cannot run here: disabled by "),
], ids=["disable-pruning", "load-without-pruning", "disable-the-prune-name"])
def test_tensorrt_sparsity_without_the_prune_plugin_fails_at_compile_naming_it(variable, value, why):
    """The allow/deny lists hold: qat reaches pruning only through the plan, so without it nothing prunes."""
    from kerasdist.manager import PluginSystem, get_system, reset_system

    previous = get_system()
    reset_system(PluginSystem(environ={variable: value}))
    try:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="fc")])
        with pytest.raises(kerasdist.PluginUnavailableError, match=r"'tensorrt' \(TensorRT\(sparsity='2:4'.*\) needs "
                                                                   r"the optimization 'prune'.*" + why):
            model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.tensorrt(sparsity="2:4"))
        assert not qat.is_quantization_aware(model)  # refused before anything changed the model
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.tensorrt())
        assert qat.is_quantization_aware(model)
    finally:
        reset_system(previous)


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, match", [
    ({"bits": 4}, r"bits=4 is not supported.*bits=8"),
    ({"weights": "per_row"}, r"per_row.*per_channel"),
    ({"ema_decay": 1.0}, r"ema_decay=1.0.*between 0 and 1"),
])
def test_bad_quantize_options_name_the_value(options, match):
    with pytest.raises(kerasdist.KerasdistError, match=match):
        kerasdist.quantize(**options)


def test_unknown_layer_names_are_named_with_the_models_layers():
    model = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(8, 3, name="conv"), keras.layers.Flatten(),
                              keras.layers.Dense(4, name="fc")])
    with pytest.raises(kerasdist.KerasdistError, match=r"quantize: layers=\['nope'\] names \['nope'\] that the model "
                                                       r"does not have; its layers are \[.*conv"):
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize(layers=["nope"]))


def test_a_model_without_quantizable_layers_is_refused_at_compile():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Activation("relu"), keras.layers.Softmax()])
    with pytest.raises(kerasdist.KerasdistError, match="no quantizable layer.*Dense"):
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize())


def test_a_model_quantized_by_keras_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.quantize("int8")
    with pytest.raises(kerasdist.KerasdistError, match=r"already quantized with Keras's model.quantize\(\)"):
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize())


def test_unsupported_layers_are_skipped_with_a_warning_or_refused_when_listed():
    model = keras.Sequential([keras.Input((8, 2)), keras.layers.Conv1D(4, 3, padding="causal", name="causal"),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    with pytest.warns(UserWarning, match=r"skipping 'causal' \(causal padding"):
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize())
    other = keras.Sequential([keras.Input((8, 2)), keras.layers.Conv1D(4, 3, padding="causal", name="c"),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    with pytest.raises(kerasdist.KerasdistError, match=r"layer 'c': causal padding"):
        other.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize(layers=["c"]))


def test_an_unbuilt_model_and_an_untrained_export_get_clear_errors(tmp_path):
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(kerasdist.KerasdistError, match="not built.*keras.Input"):
        unbuilt.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize())
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize())
    with pytest.raises(kerasdist.KerasdistError, match="never learned.*run fit first"):
        kerasdist.export(model, str(tmp_path / "m.tflite"), format="litert-int8")


@pytest.mark.parametrize("options, match", [
    ({"pattern": "3:4"}, r"pattern='3:4' is not supported.*'2:4'"),
    ({"block": (1, 0)}, r"block=\(1, 0\) is not valid"),
])
def test_bad_structured_pruning_options(options, match):
    with pytest.raises(kerasdist.KerasdistError, match=match):
        kerasdist.prune(**options)


def test_a_block_that_does_not_divide_a_named_kernel_is_refused():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="d")])
    with pytest.raises(kerasdist.KerasdistError, match=r"block=\(1, 4\) does not divide layer 'd'.*\(6, 5\)"):
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.prune(block=(1, 4), layers=["d"]))


def test_block_sparsity_zeroes_whole_blocks():
    from kerasdist_plugins.pruning.masks import block_mask

    kernel = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
    mask = keras.ops.convert_to_numpy(block_mask(kernel, (1, 4), 0.5))
    blocks = mask.reshape(8, 2, 4)
    assert mask.mean() == 0.5 and np.all((blocks.min(-1) == blocks.max(-1)))


def test_processes_that_are_not_replicas_of_one_strategy_are_refused(monkeypatch):
    monkeypatch.setattr(kerasdist, "detect_cluster",
                        lambda: kerasdist.ClusterInfo(cluster={"worker": ["a:1", "b:2"]}, source="horovod"))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(kerasdist.KerasdistError, match=r"one of 2 processes \(horovod\).*own\s+int8 ranges"):
        model.compile(loss="mse", optimizer="sgd", distribute=kerasdist.quantize())
