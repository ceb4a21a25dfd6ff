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


#: the files that run longest (loaded wall seconds, 2026-11-27), started first: `make test` runs files on 2 xdist
#: workers in collection order (--dist loadfile), so a long file collected last ran alone at the end
LONGEST_FIRST = ("test_equivalence.py", "test_torch.py", "test_guide_words.py", "test_ray.py", "test_multiworker.py",
                 "test_multiworker_strategy_free.py", "test_slurm_real.py", "test_horovod.py", "test_jax_custom_steps.py",
                 "test_keras_nightly_gate.py", "test_fuzz.py", "test_pruning_backends.py", "test_jax.py")


#: `make test-extended` (KERASDIST_EXTENDED_TESTS=1) also runs the tests marked `extended`: multi-process runs that
#: repeat, on more processes, what an in-process test of `make test` already checks (kept out of its 25 minutes)
EXTENDED = os.environ.get("KERASDIST_EXTENDED_TESTS") == "1"


def pytest_collection_modifyitems(session, config, items):
    """Files in LONGEST_FIRST first (in that order), then the rest as collected; tests keep their order in a file.
    Tests marked `extended` are skipped unless KERASDIST_EXTENDED_TESTS=1."""
    if not EXTENDED:
        skip = pytest.mark.skip(reason="extended tier: make test-extended (KERASDIST_EXTENDED_TESTS=1)")
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(skip)
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), position[id(item)]))
