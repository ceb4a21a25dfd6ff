"""The plugin system: registry, resolution of distribute=, errors, allow/deny lists, discovery."""

import dataclasses
import importlib.metadata
import json
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist
from kerasdist import manager
from kerasdist.manager import PluginSystem
from tests.helpers import child_env, python, run


def _model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])


@dataclasses.dataclass
class Solo(kerasdist.StrategySpec):
    device: str = "/cpu:0"


class SoloPlugin:
    """An in-process third-party-style strategy plugin."""

    __name__ = "solo-plugin"

    @kerasdist.hookimpl
    def kerasdist_register_strategies(self, register):
        register("solo", Solo, description="one device")

    @kerasdist.hookimpl
    def kerasdist_create_strategy(self, spec):
        if isinstance(spec, Solo):
            return tf.distribute.OneDeviceStrategy(spec.device)


def _entry_point(name, value):
    return importlib.metadata.EntryPoint(name=name, value=value, group=manager.ENTRY_POINT_GROUP)


# -- resolution and clear errors ---------------------------------------------

def test_unknown_name_names_value_lists_available_and_suggests():
    with pytest.raises(kerasdist.UnknownPluginError) as info:
        _model().compile(loss="mse", distribute="mirorred")
    message = str(info.value)
    assert "'mirorred'" in message and "mirrored" in message and "Did you mean 'mirrored'?" in message


def test_names_are_case_insensitive_and_aliases_work():
    for name in ("Mirrored", " MIRRORED ", "mirror"):
        model = _model()
        model.compile(loss="mse", distribute=name)
        assert isinstance(model.distribute_strategy, tf.distribute.MirroredStrategy)


@pytest.mark.parametrize("bad", [3, True, object(), {"mirrored": 1}, []])
def test_wrong_type_is_refused_with_the_accepted_forms(bad):
    with pytest.raises(kerasdist.KerasdistError, match="distribute="):
        _model().compile(loss="mse", distribute=bad)


def test_two_strategies_in_one_plan_are_refused():
    with pytest.raises(kerasdist.KerasdistError, match="two strategies"):
        _model().compile(loss="mse", distribute=["mirrored", tf.distribute.OneDeviceStrategy("/cpu:0")])


def test_strategy_instance_spec_object_and_auto_are_accepted():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    model = _model()
    model.compile(loss="mse", distribute=strategy)
    assert model.distribute_strategy is strategy
    model = _model()
    model.compile(loss="mse", distribute=kerasdist.mirrored(devices=["/cpu:0"]))
    assert model.distribute_strategy.num_replicas_in_sync == 1
    model = _model()
    model.compile(loss="mse", distribute="auto")
    assert isinstance(model.distribute_strategy, tf.distribute.MirroredStrategy)
    assert model.distribute_strategy.num_replicas_in_sync == 2


def test_same_spec_reuses_one_strategy_per_process():
    a, b = _model(), _model()
    a.compile(loss="mse", distribute="mirrored")
    b.compile(loss="mse", distribute=kerasdist.mirrored())
    assert a.distribute_strategy is b.distribute_strategy


def test_bad_device_is_named():
    with pytest.raises(kerasdist.KerasdistError, match="/cpu:7"):
        _model().compile(loss="mse", distribute=kerasdist.mirrored(devices=["/cpu:7"]))


def test_model_bound_to_another_strategy_is_refused():
    other = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with other.scope():
        model = _model()
    with pytest.raises(kerasdist.StrategyConflictError, match="MirroredStrategy") as info:
        model.compile(loss="mse", distribute="mirrored")
    assert "Pass that strategy object" in str(info.value)
    model.compile(loss="mse", distribute=other)  # the strategy it was built under is fine
    assert model.distribute_strategy is other


def test_non_tensorflow_backend_is_refused_for_tf_only_plugins(monkeypatch):
    # Other backends need jax (even "numpy" imports it), which this project does not install:
    # the check reads keras.backend.backend(), so that is what the test changes.
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(kerasdist.BackendError) as info:
        _model().compile(loss="mse", distribute="mirrored")
    message = str(info.value)
    assert "'mirrored'" in message and "'jax'" in message and "KERAS_BACKEND=tensorflow" in message
    row = next(r for r in kerasdist.list_plugins() if r["name"] == "mirrored")
    assert row["available"] is False and "'jax'" in row["reason"]


def test_cpu_replicas_env_is_validated():
    from kerasdist.devices import cpu_replicas_from_env

    assert cpu_replicas_from_env({"KERASDIST_CPU_REPLICAS": "3"}) == 3
    assert cpu_replicas_from_env({}) is None
    for bad in ("0", "two", "-1"):
        with pytest.raises(kerasdist.KerasdistError, match=f"KERASDIST_CPU_REPLICAS='{bad}'"):
            cpu_replicas_from_env({"KERASDIST_CPU_REPLICAS": bad})


