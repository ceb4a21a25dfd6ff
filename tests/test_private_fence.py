"""The fence around Keras's private modules: no file of kerasdist/ or plugins/ but
kerasdist/_keras_internals/versions.py names ``keras.src`` in its code (an import, ``from keras import src``, a string
such as ``importlib.import_module("keras.src...")``, an attribute ``keras.src``, ``getattr(keras, "src")``).
Every private Keras location lives in versions.PIECES, one column per Keras line, so a Keras that moves one is
one table row to change, never an ImportError in a user's process (issue 30: a direct import of
``keras.src.trainers.trainer.Trainer`` broke every multiworker worker on the next Keras). Comments may name it."""

import ast
import contextlib
import functools
import os
import re
import shutil

import pytest

from tests.helpers import ROOT

SCANNED = ("kerasdist", "plugins")
TABLE = os.path.join("kerasdist", "_keras_internals", "versions.py")
INTERNALS = os.path.join("kerasdist", "_keras_internals") + os.sep


def _is_private_path(name):
    return name == "keras.src" or name.startswith("keras.src.")


def _keras_names(tree):
    """The names a module binds to the keras package (``import keras``, ``import keras as k``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if a.name == "keras")
    return names | {"keras"}


def _is_keras(node, names):
    """``keras`` (or an alias), ``__import__("keras")`` or ``importlib.import_module("keras")``."""
    if isinstance(node, ast.Name):
        return node.id in names
    return (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "keras")


def private_accesses(source, filename="<source>"):
    """``[(line, what)]``: each place ``source`` reaches Keras's private modules."""
    tree = ast.parse(source, filename)
    names = _keras_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _is_private_path(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _is_private_path(node.module):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == "keras" and any(a.name == "src" for a in node.names):
                found.append((node.lineno, "from keras import src"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                "keras.src" in node.value or "keras/src" in node.value):
            found.append((node.lineno, f"the string {node.value[:80]!r}"))
        elif isinstance(node, ast.Attribute) and node.attr == "src" and _is_keras(node.value, names):
            found.append((node.lineno, "the attribute keras.src"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _is_keras(node.args[0], names)
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "src"):
            found.append((node.lineno, f"{node.func.id}(keras, 'src')"))
    return sorted(set(found))


def fence_breaches(root):
    """``["path:line: what"]`` for every .py file under ``root``'s kerasdist/ and plugins/ but the table."""
    breaches = []
    for top in SCANNED:
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, root)
                if not name.endswith(".py") or relative == TABLE:
                    continue
                with open(path, encoding="utf-8") as f:
                    breaches += [f"{relative}:{line}: {what}" for line, what in private_accesses(f.read(), path)]
    return breaches


def test_no_file_but_the_version_table_reaches_keras_private_modules():
    breaches = fence_breaches(ROOT)
    assert not breaches, (
        "Keras's private modules (keras.src) are named only in kerasdist/_keras_internals/versions.py: add a "
        "row to versions.PIECES (a location per Keras line) and look it up with locate()/owner_of()/require(). "
        "Found:\n" + "\n".join(breaches))


# -- private attributes: only kerasdist/_keras_internals/ reads or replaces them --------------------------------

_DEFINED = re.compile(r"self\.(_[a-z]\w*)\s*=|def (_[a-z]\w*)\(self")


def _private_names_in(top, skip="\0"):
    names = set()
    for folder, _, files in os.walk(top):
        for name in files:
            if name.endswith(".py") and not os.path.join(folder, name).startswith(skip):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    names.update(a or b for a, b in _DEFINED.findall(f.read()))
    return names


@functools.lru_cache(maxsize=None)
def keras_private_names():
    """The private attribute and method names Keras's own classes define (``self._x = ...``, ``def _x(self``),
    less those kerasdist's own classes outside the internals define too (a plugin's ``ring._lock`` is its own)."""
    import keras

    ours = set().union(*(_private_names_in(os.path.join(ROOT, top), os.path.join(ROOT, INTERNALS)) for top in SCANNED))
    return frozenset(_private_names_in(os.path.join(os.path.dirname(keras.__file__), "src")) - ours)


def private_attribute_uses(source, names, filename="<source>"):
    """``[(line, what)]``: each ``obj._x`` (``getattr(obj, "_x")``, ...) with ``_x`` in ``names``, on anything
    but ``self``/``cls``, or on ``self`` inside a class deriving from a ``keras.`` class."""
    tree = ast.parse(source, filename)
    keras_self = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).startswith("keras.") for b in node.bases):
            keras_self.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls") and id(node) not in keras_self:
                continue
            found.append((node.lineno, f"{ast.unparse(receiver)}.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(set(found))


def private_attribute_breaches(root, names):
    breaches = []
    for top in SCANNED:
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, root)
                if name.endswith(".py") and not relative.startswith(INTERNALS):
                    with open(path, encoding="utf-8") as f:
                        breaches += [f"{relative}:{line}: {what}"
                                     for line, what in private_attribute_uses(f.read(), names, path)]
    return breaches


def test_only_the_internals_touch_keras_private_attributes():
    breaches = private_attribute_breaches(ROOT, keras_private_names())
    assert not breaches, (
        "Keras's private attributes and methods are read or replaced only in kerasdist/_keras_internals/ (a "
        "function there, with a contract test; a renamed one in versions.INSTANCE_ATTRIBUTES). Found:\n"
        + "\n".join(breaches))


@pytest.mark.parametrize("planted_line,found", [
    ("metrics = model._compile_metrics", "model._compile_metrics"),
    ("moments = getattr(layer, '_moments')", "getattr(..., '_moments')"),
    ("model.optimizer._var_key(variable)", "model.optimizer._var_key"),
])
def test_a_planted_private_attribute_use_in_a_plugin_is_found(planted_line, found):
    names = keras_private_names()
    assert private_attribute_uses(f"def planted(model, layer, variable):\n    {planted_line}\n", names) == [(2, found)]


def test_self_is_a_keras_private_only_in_a_class_deriving_from_keras():
    names = keras_private_names()
    own = "class Own:\n    def f(self):\n        return self._compile_metrics\n"
    derived = "import keras\nclass Step(keras.Model):\n    def f(self):\n        return self._compile_metrics\n"
    assert private_attribute_uses(own, names) == []
    assert private_attribute_uses(derived, names) == [(4, "self._compile_metrics")]


PLANTED = {
    "the old direct import": "from keras.src.trainers.trainer import Trainer",
    "import": "import keras.src.backend.tensorflow.trainer",
    "import as": "import keras.src.trainers.trainer as trainer_module",
    "from keras import src": "from keras import src",
    "import_module": "import importlib\ntrainer = importlib.import_module('keras.src.backend.torch.trainer')",
    "a location string": "_TORCH_TRAINER = 'keras.src.backend.torch.trainer'",
    "an f-string": "line = 'trainers'\nwhere = f'keras.src.{line}.trainer'",
    "a path": "source = 'keras/src/backend/torch/trainer.py'",
    "attribute": "import keras\nTrainer = keras.src.trainers.trainer.Trainer",
    "aliased attribute": "import keras as k\nsrc = k.src",
    "getattr": "import keras\nsrc = getattr(keras, 'src')",
    "__import__": "src = __import__('keras').src",
}


@pytest.fixture(scope="module")
def copied_tree(tmp_path_factory):
    """A copy of kerasdist/ and plugins/ (the .py files) to plant in."""
    root = tmp_path_factory.mktemp("tree")
    for top in SCANNED:
        shutil.copytree(os.path.join(ROOT, top), root / top,
                        ignore=lambda folder, names: [n for n in names if not n.endswith(".py")
                                                      and not os.path.isdir(os.path.join(folder, n))])
    return root


@contextlib.contextmanager
def planted(path, lines):
    """``path`` with a function holding ``lines`` appended; its line number first; restored after."""
    source = path.read_text()
    path.write_text(source + "\n\ndef planted():\n" + "".join(f"    {line}\n" for line in lines.splitlines()))
    try:
        yield source.count("\n") + 4
    finally:
        path.write_text(source)


def test_the_old_direct_import_planted_in_a_module_fails_the_fence(copied_tree):
    module = copied_tree / "kerasdist" / "_keras_internals" / "training.py"
    with planted(module, PLANTED["the old direct import"]) as line:
        breaches = fence_breaches(str(copied_tree))
    assert breaches == [f"kerasdist/_keras_internals/training.py:{line}: "
                        "from keras.src.trainers.trainer import ..."], breaches


@pytest.mark.parametrize("case", list(PLANTED))
def test_each_way_to_reach_the_private_modules_is_found(case):
    with open(os.path.join(ROOT, "kerasdist", "_keras_internals", "training.py"), encoding="utf-8") as f:
        source = f.read()
    assert private_accesses(source) == []
    lines = "".join(f"    {line}\n" for line in PLANTED[case].splitlines())
    found = private_accesses(f"{source}\n\ndef planted():\n{lines}")
    assert found and all(line > source.count("\n") for line, _ in found), found


def test_the_table_itself_and_comments_may_name_it(copied_tree):
    with planted(copied_tree / "plugins" / "mirrored.py", "# keras.src.backend.tensorflow.trainer: a comment\npass"):
        assert fence_breaches(str(copied_tree)) == []
    assert private_accesses((copied_tree / TABLE).read_text())  # the table is where they are
