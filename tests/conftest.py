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


_LEGACY_KERAS_AT_START = os.environ.get("TF_USE_LEGACY_KERAS")


@pytest.fixture(autouse=True)
def keras_3_stays_tf_keras():
    """A test must not leave TF_USE_LEGACY_KERAS set in this process (importing tensorflow_model_optimization
    or Ray's TensorFlow worker set-up do): every later test in the same pytest worker would get Keras 2 as tf.keras."""
    yield
    leaked = os.environ.get("TF_USE_LEGACY_KERAS")
    if leaked != _LEGACY_KERAS_AT_START:
        if _LEGACY_KERAS_AT_START is None:
            os.environ.pop("TF_USE_LEGACY_KERAS", None)
        else:
            os.environ["TF_USE_LEGACY_KERAS"] = _LEGACY_KERAS_AT_START
        pytest.fail(f"this test left TF_USE_LEGACY_KERAS={leaked!r} in the test process: later tests would get "
                    "Keras 2 as tf.keras (import tensorflow_model_optimization only in a child process)")
