"""Safe plugin loading: a bad third-party plugin never breaks kerasdist; options are checked; lazy imports."""

import dataclasses
import json
import os
import sys
import textwrap
import warnings

import pytest

import kerasdist
from kerasdist.manager import PluginSystem, get_system
from tests.helpers import ROOT, child_env, python, run

EXAMPLE_PLUGIN_DIR = os.path.join(ROOT, "examples", "kerasdist-example-plugin")

CLASHING_PLUGIN = textwrap.dedent("""
    import dataclasses
    import kerasdist

    @dataclasses.dataclass
    class Impostor(kerasdist.StrategySpec):
        pass

    @kerasdist.hookimpl
    def kerasdist_register_strategies(register):
        register("impostor-extra", Impostor)
        register("mirrored", Impostor, description="takes a built-in name")
""")


def _pip_install_package(tmp_path, name, source, entry_points):
    """Build and pip-install (into a --target folder) a real one-module plugin package."""
    module = name.replace("-", "_")
    package = tmp_path / name
    package.mkdir()
    (package / f"{module}.py").write_text(source)
    points = "".join(f'{key} = "{value}"\n' for key, value in entry_points.items())
    (package / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "1.0"
        [tool.setuptools]
        py-modules = ["{module}"]
        [project.entry-points.kerasdist]
    """) + points)
    site = tmp_path / "site"
    run(python("-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", "--no-build-isolation",
               "--target", str(site), str(package)), timeout=240)
    return site


@pytest.mark.timeout(400)
def test_a_package_taking_a_builtin_name_is_listed_as_failed_and_breaks_nothing(tmp_path):
    site = _pip_install_package(tmp_path, "kerasdist-clash", CLASHING_PLUGIN, {"clash": "kerasdist_clash"})
    env = child_env(PYTHONPATH=str(site))
    out = run(python("-m", "kerasdist.cli", "plugins", "--json"), timeout=120, env=env).stdout
    rows = {r["name"]: r for r in json.loads(out[out.index("["):])}
    assert rows["mirrored"]["package"] == "kerasdist" and rows["mirrored"]["available"] is True
    clash = rows["clash"]
    assert clash["available"] is False and clash["package"] == "kerasdist-clash"
    assert "'mirrored'" in clash["reason"] and "already has" in clash["reason"]
    assert "impostor-extra" not in rows  # all or nothing: the failed package registers no name
    assert "KERASDIST_DISABLE_PLUGINS=clash" in clash["install"]
    code = ("import keras, kerasdist\n"
            "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
            "model.compile(loss='mse', distribute='mirrored')\n"
            "print('RESULT', type(model.distribute_strategy).__name__, type(kerasdist.mirrored()).__module__)")
    out = run(python("-c", code), timeout=180, env=env).stdout
    assert "RESULT MirroredStrategy kerasdist_plugins.mirrored" in out


@dataclasses.dataclass
class Mine(kerasdist.StrategySpec):
    value: int = 1


class Overrider:
    @kerasdist.hookimpl
    def kerasdist_register_strategies(self, register):
        register("mirrored", Mine, aliases=("mine",), override=True)


def test_override_then_unregister_restores_the_builtin():
    system = get_system()
    builtin = system.registry.find("mirrored")
    kerasdist.register_plugin(Overrider(), name="overrider")
    try:
        assert isinstance(kerasdist.mirrored(), Mine)
        assert kerasdist.mine(value=2).value == 2
    finally:
        kerasdist.unregister_plugin("overrider")
    assert system.registry.find("mirrored") is builtin
    assert type(kerasdist.mirrored()).__module__ == "kerasdist_plugins.mirrored"
    assert kerasdist.spec("mirror") == kerasdist.mirrored()  # its aliases came back too
    with pytest.raises(AttributeError):
        kerasdist.mine


def test_unregistering_an_unknown_plugin_names_the_registered_ones(fresh_system):
    with pytest.raises(kerasdist.KerasdistError, match="No plugin named 'nope'"):
        kerasdist.unregister_plugin("nope")


class NotASpec:
    @kerasdist.hookimpl
    def kerasdist_register_strategies(self, register):
        register("broken", dict)


class MisspelledHook:
    @kerasdist.hookimpl
    def kerasdist_register_strategys(self, register):
        pass


class Taken:
    @kerasdist.hookimpl
    def kerasdist_register_strategies(self, register):
        register("fresh-name", Mine)
        register("mirrored", Mine)


@pytest.mark.parametrize("plugin,error,words", [
    (NotASpec(), kerasdist.PluginValidationError, ["'broken'", "StrategySpec"]),
    (MisspelledHook(), kerasdist.PluginValidationError,
     ["kerasdist_register_strategys", "Did you mean 'kerasdist_register_strategies'"]),
    (Taken(), kerasdist.DuplicatePluginError, ["'mirrored'", "already has", "override=True"]),
], ids=["not-a-spec", "misspelled-hook", "taken-name"])
def test_register_plugin_of_an_invalid_plugin_raises_and_leaves_nothing(plugin, error, words):
    system = get_system()
    before = dict(system.registry.entries)
    with pytest.raises(error) as info:
        kerasdist.register_plugin(plugin, name="invalid")
    assert all(word in str(info.value) for word in words), str(info.value)
    assert system.registry.entries == before and not system.pm.has_plugin("invalid")


def test_a_failing_entry_point_plugin_is_listed_with_its_reason(monkeypatch, tmp_path):
    (tmp_path / "kerasdist_typo_plugin.py").write_text(textwrap.dedent("""
        import kerasdist

        @kerasdist.hookimpl
        def kerasdist_register_strategys(register):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.metadata

    point = importlib.metadata.EntryPoint(name="typo", value="kerasdist_typo_plugin", group="kerasdist")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [point])
    system = PluginSystem(environ={})
    (failure,) = system.registry.failures
    assert failure.name == "typo" and "Did you mean 'kerasdist_register_strategies'" in failure.reason


