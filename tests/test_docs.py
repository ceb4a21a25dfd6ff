"""Every hook is documented in docs/hooks.md and has its own test in tests/test_hooks.py."""

import inspect
import os
import re

import pytest

from kerasdist import hookspecs
from tests.helpers import ROOT

HOOKS = [(name, fn) for name, fn in vars(hookspecs).items()
         if callable(fn) and hasattr(fn, "kerasdist_spec")]


def test_every_hook_is_prefixed():
    assert HOOKS and all(name.startswith("kerasdist_") for name, _ in HOOKS)


@pytest.mark.parametrize("name,fn", HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_documented_with_its_arguments(name, fn):
    text = open(os.path.join(ROOT, "docs", "hooks.md")).read()
    arguments = ", ".join(inspect.signature(fn).parameters)
    assert re.search(rf"^### {name}\({re.escape(arguments)}\)$", text, re.M), (
        f"docs/hooks.md needs a heading '### {name}({arguments})'")
    assert fn.__doc__ and fn.__doc__.strip()
    section = text[text.index(f"### {name}("):]
    section = section[:section.find("\n### ", 1) if "\n### " in section[1:] else len(section)]
    assert ("firstresult" in section) == bool(fn.kerasdist_spec["firstresult"]), (
        f"docs/hooks.md must say whether {name} is firstresult")


@pytest.mark.parametrize("name,fn", HOOKS, ids=[n for n, _ in HOOKS])
def test_hook_has_its_own_test(name, fn):
    text = open(os.path.join(ROOT, "tests", "test_hooks.py")).read()
    assert f"def test_hook_{name}(" in text
