import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The in-process tests use 2 logical CPU replicas; subprocess tests set their own environment.
os.environ.setdefault("KERASDIST_CPU_REPLICAS", "2")

import pytest  # noqa: E402

import kerasdist  # noqa: E402,F401  (splits the CPU before any TF op)
from kerasdist import process_state  # noqa: E402
from kerasdist.manager import PluginSystem, get_system, reset_system  # noqa: E402


@pytest.fixture
def fresh_system(monkeypatch):
    """A plugin system without entry points, installed process-wide for the test only: the process state
    (strategy cache, plugin caches) is reset before and after, so nothing the test's plugins made leaks."""
    previous = get_system()
    process_state.reset()
    system = PluginSystem(environ={}, load_entrypoints=False)
    reset_system(system)
    yield system
    process_state.reset()
    reset_system(previous)


@pytest.fixture
def system():
    return get_system()


def pytest_sessionfinish(session, exitstatus):
    """Remove the folder the child processes of this test process kept their fit backups in (tests/helpers.py)."""
    for name in ("helpers", "tests.helpers"):
        root = getattr(sys.modules.get(name), "BACKUP_ROOT", None)
        if root:
            shutil.rmtree(root, ignore_errors=True)
