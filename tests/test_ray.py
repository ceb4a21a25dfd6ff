"""Ray Train as an engine (plugins/ray_train.py): a real local Ray (loopback only), 2 workers, one Ray session for
the module. Without a callback of the user's, each epoch's logs reach ``Result.metrics`` and rank 0's model
``Result.checkpoint``; a SIGKILLed worker's retry (``FailureConfig(max_failures=1)``) trains only the epochs
left, from kerasdist's backup keyed by the Ray run, and leaves no backup behind."""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import time

import numpy as np
import psutil
import pytest

from helpers import ROOT

if importlib.util.find_spec("ray") is None:
    pytest.skip("ray is not installed", allow_module_level=True)
pytestmark = pytest.mark.slow

# Ray turns a node address of 127.0.0.1 into the host's own unless it runs in its single-machine mode, which it
# reads once, when ray is imported: then every Ray process listens on the loopback only (docs/ray.md). Set only
# while this module imports and runs Ray (every pytest-xdist worker collects every test file).
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_only():
    """Ray imported (if not yet) and run in its single-machine mode; the variable restored after."""
    previous = os.environ.get(LOOPBACK_ONLY)
    os.environ[LOOPBACK_ONLY] = "0"
    try:
        import ray.train  # noqa: F401

        yield
    finally:
        if previous is None:
            os.environ.pop(LOOPBACK_ONLY, None)
        else:
            os.environ[LOOPBACK_ONLY] = previous


def _load_train_module():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("ray_train_fn", os.path.join(ROOT, "tests", "workers", "ray_train_fn.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_train_fn"] = module
    spec.loader.exec_module(module)
    return module


ray_train_fn = _load_train_module()

EPOCHS = 4
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """A local Ray on the loopback for the module; its session folder under a short path of its own (Ray's unix
    sockets live there: a socket path is limited to ~107 characters), removed after."""
    with contextlib.ExitStack() as stack:  # closed last: the variable restored, the session folder removed
        stack.enter_context(_loopback_only())
        import ray
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(ray_train_fn)
        folder = tmp_path_factory.mktemp("ray")
        env = {"KERASDIST_BACKUP_DIR": "", "XDG_CACHE_HOME": str(folder / "cache"),
               "KERASDIST_SCRATCH_DIR": str(folder / "scratch"), "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1",
               "RAY_TRAIN_V2_ENABLED": "1"}
        session = tempfile.mkdtemp(prefix="kdray", dir="/tmp")
        stack.callback(shutil.rmtree, session, True)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        started = []
        try:
            ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
                     log_to_driver=False, runtime_env={"env_vars": env}, _temp_dir=session)
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            yield folder, started
        finally:
            ray.shutdown()
            for process in started:  # what ray.shutdown left running, by the ids Ray started here
                try:
                    process.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass


@pytest.fixture
def ray_session(local_ray):
    """The module's Ray for one test; the backups its runs left (a run that failed keeps its backup for a
    rerun) removed after it, so that one failure does not fail the next test's own "no backup left" check."""
    yield local_ray
    shutil.rmtree(_backups_root(local_ray[0]), ignore_errors=True)


def _trainer(folder, name, backend="tensorflow", **config):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer
    from ray.train.torch import TorchTrainer

    trainer = TensorflowTrainer if backend == "tensorflow" else TorchTrainer
    out = folder / name
    out.mkdir()
    word = "multiworker" if backend == "tensorflow" else "data_parallel"
    return out, trainer(ray_train_fn.train, train_loop_config=dict(
        backend=backend, distribute=word, epochs=EPOCHS, out=str(out), **config),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(folder / "storage"),
                             failure_config=FailureConfig(max_failures=config.get("max_failures", 0))))


def _checkpoint_weights(result):
    import kerasdist

    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as folder:
        return kerasdist.load_plain(os.path.join(folder, "model.keras")).get_weights()


def _epochs_begun(out, rank):
    attempts = []
    for line in (out / f"epochs-{rank}.log").read_text().split():
        if line == "start":
            attempts.append([])
        else:
            attempts[-1].append(int(line))
    return attempts


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64")))) for x, y in zip(a, b))