def test_cpu_replicas_too_late_is_a_clear_error():
    code = ("import tensorflow as tf\ntf.constant(1.0) + 1\nimport os\n"
            "os.environ['KERASDIST_CPU_REPLICAS'] = '2'\n"
            "try:\n    import kerasdist\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = run(python("-c", code), timeout=120).stdout
    assert "KerasdistError" in out and "too late" in out and "Import kerasdist before" in out


# -- registry ---------------------------------------------------------------------

def test_duplicate_name_is_refused_unless_override(fresh_system):
    fresh_system.add_plugin(SoloPlugin(), name="first")

    class Again:
        @kerasdist.hookimpl
        def kerasdist_register_strategies(self, register):
            register("SOLO", Solo)

    with pytest.raises(kerasdist.DuplicatePluginError) as info:
        fresh_system.add_plugin(Again(), name="second")
    assert "'solo'" in str(info.value) and "override=True" in str(info.value)

    class Override:
        @kerasdist.hookimpl
        def kerasdist_register_strategies(self, register):
            register("solo", Solo, description="replaced", override=True)

    fresh_system.add_plugin(Override(), name="third")
    assert fresh_system.registry.get("solo").description == "replaced"


def test_registering_a_non_spec_class_is_refused(fresh_system):
    class Bad:
        @kerasdist.hookimpl
        def kerasdist_register_strategies(self, register):
            register("bad", dict)

    with pytest.raises(kerasdist.PluginValidationError, match="StrategySpec"):
        fresh_system.add_plugin(Bad(), name="bad")


def test_missing_dependency_is_listed_with_install_hint_and_refused_at_compile(fresh_system):
    class NeedsThing:
        @kerasdist.hookimpl
        def kerasdist_register_strategies(self, register):
            register("thing", Solo, requires=("kerasdist_no_such_module",), extra="thing")

    fresh_system.add_plugin(NeedsThing(), name="needs-thing")
    row = next(r for r in kerasdist.list_plugins() if r["name"] == "thing")
    assert row["available"] is False
    assert "kerasdist_no_such_module" in row["reason"] and row["install"] == "pip install 'kerasdist[thing]'"
    with pytest.raises(kerasdist.PluginUnavailableError, match=r"kerasdist\[thing\]"):
        _model().compile(loss="mse", distribute="thing")


def test_failing_import_is_reported_and_kerasdist_still_works(monkeypatch):
    eps = [_entry_point("broken", "kerasdist_no_such_plugin_module"),
           _entry_point("mirrored", "kerasdist_plugins.mirrored")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps)
    system = PluginSystem(environ={})
    rows = {r["name"]: r for r in system.registry.rows()}
    assert rows["broken"]["available"] is False
    assert "kerasdist_no_such_plugin_module" in rows["broken"]["reason"]
    assert rows["mirrored"]["available"] is True
    with pytest.raises(kerasdist.PluginUnavailableError, match="broken"):
        system.registry.get("broken")


def test_disable_and_allow_lists(monkeypatch):
    eps = [_entry_point("mirrored", "kerasdist_plugins.mirrored")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps)
    disabled = PluginSystem(environ={"KERASDIST_DISABLE_PLUGINS": "Mirrored"})
    assert "mirrored" not in disabled.registry.entries
    with pytest.raises(kerasdist.PluginUnavailableError, match="KERASDIST_DISABLE_PLUGINS"):
        disabled.registry.get("mirrored")
    assert PluginSystem(environ={"KERASDIST_LOAD_PLUGINS": "other"}).registry.entries == {}
    assert "mirrored" in PluginSystem(environ={"KERASDIST_LOAD_PLUGINS": "mirrored"}).registry.entries


def test_in_process_plugin_trains(fresh_system):
    fresh_system.add_plugin(SoloPlugin())
    model = _model()
    model.compile(loss="mse", optimizer="sgd", distribute="solo")
    assert isinstance(model.distribute_strategy, tf.distribute.OneDeviceStrategy)
    model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0)
    assert kerasdist.solo(device="/cpu:1").device == "/cpu:1"


def test_distribute_none_is_keras_itself():
    results = []
    for kwargs in ({}, {"distribute": None}):
        keras.utils.set_random_seed(1)
        model = _model()
        model.compile(loss="mse", optimizer="sgd", **kwargs)
        model.fit(np.arange(32.0).reshape(8, 4) / 32, np.ones((8, 1)), epochs=2, verbose=0)
        assert "_kerasdist_session" not in model.__dict__
        results.append([w.numpy() for w in model.weights])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_plugins_command_json_lists_every_plugin():
    out = run(python("-m", "kerasdist.cli", "plugins", "--json"), timeout=120).stdout
    rows = json.loads(out[out.index("["):])
    mirrored = next(r for r in rows if r["name"] == "mirrored")
    assert {"name", "kind", "available", "reason", "package"} <= set(mirrored)
    assert mirrored["kind"] == "strategy" and mirrored["available"] is True
    assert mirrored["package"] == "kerasdist"
    assert all(r["kind"] in ("strategy", "optimization", "export", None) for r in rows)


