"""The contract between core and plugins, checked on the source.

- Private Keras/TensorFlow API (``keras.src``, ``tensorflow.python``, other private TF modules, and
  ``obj._private`` attributes on objects kerasdist does not own) appears only in
  kerasdist/_keras_internals/.
- Built-in plugins import only kerasdist's public API, as a third-party plugin must.
"""

import ast
import pathlib

import pytest

from helpers import ROOT

INTERNALS = pathlib.Path(ROOT, "kerasdist", "_keras_internals")  # the one module (a package) allowed
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.compiler", "tensorflow.core", "tensorflow.tsl",
                   "tf_keras.src")
#: What a plugin may import from kerasdist.
PUBLIC_KERASDIST = ("kerasdist", "kerasdist.plugin_tools")
#: Private attributes kerasdist sets on objects itself (its own state, not Keras's).
OWN_PRIVATE_ATTRIBUTES = {"_kerasdist_session", "_kerasdist_name", "_kerasdist_horovod"}
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
        if node.attr in OWN_PRIVATE_ATTRIBUTES:
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
                      "kerasdist/_keras_internals/ (with a test in tests/test_keras_internals.py) and expose "
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
