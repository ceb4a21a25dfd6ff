"""One test per hook specification: each is called by the core as documented.

tests/test_docs.py checks that this file has a ``test_hook_<name>`` for every hook.
"""

import dataclasses
import textwrap
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist
import kerasdist_plugins.mirrored
from tests.helpers import child_env, python, run, write_plugin_distribution


@dataclasses.dataclass
class Record(kerasdist.OptimizationSpec):
    tag: str = "r"


class Recorder:
    """Implements every hook and records how it was called."""

    def __init__(self):
        self.calls = []

    def _seen(self, hook, **info):
        self.calls.append((hook, info))

    def called(self, hook):
        return [info for name, info in self.calls if name == hook]

    @kerasdist.hookimpl
    def kerasdist_register_strategies(self, register):
        self._seen("kerasdist_register_strategies")

    @kerasdist.hookimpl
    def kerasdist_register_optimizations(self, register):
        register("record", Record, description="records hook calls", backends=())
        self._seen("kerasdist_register_optimizations")

    @kerasdist.hookimpl
    def kerasdist_register_exporters(self, register):
        def export_npz(model, filepath, compress=False):
            (np.savez_compressed if compress else np.savez)(filepath, *[w.numpy() for w in model.weights])
            return filepath
        register("npz", export_npz, description="weights as .npz", backends=())
        register("npz-compressed", export_npz, backends=(), compress=True)  # a preset option
        self._seen("kerasdist_register_exporters")

    @kerasdist.hookimpl
    def kerasdist_detect_cluster(self, environ):
        self._seen("kerasdist_detect_cluster", environ=environ)
        if environ.get("RECORDER_CLUSTER"):
            return kerasdist.ClusterInfo(cluster={"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, source="recorder")

    @kerasdist.hookimpl(tryfirst=True)
    def kerasdist_auto_strategy(self, cluster):
        self._seen("kerasdist_auto_strategy", cluster=cluster)
        return "mirrored" if cluster.source == "recorder" else None

    @kerasdist.hookimpl(hookwrapper=True)
    def kerasdist_create_strategy(self, spec, cluster):
        outcome = yield
        self._seen("kerasdist_create_strategy", spec=spec, strategy=outcome.get_result())

    @kerasdist.hookimpl
    def kerasdist_prepare_model(self, model, strategy, spec):
        self._seen("kerasdist_prepare_model", spec=spec, strategy=strategy,
                   moved=all(isinstance(v.value, tf.distribute.DistributedValues) for v in model.weights),
                   in_scope=tf.distribute.get_strategy() is strategy)

    @kerasdist.hookimpl
    def kerasdist_adjust_compile(self, compile_kwargs, spec):
        if isinstance(spec, Record):
            compile_kwargs["metrics"] = list(compile_kwargs.get("metrics") or []) + ["mae"]
        self._seen("kerasdist_adjust_compile", spec=spec, keys=sorted(compile_kwargs))

    @kerasdist.hookimpl
    def kerasdist_prepare_dataset(self, dataset, kind, method, spec):
        self._seen("kerasdist_prepare_dataset", method=method, spec=spec, kind=kind)
        if isinstance(spec, Record) and method == "fit" and kind == "tf.data":
            return dataset.take(2)

    @kerasdist.hookimpl
    def kerasdist_adjust_call(self, method, call_kwargs, spec):
        if isinstance(spec, Record) and method == "fit":
            call_kwargs["callbacks"].append(keras.callbacks.History())
        self._seen("kerasdist_adjust_call", method=method, spec=spec, kwargs=dict(call_kwargs))

    @kerasdist.hookimpl
    def kerasdist_run_call(self, method, call, call_kwargs, spec):
        self._seen("kerasdist_run_call", method=method, spec=spec)
        if isinstance(spec, Record) and method == "evaluate":
            return {"evaluated_by": "recorder", "result": call(**call_kwargs)}

    @kerasdist.hookimpl
    def kerasdist_process_start(self, cluster, environ):
        self._seen("kerasdist_process_start", cluster=cluster)


@pytest.fixture
def recorder(fresh_system):
    fresh_system.add_plugin(kerasdist_plugins.mirrored, name="mirrored")
    plugin = Recorder()
    fresh_system.add_plugin(plugin, name="recorder")
    return plugin


def _compiled(recorder, distribute=("mirrored", "record")):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd", distribute=list(distribute))
    return model


def _dataset():
    return tf.data.Dataset.from_tensor_slices((np.ones((32, 4), "float32"), np.ones((32, 1), "float32"))).batch(4)


def test_hook_kerasdist_register_strategies(recorder, fresh_system):
    assert recorder.called("kerasdist_register_strategies") == [{}]
    assert fresh_system.registry.get("mirrored").plugin == "mirrored"


def test_hook_kerasdist_register_optimizations(recorder, fresh_system):
    entry = fresh_system.registry.get("record")
    assert entry.kind == "optimization" and entry.plugin == "recorder"
    assert kerasdist.record(tag="x") == Record(tag="x")


def test_hook_kerasdist_register_exporters(recorder, tmp_path):
    model = _compiled(recorder)
    path = kerasdist.export(model, str(tmp_path / "w.npz"), format="npz", compress=True)
    assert len(np.load(path).files) == len(model.weights)
    preset = kerasdist.export(model, str(tmp_path / "c.npz"), format="npz-compressed")
    assert zipfile.ZipFile(preset).infolist()[0].compress_type == zipfile.ZIP_DEFLATED
    with pytest.raises(kerasdist.UnknownPluginError, match=r"export format 'nope' for kerasdist.export\(format=...\).*npz"):
        kerasdist.export(model, str(tmp_path / "w"), format="nope")


def test_hook_kerasdist_detect_cluster(recorder, fresh_system):
    assert kerasdist.detect_cluster().is_local
    fresh_system.environ = {"RECORDER_CLUSTER": "1"}
    cluster = kerasdist.detect_cluster()
    assert cluster.source == "recorder" and cluster.num_workers == 2


def test_hook_kerasdist_auto_strategy(recorder, fresh_system):
    fresh_system.environ = {"RECORDER_CLUSTER": "1"}
    model = _compiled(recorder, distribute=["auto"])
    assert recorder.called("kerasdist_auto_strategy")[-1]["cluster"].source == "recorder"
    assert isinstance(model.distribute_strategy, tf.distribute.MirroredStrategy)


def test_hook_kerasdist_create_strategy(recorder):
    spec = kerasdist.mirrored(devices=["/cpu:1"])  # a strategy no other test created
    model = _compiled(recorder, distribute=[spec])
    created = recorder.called("kerasdist_create_strategy")
    assert len(created) == 1 and created[0]["spec"] == spec
    assert created[0]["strategy"] is model.distribute_strategy
    again = _compiled(recorder, distribute=[kerasdist.mirrored(devices=["/device:CPU:1"])])  # the same device
    assert len(recorder.called("kerasdist_create_strategy")) == 1  # once per distinct spec per process
    assert again.distribute_strategy is model.distribute_strategy


def test_hook_kerasdist_prepare_model(recorder):
    _compiled(recorder)
    calls = recorder.called("kerasdist_prepare_model")
    assert [c["spec"].name for c in calls] == ["mirrored", "record"]  # strategy first, then optimizations
    assert all(c["moved"] and c["in_scope"] for c in calls)


def test_hook_kerasdist_adjust_compile(recorder):
    model = _compiled(recorder)
    assert "optimizer" in recorder.called("kerasdist_adjust_compile")[0]["keys"]
    history = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    assert "mae" in history.history  # the metric the hook added reached Keras's compile


def test_hook_kerasdist_prepare_dataset(recorder):
    model = _compiled(recorder)
    model.fit(_dataset(), verbose=0)
    assert {c["method"] for c in recorder.called("kerasdist_prepare_dataset")} == {"fit"}
    assert int(model.optimizer.iterations.numpy()) == 2  # the hook's dataset.take(2) was used
    model.predict(np.ones((4, 4)), verbose=0)  # numpy input: no dataset hook
    assert {c["method"] for c in recorder.called("kerasdist_prepare_dataset")} == {"fit"}
    model.fit(_dataset(), validation_data=_dataset(), verbose=0)  # validation Dataset: method "evaluate"
    assert [c["method"] for c in recorder.called("kerasdist_prepare_dataset")][-4:] == [
        "fit", "fit", "evaluate", "evaluate"]
    assert {c["kind"] for c in recorder.called("kerasdist_prepare_dataset")} == {"tf.data"}


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return np.ones((4, 4), "float32"), np.ones((4, 1), "float32")


def _generator():
    while True:
        yield np.ones((4, 4), "float32"), np.ones((4, 1), "float32")


def _loader():
    torch = pytest.importorskip("torch")
    data = torch.utils.data.TensorDataset(torch.ones(8, 4), torch.ones(8, 1))
    return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.parametrize("make,kind", [(_Batches, "py_dataset"), (_generator, "generator"),
                                       (_loader, "torch_dataloader")])
def test_hook_kerasdist_prepare_dataset_sees_every_input_holding_whole_batches(recorder, make, kind):
    """A PyDataset or a generator is passed with its kind (x, and fit's validation_data); a
    replacement the hook returns is what Keras trains on; in-memory arrays are not passed."""
    model = _compiled(recorder)
    replaced = []

    class Replacer:
        @kerasdist.hookimpl(tryfirst=True)
        def kerasdist_prepare_dataset(self, dataset, kind, method):
            if kind != "tf.data" and method == "fit":
                replaced.append(kind)
                return _dataset().take(3)

    kerasdist.register_plugin(Replacer(), name="replacer")
    # a generator as validation_data is refused under mirrored (test_mirrored.py): a PyDataset validates then
    validation, validation_kind = (_Batches(), "py_dataset") if kind == "generator" else (make(), kind)
    model.fit(make(), steps_per_epoch=2, validation_data=validation, validation_steps=1, verbose=0)
    seen = [(c["kind"], c["method"]) for c in recorder.called("kerasdist_prepare_dataset")]
    # x: the replacer (first) for the strategy's spec, then the next spec gets its tf.data replacement
    assert replaced == [kind] and seen == [("tf.data", "fit"), (validation_kind, "evaluate"),
                                           (validation_kind, "evaluate")]
    assert int(model.optimizer.iterations.numpy()) == 2  # the record spec's take(2) of the replacement
    model.fit(np.ones((8, 4)), np.ones((8, 1)), validation_data=(np.ones((4, 4)), np.ones((4, 1))), verbose=0)
    assert len(recorder.called("kerasdist_prepare_dataset")) == 3 and replaced == [kind]


def test_hook_kerasdist_adjust_call(recorder):
    model = _compiled(recorder)
    user_callback = keras.callbacks.History()
    model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0, callbacks=[user_callback])
    fit_call = [c for c in recorder.called("kerasdist_adjust_call") if c["method"] == "fit"][-1]
    assert fit_call["kwargs"]["callbacks"][0] is user_callback and len(fit_call["kwargs"]["callbacks"]) == 2
    model.predict(np.ones((4, 4)), verbose=0)
    assert "predict" in {c["method"] for c in recorder.called("kerasdist_adjust_call")}


def test_hook_kerasdist_run_call(recorder):
    model = _compiled(recorder)
    result = model.evaluate(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    assert result["evaluated_by"] == "recorder" and len(result["result"]) == 2
    assert model.predict(np.ones((4, 4)), verbose=0).shape == (4, 1)  # None: Keras's own predict ran


def test_hook_kerasdist_job_identity(fresh_system, tmp_path, monkeypatch):
    from kerasdist.plugin_tools import private_backups

    class StableRun:
        @kerasdist.hookimpl
        def kerasdist_job_identity(self, identity):
            identity["arguments"] = ["a-run-kept-across-retries"]

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    strategy = tf.distribute.get_strategy()
    spec = kerasdist_plugins.mirrored.Mirrored()
    spec.backup_dir = None  # what backup_folder reads of a spec
    monkeypatch.setenv(private_backups.BACKUP_DIR_VAR, str(tmp_path))
    monkeypatch.setattr("sys.argv", ["train.py", "--worker-id", "1"])
    first = private_backups.job_identity(model, strategy)
    fresh_system.add_plugin(StableRun(), name="stable_run")
    retried = private_backups.job_identity(model, strategy)
    monkeypatch.setattr("sys.argv", ["train.py", "--worker-id", "2"])  # a retry's new command line
    assert private_backups.job_identity(model, strategy) == retried
    assert first["arguments"] == ["--worker-id", "1"] and retried["arguments"] == ["a-run-kept-across-retries"]
    assert private_backups.backup_folder(spec, retried, 0) != private_backups.backup_folder(spec, first, 0)


def test_hook_kerasdist_process_start(tmp_path):
    source = textwrap.dedent("""
        import kerasdist

        @kerasdist.hookimpl
        def kerasdist_detect_cluster(environ):
            if environ.get("KERASDIST_CLUSTER") == "recorder":
                return kerasdist.ClusterInfo(task_index=1, cluster={"worker": ["a:1", "b:2"]}, source="recorder")

        @kerasdist.hookimpl
        def kerasdist_process_start(cluster, environ):
            import tensorflow as tf
            print("PROCESS_START", cluster.source, cluster.task_index, tf.executing_eagerly())
    """)
    write_plugin_distribution(str(tmp_path), "recorder-plugin", source, {"recorder": "recorder_plugin"})
    code = "import kerasdist; print('IMPORTED')"
    out = run(python("-c", code), timeout=120,
              env=child_env(PYTHONPATH=str(tmp_path), KERASDIST_CLUSTER="recorder")).stdout
    assert "PROCESS_START recorder 1 True" in out and out.index("PROCESS_START") < out.index("IMPORTED")
    out = run(python("-c", code), timeout=120, env=child_env(PYTHONPATH=str(tmp_path))).stdout
    assert "PROCESS_START" not in out


def test_hook_kerasdist_keras_imported(tmp_path):
    """Called once when Keras is imported after kerasdist, and at once when Keras already was."""
    source = textwrap.dedent("""
        import kerasdist

        @kerasdist.hookimpl
        def kerasdist_keras_imported(keras):
            print("KERAS_IMPORTED", keras.__name__, hasattr(keras, "layers"))
    """)
    write_plugin_distribution(str(tmp_path), "keras-recorder", source, {"keras_recorder": "keras_recorder"})
    for code in ("import kerasdist; print('KERASDIST'); import keras; import keras",
                 "import keras; print('KERASDIST'); import kerasdist"):
        out = run(python("-c", code), timeout=120, env=child_env(PYTHONPATH=str(tmp_path))).stdout
        assert out.count("KERAS_IMPORTED keras True") == 1, out
        assert out.index("KERASDIST") < out.index("KERAS_IMPORTED")


def test_hook_kerasdist_keras_imported_is_historic(fresh_system):
    """Keras is imported in this process already: a plugin registered now hears it at registration,
    once; a plugin failing there is refused, naming the hook."""
    heard = []

    class Late:
        @kerasdist.hookimpl
        def kerasdist_keras_imported(self, keras):
            heard.append(keras)

    class Broken:
        @kerasdist.hookimpl
        def kerasdist_keras_imported(self, keras):
            raise RuntimeError("no")

    kerasdist.register_plugin(Late(), name="late")
    assert heard == [keras]
    kerasdist.register_plugin(Recorder(), name="recorder")  # no kerasdist_keras_imported: nothing re-runs
    assert heard == [keras]
    with pytest.raises(kerasdist.PluginValidationError, match="'broken' failed in kerasdist_keras_imported"):
        kerasdist.register_plugin(Broken(), name="broken")
    assert "broken" not in dict(fresh_system.pm.list_name_plugin())


def test_kerasdist_command_never_runs_process_start(tmp_path):
    source = textwrap.dedent("""
        import kerasdist

        @kerasdist.hookimpl
        def kerasdist_detect_cluster(environ):
            return kerasdist.ClusterInfo(cluster={"worker": ["a:1", "b:2"]}, source="recorder")

        @kerasdist.hookimpl
        def kerasdist_process_start(cluster, environ):
            print("PROCESS_START")
    """)
    write_plugin_distribution(str(tmp_path), "recorder-plugin", source, {"recorder": "recorder_plugin"})
    env = child_env(PYTHONPATH=str(tmp_path), KERASDIST_CLUSTER="1")
    assert "PROCESS_START" in run(python("-c", "import kerasdist"), timeout=120, env=env).stdout
    assert "PROCESS_START" not in run(python("-m", "kerasdist.cli", "env"), timeout=120, env=env).stdout
    env["KERASDIST_PROCESS_START"] = "0"
    assert "PROCESS_START" not in run(python("-c", "import kerasdist"), timeout=120, env=env).stdout


class LaunchPlugin:
    """Adds a launch option and an environment variable per worker."""

    @kerasdist.hookimpl
    def kerasdist_add_launch_arguments(self, parser):
        parser.add_argument("--color", default=None, help="a colour for every worker")

    @kerasdist.hookimpl
    def kerasdist_launch_environment(self, args, worker, environ):
        environ["COLOR"] = f"{args.color}-{worker.index}-of-{worker.count}@{worker.address}"


def test_hook_kerasdist_add_launch_arguments(fresh_system, capsys):
    from kerasdist import cli

    fresh_system.add_plugin(LaunchPlugin(), name="launch-plugin")
    assert cli.build_parser().parse_args(["launch", "-n", "2", "--color", "red", "x.py"]).color == "red"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["launch", "--help"])
    help_text = capsys.readouterr().out
    assert "options of the launch-plugin plugin" in help_text and "--color" in help_text


def test_hook_kerasdist_launch_environment(fresh_system):
    from kerasdist import cli, launch

    fresh_system.add_plugin(LaunchPlugin(), name="launch-plugin")
    args = cli.build_parser().parse_args(["launch", "-n", "2", "--color", "red", "x.py"])
    environs = launch.worker_environments(args, environ={"KERASDIST_CLUSTER": "x", "PATH": "/bin"})
    colors = [env["COLOR"] for env in environs]
    assert colors[0].startswith("red-0-of-2@127.0.0.1:") and colors[1].startswith("red-1-of-2@127.0.0.1:")
    assert all("KERASDIST_CLUSTER" not in env and env["PATH"] == "/bin" for env in environs)


def test_hook_kerasdist_listeners(fresh_system, capsys, monkeypatch):
    from kerasdist import cli

    class Listens:
        @kerasdist.hookimpl
        def kerasdist_listeners(self, cluster):
            return [{"what": f"a test server of {cluster.source}", "address": "127.0.0.1:9", "interfaces": "the address's"}]

    class Silent:
        @kerasdist.hookimpl
        def kerasdist_listeners(self, cluster):
            return None

    fresh_system.add_plugin(Listens(), name="listens")
    fresh_system.add_plugin(Silent(), name="silent")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "listens:\n  127.0.0.1:9  (the address's interfaces)  a test server of local" in out
