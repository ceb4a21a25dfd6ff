"""The contract between core and plugins, checked on the source.

- Private Keras/TensorFlow API (``keras.src``, ``tensorflow.python``, other private TF modules, and
  ``obj._private`` attributes on objects kerasdist does not own) appears only in
  kerasdist/_keras_internals/.
- Built-in plugins import only kerasdist's public API, as a third-party plugin must.
- No built-in plugin imports another (one asks for another's work through the plan or the registry),
  except modules that plugin declares public in its entry module's ``KERASDIST_PUBLIC_MODULES``.
"""

import ast
import pathlib
import tomllib

import pytest

from helpers import ROOT

INTERNALS = pathlib.Path(ROOT, "kerasdist", "_keras_internals")  # the one module (a package) allowed
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.compiler", "tensorflow.core", "tensorflow.tsl",
                   "tf_keras.src")
#: What a plugin may import from kerasdist.
PUBLIC_KERASDIST = ("kerasdist", "kerasdist.plugin_tools", "kerasdist.exporting")
#: Private attributes kerasdist sets on objects itself (its own state, not Keras's) start with this.
OWN_PRIVATE_PREFIX = "_kerasdist"
#: Public functions with a leading underscore (the standard library's, documented as public).
PUBLIC_UNDERSCORE_CALLS = {("os", "_exit")}


def _sources(*folders):
    for folder in folders:
        yield from sorted(pathlib.Path(ROOT, folder).rglob("*.py"))


def _imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:  # `from kerasdist import _keras_internals`
                yield node.lineno, f"{node.module}.{alias.name}"