def _backups_root(folder):
    return folder / "cache" / "kerasdist" / "backups"


def _backups_left(folder):
    root = _backups_root(folder)
    return sorted(os.listdir(root)) if root.exists() else []


def _listening(processes, but_ports=()):
    """The addresses ``processes`` listen on, but on ``but_ports``."""
    addresses = set()
    for process in processes:
        try:
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN and connection.laddr.port not in but_ports:
                    addresses.add(connection.laddr.ip)
        except psutil.NoSuchProcess:
            pass
    return addresses


@pytest.mark.timeout(600)
def test_ray_train_gets_metrics_and_checkpoints_and_a_retry_resumes_at_the_failed_epoch(ray_session):
    import ray

    folder, started = ray_session
    expected = ray_train_fn.one_process_weights(EPOCHS)

    out, trainer = _trainer(folder, "plain")
    began = time.monotonic()
    plain = trainer.fit()
    print(f"plain run: {time.monotonic() - began:.1f} s")
    print("plain Result.metrics:", plain.metrics, "Result.checkpoint:", plain.checkpoint)
    assert plain.error is None
    assert plain.metrics["epoch"] == EPOCHS - 1
    assert np.isfinite(plain.metrics["loss"]) and plain.metrics["loss"] < 1.0
    plain_weights = _checkpoint_weights(plain)
    assert _max_diff(plain_weights, expected) < 1e-5
    assert [_epochs_begun(out, rank) for rank in (0, 1)] == [[list(range(EPOCHS))]] * 2
    assert _backups_left(folder) == []  # removed when fit completed

    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    workers = json.loads((out / "tf_config-0.json").read_text())["cluster"]["worker"]
    assert {address.rsplit(":", 1)[0] for address in workers} == {"127.0.0.1"}
    # TensorFlow's gRPC servers bind every interface (docs/ray.md): a worker Ray has not ended yet still has one
    tensorflow_ports = {int(address.rsplit(":", 1)[1]) for address in workers}
    listening = _listening(started + psutil.Process().children(recursive=True), tensorflow_ports)
    assert listening and listening <= LOOPBACK, listening

    out, trainer = _trainer(folder, "killed", crash_epoch=2, crash_marker=str(folder / "killed.marker"),
                            max_failures=1)
    began = time.monotonic()
    retried = trainer.fit()
    print(f"killed and retried run: {time.monotonic() - began:.1f} s")
    print("retried Result.metrics:", retried.metrics, "epochs begun per attempt:", _epochs_begun(out, 0))
    assert retried.error is None
    assert os.path.exists(folder / "killed.marker")
    for rank in (0, 1):
        first, retry = _epochs_begun(out, rank)
        assert first[:2] == [0, 1] and retry == list(range(2, EPOCHS)), (rank, first, retry)
    assert retried.metrics["epoch"] == EPOCHS - 1
    assert _max_diff(_checkpoint_weights(retried), plain_weights) < 1e-6
    assert _backups_left(folder) == []


def test_outside_a_training_function_fit_reports_nothing():
    import keras

    with _loopback_only():  # ray.train imported, as in Ray's driver: ray.train.report would raise here
        pass

    x, y, kernel = ray_train_fn.data()
    model = keras.Sequential([keras.Input((ray_train_fn.FEATURES,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", distribute="mirrored")
    assert len(model.fit(x, y, epochs=2, verbose=0).history["loss"]) == 2


@pytest.mark.timeout(300)
def test_ray_torch_trainer_gets_metrics_and_the_model_from_data_parallel(ray_session):
    pytest.importorskip("torch")
    folder, _ = ray_session
    out, trainer = _trainer(folder, "torch", backend="torch")
    began = time.monotonic()
    result = trainer.fit()
    print(f"torch run: {time.monotonic() - began:.1f} s; Result.metrics:", result.metrics)
    assert result.error is None and result.metrics["epoch"] == EPOCHS - 1
    assert _max_diff(_checkpoint_weights(result), ray_train_fn.one_process_weights(EPOCHS)) < 1e-5
    assert [_epochs_begun(out, rank) for rank in (0, 1)] == [[list(range(EPOCHS))]] * 2
    assert _backups_left(folder) == []
