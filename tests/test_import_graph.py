"""No import cycle among kerasdist's modules, read statically from the source.

Every ``import`` statement counts, at module level and inside functions alike: a function-level import
is how a cycle is usually hidden, and it still makes the two modules depend on each other (which one
loads first then decides what works). Edges are the modules named by the statements themselves
(``from . import x`` -> ``kerasdist.x`` when ``x`` is a module, else the package); the implicit import of
a module's parent packages is not an edge (every module would otherwise depend on ``kerasdist/__init__``).
Imports inside ``if TYPE_CHECKING:`` blocks would count too (there are none).
"""

import ast
import pathlib

from helpers import ROOT

PACKAGE = "kerasdist"


def module_files(root=ROOT, package=PACKAGE):
    """``{module name: path}`` for every ``.py`` file of ``package`` under ``root``."""
    files = {}
    for path in sorted(pathlib.Path(root, package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _resolve(name, node, files):
    """The module ``name`` (from ``node``, an ImportFrom, in module ``name``) imports from."""
    if node.level == 0:
        return node.module
    is_package = files[name].name == "__init__.py"
    base = name.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(files):
    """``{module: {modules of the package it imports}}``, every import statement counted."""
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(name, node, files)
                found = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            for target in found:
                while target not in files and "." in target:  # `import kerasdist.x.y` of a name in x
                    target = target.rsplit(".", 1)[0]
                if target in files and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph):
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_kerasdist_modules():
    files = module_files()
    assert "kerasdist.plugin_tools" in files and "kerasdist._keras_internals" in files
    found = cycles(import_graph(files))
    assert not found, (f"import cycles in kerasdist/: {found}; move what both need into a lower module "
                       "that both import (as kerasdist.variables for unique_variables).")


def test_the_check_finds_planted_cycles_at_module_and_function_level(tmp_path):
    package = tmp_path / PACKAGE
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("from .low import value\n")
    (package / "low.py").write_text("value = 1\n")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .inner.c import g\n    return g\n")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "c.py").write_text("def g():\n    import kerasdist.a\n    from ..low import value\n")
    graph = import_graph(module_files(tmp_path))
    assert graph["kerasdist"] == {"kerasdist.low"} and graph["kerasdist.inner.c"] == {"kerasdist.a", "kerasdist.low"}
    assert cycles(graph) == [["kerasdist.a", "kerasdist.b", "kerasdist.inner.c"]]
    (package / "inner" / "c.py").write_text("from ..low import value\n")
    assert cycles(import_graph(module_files(tmp_path))) == []