def test_lookalike_hook_functions_are_warned_about(fresh_system):
    class Forgetful:
        def kerasdist_register_strategies(self, register):  # no @hookimpl
            register("never", Mine)

        def kerasdist_adjust_compyle(self, compile_kwargs):
            pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh_system.add_plugin(Forgetful(), name="forgetful")
    messages = sorted(str(w.message) for w in caught if issubclass(w.category, kerasdist.PluginWarning))
    assert len(messages) == 2
    assert "'kerasdist_adjust_compyle' is not a kerasdist hook, so kerasdist never calls it. Did you mean 'kerasdist_adjust_compile'?" in messages[0]
    assert "'kerasdist_register_strategies' has no @kerasdist.hookimpl decorator" in messages[1]


# -- options are validated when a spec is created ------------------------------------------------

def _entries():
    """Every registered plugin, plus the example third-party plugin's (registered in-process)."""
    sys.path.insert(0, EXAMPLE_PLUGIN_DIR)
    try:
        import kerasdist_example_plugin as example
    finally:
        sys.path.remove(EXAMPLE_PLUGIN_DIR)
    system = PluginSystem(environ={})
    if not system.pm.has_plugin("example"):
        system.add_plugin(example, name="example")
    return list(system.registry.entries.values())


ENTRIES = _entries()


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e.kind}-{e.name}" for e in ENTRIES])
def test_an_unknown_option_lists_the_valid_ones(entry):
    valid = entry.options()
    assert valid is not None, f"{entry.name}: options cannot be listed (factory takes **kwargs)"
    with pytest.raises(kerasdist.KerasdistError) as info:
        entry.check_options({"bogus_option": 1})
    message = str(info.value)
    assert f"{entry.name!r} has no option 'bogus_option'" in message
    assert all(name in message for name in valid)
    if entry.kind != "export":
        with pytest.raises(kerasdist.KerasdistError, match="bogus_option"):
            entry.create(bogus_option=1)
    for name in valid:
        if len(name) >= 4:  # a near miss of a real option: the last two letters swapped
            typo = name[:-2] + name[-1] + name[-2]
            with pytest.raises(kerasdist.KerasdistError, match=f"Did you mean '{name}'"):
                entry.check_options({typo: 1})
            break


def test_user_facing_forms_check_options_too(tmp_path):
    import keras

    with pytest.raises(kerasdist.KerasdistError, match="has no option 'bogus'.*devices=None"):
        kerasdist.mirrored(bogus=1)
    with pytest.raises(kerasdist.KerasdistError, match="Did you mean 'devices'"):
        kerasdist.spec("mirrored", devcies=["/cpu:0"])
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(kerasdist.KerasdistError, match="export format 'onnx' has no option 'opset'"):
        kerasdist.export(model, str(tmp_path / "m.onnx"), format="onnx", opset=13)
    assert not os.listdir(tmp_path)