def private_api_uses(path):
    """``[(line, what)]``: private Keras/TF modules and private attributes of objects kerasdist does not own."""
    tree = ast.parse(pathlib.Path(path).read_text(), filename=str(path))
    found = [(line, f"import {name}") for line, name in _imported_modules(tree)
             if any(name == m or name.startswith(m + ".") for m in PRIVATE_MODULES)]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if node.attr.startswith(OWN_PRIVATE_PREFIX):
            continue
        owner = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if (owner, node.attr) in PUBLIC_UNDERSCORE_CALLS:
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def non_public_kerasdist_imports(path):
    tree = ast.parse(pathlib.Path(path).read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "kerasdist" else [
                f"kerasdist.{a.name}" for a in node.names if a.name.startswith("_") or _is_submodule(a.name)]
        else:
            continue
        bad += [(node.lineno, name) for name in names
                if (name == "kerasdist" or name.startswith("kerasdist.")) and name not in PUBLIC_KERASDIST]
    return bad


def _is_submodule(name):
    return pathlib.Path(ROOT, "kerasdist", name + ".py").exists() and f"kerasdist.{name}" not in PUBLIC_KERASDIST


@pytest.mark.parametrize("path", [p for p in _sources("kerasdist", "plugins") if INTERNALS not in p.parents],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_private_keras_and_tensorflow_api_only_in_the_internals_module(path):
    uses = private_api_uses(path)
    assert not uses, (f"{path.relative_to(ROOT)} uses private Keras/TF API {uses}; move it into "
                      "kerasdist/_keras_internals/ (with a test in tests/test_keras_internals*.py) and expose "
                      "what plugins need through kerasdist.plugin_tools.")


@pytest.mark.parametrize("path", list(_sources("plugins")), ids=lambda p: str(p.relative_to(ROOT)))
def test_built_in_plugins_import_only_the_public_api(path):
    bad = non_public_kerasdist_imports(path)
    assert not bad, (f"{path.relative_to(ROOT)} imports {bad}; a built-in plugin may import only "
                     f"{', '.join(PUBLIC_KERASDIST)} (what a third-party plugin can rely on).")


def test_the_checks_catch_planted_violations(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from keras.src import tree\n"
        "import tensorflow.python.eager.context\n"
        "from kerasdist import _keras_internals\n"
        "from kerasdist.session import session_of\n"
        "import kerasdist.devices\n"
        "def f(model, opt):\n"
        "    return model._distribute_strategy, opt._trainable_variables\n")
    uses = [what for _, what in private_api_uses(planted)]
    assert "import keras.src" in uses and "import tensorflow.python.eager.context" in uses
    assert "model._distribute_strategy" in uses and "opt._trainable_variables" in uses
    imports = [name for _, name in non_public_kerasdist_imports(planted)]
    assert set(imports) == {"kerasdist._keras_internals", "kerasdist.session", "kerasdist.devices"}
    clean = tmp_path / "clean.py"
    clean.write_text("import kerasdist\nfrom kerasdist.plugin_tools import split_address\nimport keras\n"
                     "class A:\n    def f(self):\n        return self._x\n")
    assert private_api_uses(clean) == [] and non_public_kerasdist_imports(clean) == []


def test_internals_record_the_keras_versions_they_were_checked_against():
    from kerasdist import plugin_tools

    assert plugin_tools.CHECKED_KERAS_VERSIONS


# -- plugins do not import each other ------------------------------------------------------------

PLUGIN_PACKAGE = "kerasdist_plugins"
PLUGIN_DIR = pathlib.Path(ROOT, "plugins")
#: Files under plugins/ that are no plugin's: package roots and the deprecated aliases of renamed plugins.
NOT_PLUGINS = {"__init__.py", "export/__init__.py", "quantization.py", "tensorrt.py"}


def built_in_plugins():
    """``{module: entry-point name}`` of the built-in plugins (pyproject.toml's ``kerasdist`` entry points)."""
    config = tomllib.loads(pathlib.Path(ROOT, "pyproject.toml").read_text())
    return {value: name for name, value in config["project"]["entry-points"]["kerasdist"].items()}


def module_name(path):
    parts = list(pathlib.Path(path).relative_to(PLUGIN_DIR).with_suffix("").parts)
    return ".".join([PLUGIN_PACKAGE] + (parts[:-1] if parts[-1] == "__init__" else parts))


def owner(module, plugins):
    """The plugin module ``module`` belongs to (itself or a package holding it), or None."""
    return max((p for p in plugins if module == p or module.startswith(p + ".")), key=len, default=None)


def plugin_imports(source, module, is_package):
    """``[(line, module)]``: the ``kerasdist_plugins`` modules ``source`` imports, relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            # `from pkg import name` may import the module pkg.name: count both
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name == PLUGIN_PACKAGE or name.startswith(PLUGIN_PACKAGE + ".")]


def declared_public(plugin):
    """The modules a plugin lets others import: ``KERASDIST_PUBLIC_MODULES`` in its entry module."""
    relative = pathlib.Path(*plugin.split(".")[1:])
    path = PLUGIN_DIR / relative / "__init__.py" if (PLUGIN_DIR / relative).is_dir() else PLUGIN_DIR / f"{relative}.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "KERASDIST_PUBLIC_MODULES" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def cross_plugin_imports(source, module, is_package, plugins, public=declared_public):
    """``[(line, module)]``: modules of other plugins (or of none) that the plugin module ``module`` imports."""
    mine = owner(module, plugins)
    bad = []
    for line, name in plugin_imports(source, module, is_package):
        theirs = owner(name, plugins)
        if theirs == mine or (theirs is None and any(p.startswith(name + ".") for p in plugins)):
            continue  # its own modules; a package that only holds plugins (`from kerasdist_plugins import x`: x counts)
        if theirs is None or not any(name == m or name.startswith(m + ".") for m in public(theirs)):
            bad.append((line, name))
    return bad


def _plugin_files():
    return [p for p in _sources("plugins") if str(p.relative_to(PLUGIN_DIR)) not in NOT_PLUGINS]


@pytest.mark.parametrize("path", _plugin_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_built_in_plugins_do_not_import_each_other(path):
    plugins = built_in_plugins()
    module = module_name(path)
    assert owner(module, plugins), (f"{path.relative_to(ROOT)} belongs to no plugin (no entry point in pyproject.toml "
                                    "names it or a package holding it); make it part of one, or list it in NOT_PLUGINS.")
    bad = cross_plugin_imports(path.read_text(), module, path.name == "__init__.py", plugins)
    assert not bad, (f"{path.relative_to(ROOT)} (plugin {plugins[owner(module, plugins)]!r}) imports {bad}, which "
                     "belong to another plugin: ask for its work through the plan (OptimizationSpec."
                     "required_optimizations), the registry (kerasdist.export(format=...)) or kerasdist.exporting / "
                     "kerasdist.plugin_tools, or have that plugin declare the module in KERASDIST_PUBLIC_MODULES.")


def test_the_cross_plugin_check_catches_planted_imports():
    plugins = {"kerasdist_plugins.qat": "qat", "kerasdist_plugins.pruning": "pruning",
               "kerasdist_plugins.export.onnx": "onnx", "kerasdist_plugins.export.tensorrt": "tensorrt"}
    planted = ("from kerasdist_plugins import pruning\n"
               "import kerasdist_plugins.pruning.masks\n"
               "from ..pruning import Prune\n"
               "from ..export.onnx import write_onnx\n"
               "from ..quantization import run_litert\n"
               "from . import graph\n"
               "from .layers import make_quantization_aware\n"
               "from kerasdist_plugins.qat import quantizers\n")
    bad = [name for _, name in cross_plugin_imports(planted, "kerasdist_plugins.qat.recipes", False, plugins,
                                                    public=lambda plugin: set())]
    assert bad == ["kerasdist_plugins.pruning", "kerasdist_plugins.pruning.masks", "kerasdist_plugins.pruning",
                   "kerasdist_plugins.pruning.Prune", "kerasdist_plugins.export.onnx",
                   "kerasdist_plugins.export.onnx.write_onnx", "kerasdist_plugins.quantization",
                   "kerasdist_plugins.quantization.run_litert"]
    declared = cross_plugin_imports("from ..export.onnx import write_onnx\n", "kerasdist_plugins.export.tensorrt",
                                    False, plugins, public=lambda plugin: {"kerasdist_plugins.export.onnx"})
    assert declared == []  # a module its plugin declares public may be imported


def test_the_built_in_plugins_are_the_entry_points():
    plugins = built_in_plugins()
    assert {"kerasdist_plugins.export.litert", "kerasdist_plugins.export.onnx", "kerasdist_plugins.export.tensorrt",
            "kerasdist_plugins.qat", "kerasdist_plugins.pruning"} <= set(plugins)
    assert not any(owner(module_name(PLUGIN_DIR / name), plugins) for name in NOT_PLUGINS)