def test_import_kerasdist_does_not_import_optional_dependencies():
    code = ("import sys, kerasdist\nkerasdist.list_plugins()\n"
            "print(sorted(m for m in ('horovod', 'tensorflow_model_optimization', 'tf_keras', 'tensorrt') "
            "if m in sys.modules))\nimport os\nprint(os.environ.get('TF_USE_LEGACY_KERAS'))")
    out = run(python("-c", code), timeout=120).stdout.strip().splitlines()
    assert out[-2:] == ["[]", "None"]


def test_compile_signature_shows_distribute():
    import inspect

    assert "distribute" in inspect.signature(keras.Model.compile).parameters
    assert sys.modules["kerasdist.integration"].original("compile") is not keras.Model.compile


def test_loading_a_compiled_model_still_compiles_it(tmp_path):
    model = _model()
    model.compile(loss="mse", optimizer="adam", metrics=["mae"])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.compiled and isinstance(loaded.optimizer, keras.optimizers.Adam)


def test_plain_recompile_drops_kerasdist_from_the_model():
    model = _model()
    model.compile(loss="mse", optimizer="sgd", distribute="mirrored")
    assert kerasdist.strategy_of(model) is not None
    model.compile(loss="mse", optimizer="sgd")
    assert kerasdist.strategy_of(model) is None
    assert isinstance(model.distribute_strategy, tf.distribute.MirroredStrategy)  # as Keras keeps it
    model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)


def test_plain_recompile_with_an_optimizer_made_outside_the_strategy_trains_and_evaluates():
    # TensorFlow's "Distributed training with Keras" tutorial: a model that kerasdist distributed (here
    # through load_model restoring distribute=) compiled again plainly with an optimizer instance.
    model = _model()
    model.compile(loss="mse", optimizer="sgd", distribute="mirrored")
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(), metrics=["mae"])
    assert kerasdist.strategy_of(model) is None
    assert model.optimizer._distribution_strategy is model.distribute_strategy
    model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    assert np.isfinite(model.evaluate(np.ones((8, 4)), np.ones((8, 1)), verbose=0)).all()


def test_availability_check_imports_nothing(fresh_system, tmp_path, monkeypatch):
    package = tmp_path / "kerasdist_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (package / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Probe:
        @kerasdist.hookimpl
        def kerasdist_register_strategies(self, register):
            register("probe", Solo, requires=("kerasdist_probe_pkg.sub",))
            register("probe2", Solo, requires=("kerasdist_probe_pkg.missing",),
                     install="bash .ci/build_probe.sh")

    fresh_system.add_plugin(Probe(), name="probe")
    rows = {r["name"]: r for r in kerasdist.list_plugins()}
    assert rows["probe"]["available"] is True
    assert rows["probe2"]["available"] is False and rows["probe2"]["install"] == "bash .ci/build_probe.sh"
    assert "kerasdist_probe_pkg" not in sys.modules


def test_callback_list_and_another_distributed_model_inside_a_callback():
    teacher, student = _model(), _model()
    teacher.compile(loss="mse", distribute="mirrored")
    student.compile(loss="mse", optimizer="sgd", distribute="mirrored")
    seen = []

    class AskTeacher(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(kerasdist.strategy_of(teacher) is not None)
            teacher.predict(np.ones((4, 4)), verbose=0)  # goes through kerasdist, not Keras's nested path

    callbacks = keras.callbacks.CallbackList([AskTeacher()], model=student)
    student.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=2, verbose=0, callbacks=callbacks)
    assert seen == [True, True]


def test_subclass_spec_gets_its_own_name_and_aliases_work_everywhere(fresh_system):
    @dataclasses.dataclass
    class FastSolo(Solo):
        pass

    class Plugins:
        @kerasdist.hookimpl
        def kerasdist_register_strategies(self, register):
            register("solo", Solo, aliases=("single",))
            register("fastsolo", FastSolo)

    fresh_system.add_plugin(Plugins(), name="plugins")
    assert FastSolo().name == "fastsolo" and Solo().name == "solo"
    assert kerasdist.single(device="/cpu:1") == Solo(device="/cpu:1")  # kerasdist.<alias>(...)
    # the disable list also matches aliases:
    system = PluginSystem(environ={"KERASDIST_DISABLE_PLUGINS": "single"}, load_entrypoints=False)
    system.add_plugin(Plugins(), name="plugins")
    assert system.registry.find("solo").unavailable_reason().startswith("disabled")