def test_plugins_verbose_shows_options_defaults_aliases_and_backends():
    out = run(python("-m", "kerasdist.cli", "plugins", "-v"), timeout=120).stdout
    section = out[out.index("\nmirrored "):]
    assert "aliases: mirror" in section and section.split("\n")[1].split()[3] == "tensorflow"
    assert "tensorflow,jax" in out[out.index("\ndata_parallel "):].split("\n")[1]
    assert "options: devices=None, cross_device_ops='auto'" in section


# -- tracing and lazy imports -------------------------------------------------------------------

def test_trace_prints_hook_calls_to_stderr_without_environment_values():
    code = "import kerasdist; kerasdist.detect_cluster()"
    out = run(python("-c", code), timeout=120,
              env=child_env(KERASDIST_TRACE_PLUGINS="1", KERASDIST_SECRET_PROBE="hunter2")).stdout
    assert "kerasdist trace: kerasdist_detect_cluster(environ=<environment:" in out
    assert "kerasdist_detect_cluster returned" in out and "hunter2" not in out


def test_import_and_listing_import_neither_keras_nor_tensorflow():
    code = ("import sys, kerasdist\nkerasdist.list_plugins()\nkerasdist.mirrored()\n"
            "print('LOADED', sorted(m for m in ('keras', 'tensorflow') if m in sys.modules))")
    out = run(python("-c", code), timeout=120).stdout
    assert "LOADED []" in out


def test_keras_is_patched_and_the_cpu_split_whichever_is_imported_first():
    check = ("import tensorflow as tf\nprint('RESULT', 'distribute' in str(__import__('inspect').signature("
             "keras.Model.compile)), len(tf.config.list_logical_devices('CPU')))")
    probe_first = "import kerasdist, importlib.util\nimportlib.util.find_spec('keras')\nimport keras"
    for order in ("import kerasdist, keras", "import keras, kerasdist", probe_first):
        out = run(python("-c", f"{order}\n{check}"), timeout=120, env=child_env(KERASDIST_CPU_REPLICAS=2)).stdout
        assert "RESULT True 2" in out, (order, out[-2000:])


def test_an_unchecked_keras_is_named_at_import(tmp_path):
    from kerasdist._keras_internals import keras_version_checked

    assert keras_version_checked("3.15.1") and keras_version_checked("3.15")
    assert not keras_version_checked("3.16.0") and not keras_version_checked("3.1.5")
    # a stand-in keras 3.16 first on the path, its package beside its metadata (the keras `import keras` would load,
    # never imported: `import kerasdist` reads metadata only): the warning names it and the checked range. Metadata
    # alone would not do: beside a keras-nightly (checked) the version of the keras actually imported is the one named
    info = tmp_path / "keras-3.16.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: keras\nVersion: 3.16.0\n")
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("raise ImportError('a stand-in: never imported')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))  # before a nightly's
    out = run(python("-c", "import kerasdist"), timeout=60, env=child_env(PYTHONPATH=path)).stdout
    assert "Keras 3.16.0 is installed" in out and "keras>=3.15,<3.16" in out


def test_the_command_line_is_quiet():
    env = {k: v for k, v in child_env().items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
    out = run(python("-m", "kerasdist.cli", "env"), timeout=120, env=env).stdout
    assert "keras_backend: tensorflow" in out
    assert "oneDNN" not in out and "absl::InitializeLog" not in out and "cpu_feature_guard" not in out


def test_a_plugin_module_imported_before_kerasdist_under_a_cluster_is_registered(tmp_path):
    """A script's first import is a plugin module (it imports kerasdist, which, with a cluster variable set,
    loads the entry points at once): the plugin, mid-import then, is registered when its import is done."""
    from tests.helpers import write_plugin_distribution

    source = textwrap.dedent("""
        import dataclasses
        import kerasdist

        @dataclasses.dataclass
        class EarlySpec(kerasdist.StrategySpec):
            level: int = 1

        @kerasdist.hookimpl
        def kerasdist_register_strategies(register):
            register("early-bird", EarlySpec, backends=("tensorflow", "jax", "torch"))
    """)
    write_plugin_distribution(str(tmp_path), "early-plugin", source, {"early": "early_plugin"})
    code = ("import early_plugin, kerasdist_plugins.torch_distributed as torch_plugin\nimport kerasdist\n"
            "print('SPEC', kerasdist.spec('early-bird', level=2), type(kerasdist.data_parallel()).__name__)")
    out = run(python("-c", code), timeout=120,
              env=child_env(PYTHONPATH=str(tmp_path), RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500", KERAS_BACKEND="torch")).stdout
    assert "SPEC EarlySpec(level=2) TorchDataParallelSpec" in out, out[-3000:]
