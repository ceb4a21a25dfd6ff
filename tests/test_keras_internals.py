"""Fails loudly when a Keras release changes the private attributes kerasdist relies on.

Everything checked here is used only in kerasdist/_keras_internals/. Where each piece lives per Keras
version is kerasdist/_keras_internals/versions.py: one test per piece and Keras line below (the rows of
the Keras this runs under run, the others skip); the behaviour kerasdist needs from them follows.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdist import KerasdistError
from kerasdist import _keras_internals as internals
from kerasdist._keras_internals import multiworker_fit, strategy_binding, versions
from kerasdist._keras_internals.training import keras_step_order_is_known


def test_running_keras_is_a_checked_version():
    assert internals.keras_version_checked(), (
        f"Keras {keras.__version__} is not among {internals.CHECKED_KERAS_VERSIONS}: re-check every private "
        "attribute in kerasdist/_keras_internals/ against it, run this file, then add the version.")
    assert versions.keras_line() is not None, (
        f"Keras {keras.__version__} is on no line of versions.KERAS_LINES: add a column for it to the tables")


def test_checked_versions_name_lines_and_exact_nightlies():
    assert versions.keras_version_checked("3.15.1") and versions.keras_version_checked("3.16.0.dev2026102704")
    assert not versions.keras_version_checked("3.16.0") and not versions.keras_version_checked("3.16.0.dev2026110100")
    assert versions.keras_line("3.15.1") == "3.15" and versions.keras_line("3.16.0.dev2026110100") == "3.16.0.dev"
    assert versions.keras_line("3.16.0") is None and versions.keras_line("3.1.5") is None


def test_every_piece_has_a_location_on_every_keras_line():
    for name, piece in versions.PIECES.items():
        assert set(piece.where) == set(versions.KERAS_LINES), name
        assert piece.needed_by in ("tf", "multiworker", "central_storage", "horovod", "jax", "step_order", "torch",
                                    "py_dataset_order"), name
    for name, where in versions.INSTANCE_ATTRIBUTES.items():
        assert set(where) == set(versions.KERAS_LINES), name


def _on_this_keras(line):
    if versions.keras_line() != line:
        pytest.skip(f"a Keras {line} row; this is Keras {keras.__version__}")


@pytest.mark.parametrize("name,line", [(n, line) for n, p in versions.PIECES.items() for line in p.where])
def test_piece_is_where_the_table_says(name, line):
    """The row's own location, not a fallback: a Keras that moved the piece fails here, naming it."""
    _on_this_keras(line)
    location = versions.PIECES[name].where[line]
    found = versions._resolve(location)
    assert found is not None, f"Keras {keras.__version__} has no {location}: update versions.PIECES[{name!r}]"
    assert callable(getattr(*found)), location


def _weight_decayed_optimizer():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.build(model.trainable_variables)
    return model, optimizer


@pytest.mark.parametrize("line", list(versions.INSTANCE_ATTRIBUTES["optimizer_weight_decay_by_key"]))
def test_optimizer_weight_decay_dict_is_keyed_like_its_variable_index(line):
    _on_this_keras(line)
    name = versions.INSTANCE_ATTRIBUTES["optimizer_weight_decay_by_key"][line]
    model, optimizer = _weight_decayed_optimizer()
    kernel, bias = model.trainable_variables
    assert optimizer._use_weight_decay(kernel) and not optimizer._use_weight_decay(bias)
    assert getattr(optimizer, name) == {optimizer._var_key(kernel): True, optimizer._var_key(bias): False}


def test_moving_a_built_optimizer_keeps_which_variables_get_weight_decay():
    """Keras 3.16 reads a dict keyed by the backing variable's id in _use_weight_decay (a KeyError once
    the variable moved, had it not been re-keyed)."""
    model, optimizer = _weight_decayed_optimizer()
    internals.move_to_strategy(model, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), optimizer)
    kernel, bias = model.trainable_variables
    assert optimizer._use_weight_decay(kernel) and not optimizer._use_weight_decay(bias)


def test_an_unchecked_keras_finds_moved_pieces_at_any_known_location(monkeypatch):
    monkeypatch.setattr(versions, "_keras_version", lambda: "3.99.0")
    assert versions.missing() == []
    assert versions.locate("tf_variable") in keras.Variable.__mro__


def test_a_keras_lacking_a_piece_is_one_error_at_compile_naming_the_version(monkeypatch):
    monkeypatch.setattr(versions, "_keras_version", lambda: "3.99.0")
    gone = versions.Piece("Variable._initialize", "tf", {line: "keras.src.gone:Variable._initialize"
                                                         for line in versions.KERAS_LINES})
    monkeypatch.setitem(versions.PIECES, "tf_variable_initialize", gone)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(KerasdistError) as caught:
        model.compile(optimizer="sgd", loss="mse", distribute="mirrored")
    message = str(caught.value)
    assert "Keras 3.99.0" in message and "keras>=3.15,<3.16" in message and "tf_variable_initialize" in message
    assert "keras.src.gone:Variable._initialize" in message


def test_multiworker_fixes_patch_nothing_on_a_keras_lacking_a_piece(monkeypatch):
    """At ``import kerasdist`` in a worker: no error there (compile raises it), and Keras left as it is."""
    installed = bool(multiworker_fit._patches())
    internals.uninstall_multiworker_fit_fixes()
    try:
        monkeypatch.setattr(versions, "_keras_version", lambda: "3.99.0")
        monkeypatch.setitem(versions.PIECES, "tf_reduce_per_replica", versions.Piece(
            "reduce", "multiworker", {line: "keras.src.gone:reduce" for line in versions.KERAS_LINES}))
        trainer, build = versions.owner_of("tf_trainer_build")
        original = getattr(trainer, build)
        assert internals.install_multiworker_fit_fixes() is False
        assert getattr(trainer, build) is original and not multiworker_fit._patches()
        with pytest.raises(KerasdistError, match="3.99.0.*tf_reduce_per_replica"):
            versions.require(*versions.pieces_needed_by("multiworker"))
    finally:
        monkeypatch.undo()
        if installed:
            internals.install_multiworker_fit_fixes()


def _model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization(),
                             keras.layers.Dropout(0.5)])


def test_model_records_strategy_at_construction():
    assert internals.bound_strategy(_model()) is None
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        assert internals.bound_strategy(_model()) is strategy


def test_optimizer_records_strategy_and_indexes_variables_by_backing_id():
    optimizer = keras.optimizers.SGD()
    assert internals.optimizer_strategy(optimizer) is tf.distribute.get_strategy()
    model = _model()
    optimizer.build(model.trainable_variables)
    keys = set(optimizer._trainable_variables_indices)
    assert keys == {v.value._unique_id for v in model.trainable_variables}
    assert optimizer._trainable_variables == model.trainable_variables


def test_variable_initialize_rebuilds_backing_value_from_a_tensor():
    variable = keras.Variable(np.ones((2,), "float32"))
    old = variable._value
    variable._initialize(tf.convert_to_tensor(old.read_value()))
    assert variable._value is not old
    variable._initialize(old)  # a tf.Variable is kept as is: why internals pass a tensor
    assert variable._value is old


def test_move_keeps_identity_and_values_and_mirrors_everything():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    model = _model()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    before = [v.numpy().copy() for v in model.variables]
    identities = [id(v) for v in model.variables]
    internals.move_to_strategy(model, strategy, optimizer)
    assert [id(v) for v in model.variables] == identities
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in model.variables)
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in optimizer.variables)
    for old, new in zip(before, model.variables):
        np.testing.assert_array_equal(old, new.numpy())
    assert internals.bound_strategy(model) is strategy
    assert internals.optimizer_strategy(optimizer) is strategy
    assert set(optimizer._trainable_variables_indices) == {
        optimizer._var_key(v) for v in model.trainable_variables}


@pytest.fixture(params=["direct", "creator stack"])
def mirroring_path(request, monkeypatch):
    """Both ways a plain MirroredStrategy's variables are made: directly (strategy_binding._DirectMirroring)
    and through TensorFlow's variable-creator stack (what every other strategy gets)."""
    if request.param == "creator stack":
        monkeypatch.setattr(strategy_binding._DirectMirroring, "for_strategy", classmethod(lambda cls, s: None))
    return request.param


def test_move_to_mirrored_reuses_each_variable_as_its_first_component_and_copies_it_once(mirroring_path):
    """MirroredStrategy's creator asks the next creator for replica 0's component first, with the initial
    value it was given, under replica 0's device, then for the others with a callable and a name ending in
    "/replica_<i>/": moving relies on it to keep the old variable as component 0 (half the work)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    model = _model()
    model.layers[0].kernel.assign(np.arange(np.prod(model.layers[0].kernel.shape), dtype="float32").reshape(
        model.layers[0].kernel.shape))
    olds = [v.value for v in model.variables]
    internals.move_to_strategy(model, strategy)
    for variable, old in zip(model.variables, olds):
        first, second = variable.value.values
        assert first is old
        assert "CPU:1" in second.device and second.name == old.name.split(":")[0] + "/replica_1:0"
        assert second.trainable == old.trainable and second.dtype == old.dtype
        np.testing.assert_array_equal(second.numpy(), old.numpy())
    model.layers[0].kernel.assign(np.zeros(model.layers[0].kernel.shape, "float32"))  # mirrored: both change
    assert not np.any(model.layers[0].kernel.value.values[1].numpy())


def _container_of(component):
    """DistributedVariable records itself on a composite component's handle, else on the component."""
    container = getattr(component.handle, "_distributed_container", None) or component._distributed_container
    return container()


def _distributed_variable_facts(distributed, strategy):
    """What TensorFlow's creator stack decides about a distributed variable, names relative to component 0's."""
    base = distributed.values[0].name.split(":")[0]
    components = [(type(c).__name__, c.name.replace(base, "<v>"), c.device, c.dtype, c.shape.as_list(),
                   c.trainable, c.synchronization, c.aggregation, c._initializer_op,
                   _container_of(c) is distributed) for c in distributed.values]
    return (type(distributed).__name__, distributed.aggregation, distributed.synchronization, distributed.trainable,
            distributed._distribute_strategy is strategy, distributed._common_name == base,
            distributed._packed_var, getattr(distributed, "_policy", None), components)


def test_direct_mirroring_makes_what_tensorflows_creator_stack_makes(monkeypatch):
    """Under a plain MirroredStrategy the variables are wrapped without TensorFlow's creator stack, relying on
    MirroredExtended (exact type), its _devices and _use_var_policy, distribute_utils.VARIABLE_CLASS_MAPPING
    and eager no_op returning None: a TensorFlow that changes any of them makes a difference here. Trainable,
    batch-norm (aggregation mean) and metric (on-read, sum) variables."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy_binding._DirectMirroring.for_strategy(strategy) is not None
    assert strategy_binding._DirectMirroring.for_strategy(tf.distribute.OneDeviceStrategy("/cpu:0")) is None

    def moved():
        model, metric = _model(), keras.metrics.Mean()
        variables = list(model.variables) + list(metric.variables)
        before = [v.numpy().copy() for v in variables]
        strategy_binding._move_variables(variables, strategy)
        for value, variable in zip(before, variables):
            for component in variable.value.values:
                np.testing.assert_array_equal(component.numpy(), value)
        return [v.value for v in variables]

    left_to_tensorflow = []
    move_all = strategy_binding._DirectMirroring.move_all
    monkeypatch.setattr(strategy_binding._DirectMirroring, "move_all",
                        lambda self, variables: left_to_tensorflow.extend(move_all(self, variables)) or [])
    direct = moved()
    assert left_to_tensorflow == []  # the direct path made every one
    monkeypatch.setattr(strategy_binding._DirectMirroring, "for_strategy", classmethod(lambda cls, s: None))
    through_tensorflow = moved()
    assert {type(d).__name__ for d in direct} == {"MirroredVariable", "SyncOnReadVariable"}
    assert ([_distributed_variable_facts(d, strategy) for d in direct]
            == [_distributed_variable_facts(d, strategy) for d in through_tensorflow])
    with strategy.scope():  # pure TensorFlow: the same attributes on the wrapper and on a copy (whose
        # container TensorFlow records on a ResourceVariable's handle, on the component itself on a copy)
        references = {type(r).__name__: r for r in (tf.Variable(0.0), tf.Variable(
            0.0, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM))}
    for distributed in direct:
        reference = references[type(distributed).__name__]
        assert set(vars(distributed)) == set(vars(reference))
        assert set(vars(distributed.values[1])) - {"_distributed_container"} == set(vars(reference.values[1]))


def test_direct_mirroring_leaves_a_strategy_with_its_own_create_variable_to_tensorflow(monkeypatch):
    """central.assign_state_from_first_replica replaces ``extended._create_variable`` to give non-trainable
    variables ONLY_FIRST_REPLICA: the moved batch-norm statistics get it as on TensorFlow's path."""
    from kerasdist._keras_internals import central

    monkeypatch.setattr(central, "install_summed_metric_updates", lambda: None)  # the patch is not under test
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    central.assign_state_from_first_replica(strategy)
    assert strategy_binding._DirectMirroring.for_strategy(strategy) is None
    model = _model()
    internals.move_to_strategy(model, strategy)
    moving_mean = model.layers[1].moving_mean.value
    assert moving_mean.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA
    assert model.layers[0].kernel.value.aggregation == tf.VariableAggregation.NONE


def test_moved_variables_take_aggregation_and_synchronization_from_the_keras_variable(mirroring_path):
    """A Keras variable whose tf.Variable disagrees with it (built from a tf.Variable): moved, it has the
    Keras variable's aggregation and synchronization, on both paths."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    mean = keras.Variable(initializer=tf.Variable(0.0), aggregation="mean")
    on_read = keras.Variable(initializer=tf.Variable(0.0), synchronization="on_read", aggregation="sum")
    assert mean.value.aggregation == tf.VariableAggregation.NONE  # what Keras kept: the case under test
    strategy_binding._move_variables([mean, on_read], strategy)
    assert type(mean.value).__name__ == "MirroredVariable"
    assert mean.value.aggregation == tf.VariableAggregation.MEAN
    assert type(on_read.value).__name__ == "SyncOnReadVariable"
    assert on_read.value.aggregation == tf.VariableAggregation.SUM
    assert on_read.value.synchronization == tf.VariableSynchronization.ON_READ


def test_a_move_that_fails_leaves_every_variable_as_it_was(mirroring_path):
    """TensorFlow refuses an int variable with aggregation mean: the error comes out, and no variable,
    before or after that one, is left moved."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    refused = keras.Variable(initializer=tf.Variable(3), dtype="int32", aggregation="mean")
    variables = [keras.Variable(1.0), refused, keras.Variable(initializer=tf.Variable(2.0), aggregation="mean")]
    olds = [v.value for v in variables]
    with pytest.raises(ValueError, match="non-floating dtype"):
        strategy_binding._move_variables(variables, strategy)
    assert all(v.value is old for v, old in zip(variables, olds))
    assert [v.numpy() for v in variables] == [1.0, 3, 2.0]
    assert not any(hasattr(old, "_distributed_container") or hasattr(old.handle, "_distributed_container")
                   for old in olds)
    strategy_binding._move_variables(variables[::2], strategy)  # the others still move
    assert variables[0].value.values[0] is olds[0]
    assert [type(v.value).__name__ for v in variables[::2]] == ["MirroredVariable"] * 2


def test_direct_mirroring_only_for_an_eager_plain_mirrored_strategy_without_variable_policies(monkeypatch):
    """The single-worker MultiWorkerMirroredStrategy (a MirroredStrategy subclass), a graph, and variable
    policies (MirroredExtended._use_var_policy, read as is: a TensorFlow that renames it fails here) all
    go through TensorFlow's path."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy_binding._DirectMirroring.for_strategy(strategy) is not None
    assert strategy_binding._DirectMirroring.for_strategy(tf.distribute.MultiWorkerMirroredStrategy()) is None
    in_graph = []
    tf.function(lambda: in_graph.append(strategy_binding._DirectMirroring.for_strategy(strategy)) or 0)()
    assert in_graph == [None]
    monkeypatch.setattr(strategy.extended, "_use_var_policy", True)
    assert strategy_binding._DirectMirroring.for_strategy(strategy) is None


def test_direct_mirroring_leaves_a_variable_off_replica_0s_device_to_tensorflow():
    """Replica 0 on another device than the variable: no reuse, TensorFlow's path makes both components."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:1", "/cpu:0"])
    model = _model()
    olds = [(v.value, v.numpy().copy()) for v in model.variables]
    internals.move_to_strategy(model, strategy)
    for variable, (old, value) in zip(model.variables, olds):
        first, second = variable.value.values
        assert "CPU:1" in first.device and "CPU:0" in second.device and first is not old and second is not old
        np.testing.assert_array_equal(first.numpy(), value)
        np.testing.assert_array_equal(second.numpy(), value)


def test_flatten_metrics_in_order_matches_evaluate():
    """Used by the horovod plugin to return averaged evaluate() results in Keras's order."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae", "mse"])
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    flat = internals.flatten_metrics_in_order(model, logs)
    assert flat == model.evaluate(x, y, verbose=0)
    assert flat == [logs["loss"], logs["mae"], logs["mse"]]


# -- multi-worker (used by plugins/multiworker.py) ---------------------------------------

def test_multiworker_fit_fixes_replace_and_restore_keras_functions():
    trainer, _ = versions.owner_of("tf_trainer_build")
    tf_trainer, _ = versions.owner_of("tf_reduce_per_replica")  # the trainer's module
    assert trainer in keras.Model.__mro__

    installed = bool(multiworker_fit._patches())
    internals.uninstall_multiworker_fit_fixes()
    try:
        original_build, original_reduce = trainer._maybe_symbolic_build, tf_trainer.reduce_per_replica
        assert internals.install_multiworker_fit_fixes() is True
        assert trainer._maybe_symbolic_build is not original_build
        assert tf_trainer.reduce_per_replica is not original_reduce
        # Off a multi-worker strategy the patched reduce is Keras's own.
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        values = strategy.run(lambda: tf.constant([1.0, 3.0]) *
                              tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1,
                                      tf.float32))
        np.testing.assert_allclose(tf_trainer.reduce_per_replica(values, strategy, "mean").numpy(),
                                   original_reduce(values, strategy, "mean").numpy())
        assert not internals.is_multiworker_strategy(strategy)
        internals.uninstall_multiworker_fit_fixes()
        assert trainer._maybe_symbolic_build is original_build
        assert tf_trainer.reduce_per_replica is original_reduce
    finally:
        if installed:
            internals.install_multiworker_fit_fixes()


def test_tf_context_initialized_after_an_op():
    tf.constant(1.0) + 1
    assert internals.tf_context_initialized()


def test_chief_aware_backup_restores_from_one_dir_and_writes_another(tmp_path):
    shared, scratch = tmp_path / "shared", tmp_path / "scratch"
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, epochs=2, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(str(shared), delete_checkpoint=False)])
    before = open(shared / "training_metadata.json").read()
    assert '"epoch": 2' in before

    epochs = []
    restored = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    restored.compile(optimizer="sgd", loss="mse")
    callback = internals.make_chief_aware_backup(str(shared), str(scratch), delete_checkpoint=False)
    restored.fit(x, y, epochs=3, verbose=0,
                 callbacks=[callback, keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, l: epochs.append(e))])
    assert epochs == [2]  # resumed after the 2 completed epochs
    assert open(shared / "training_metadata.json").read() == before  # the shared backup is read only
    assert '"epoch": 3' in open(scratch / "training_metadata.json").read()
    assert callback.backup_dir == str(scratch)


# -- parameter-server strategy (kerasdist_plugins.ps) --------------------------------------------

def test_parameter_server_strategy_joins_the_cluster_as_the_local_job(monkeypatch):
    """The stock strategy calls ``_connect_to_cluster(coordinator_name="chief")`` from ``__init__``;
    kerasdist's subclass must turn that into "localhost" (which keeps local variables valid)."""
    from tensorflow.python.distribute import parameter_server_strategy_v2 as pss

    class Stop(Exception):
        pass

    names = []

    def fake_connect(self, coordinator_name):
        names.append(coordinator_name)
        raise Stop

    monkeypatch.setattr(pss.ParameterServerStrategyV2, "_connect_to_cluster", fake_connect)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}), rpc_layer="grpc")
    try:
        internals.parameter_server_strategy(resolver)
    except Stop:
        pass
    assert names == [internals.PS_COORDINATOR_JOB] == ["localhost"]


def test_symbolic_build_creates_metric_and_optimizer_state_from_specs():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", metrics=["mae"])
    assert not model.optimizer.built
    internals.symbolic_build(model, (tf.TensorSpec((None, 3)), tf.TensorSpec((None, 2))))
    assert model.optimizer.built and len(model.optimizer.variables) > 2  # momentum slots
    assert {v.path.split("/")[0] for v in model.metrics_variables} >= {"loss", "mean_absolute_error"}


def test_gradient_all_reduce_can_be_routed_and_restored():
    """``TFOptimizer._backend_update_step`` sums gradients through ``_all_reduce_sum_gradients`` (the
    multiworker plugin routes it to its TCP ring): a routed sum must see every dense gradient, once."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])  # one replica: the sum is the gradient itself
    x, y = np.random.RandomState(0).rand(16, 3).astype("float32"), np.zeros((16, 2), "float32")

    def train(route):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        seen = []

        def summed(tensors):
            seen.append([tuple(t.shape) for t in tensors])
            return [tf.identity(t) for t in tensors]

        if route:
            internals.route_gradient_all_reduce(model.optimizer, strategy, summed)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        return model, seen

    routed, seen = train(route=True)
    plain, not_seen = train(route=False)
    assert seen and all(shapes == [(3, 2), (2,)] for shapes in seen) and not not_seen
    for a, b in zip(routed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-7)
    internals.route_gradient_all_reduce(routed.optimizer, strategy, None)
    assert "_all_reduce_sum_gradients" not in vars(routed.optimizer)


def test_loss_scaled_gradients_are_summed_once_before_the_finite_check():
    """mixed_float16: ``LossScaleOptimizer.apply`` checks the gradients it is given for inf/NaN, then
    its inner optimizer all-reduces (``_all_reduce_sum_gradients``). Routed, the sum runs once, in the
    loss-scale optimizer's ``apply``: an inf from the sum alone (another worker's overflow) skips the step."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    x, y = np.random.RandomState(0).rand(16, 3).astype("float32"), np.zeros((16, 2), "float32")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    before = [w.copy() for w in model.get_weights()]
    calls = []

    def summed(tensors):  # as if another worker's gradients had overflowed
        calls.append(len(tensors))
        return [t + float("inf") for t in tensors]

    assert hasattr(model.optimizer, "inner_optimizer")  # Keras wrapped SGD in its LossScaleOptimizer
    internals.route_gradient_all_reduce(model.optimizer, strategy, summed)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert len(calls) == 1, calls  # traced once, in the outer apply; the inner optimizer does not sum again
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)  # both steps skipped
    assert float(model.optimizer.dynamic_scale.numpy()) == 32768.0 / 4
    internals.route_gradient_all_reduce(model.optimizer, strategy, None)
    assert "apply" not in vars(model.optimizer) and "_all_reduce_sum_gradients" not in vars(model.optimizer)


def test_log_summer_replaces_the_per_log_reduce_for_float_scalars():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    calls = []

    def summed(tensors):
        calls.append(len(tensors))
        return [t * 2 for t in tensors]  # as if two workers had the same value

    internals.set_log_summer(strategy, 2, summed)
    try:
        logs = {"loss": tf.constant(3.0), "count": tf.constant(4)}
        means = multiworker_fit._mean_over_workers(logs, strategy)
        assert calls == [1] and float(means["loss"]) == 3.0 and int(means["count"]) == 4
    finally:
        internals.set_log_summer(strategy, 0, None)
    assert id(strategy) not in multiworker_fit._log_summers()


def test_fit_still_builds_through_maybe_symbolic_build_and_scales_the_loss_with_the_optimizer():
    """weight_replicas_by_batch_share replaces Trainer._maybe_symbolic_build and relies on train_step
    calling compute_loss, then optimizer.scale_loss (Keras 3.15, 3.16)."""
    import inspect

    trainer, _ = versions.owner_of("tf_trainer_build")
    assert "self._maybe_symbolic_build(iterator=epoch_iterator)" in inspect.getsource(trainer.fit)
    step = inspect.getsource(trainer.train_step)
    assert step.index("self._compute_loss(") < step.index("self._loss_tracker.update_state(") \
        < step.index("self.optimizer.scale_loss(loss)")


def test_batch_norm_can_be_synchronized_after_construction():
    """synchronize_batch_norm walks Layer._flatten_layers and sets BatchNormalization.synchronized (Keras 3.15)."""
    import keras

    from kerasdist import _keras_internals as internals

    inner = keras.Sequential([keras.layers.BatchNormalization()])
    model = keras.Sequential([keras.Input((3,)), inner, keras.layers.BatchNormalization()])
    assert internals.synchronize_batch_norm(model) == 2
    assert all(layer.synchronized for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization))


def test_batch_norm_moments_summed_across_processes_equal_keras_own():
    """With one process, summing the sums across processes (identity) gives Keras's own moments."""
    import keras
    import numpy as np
    import tensorflow as tf

    from kerasdist import _keras_internals as internals

    layer = keras.layers.BatchNormalization()
    model = keras.Sequential([keras.Input((3,)), layer])
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 3)), tf.float32)
    expected = layer._moments(x, None)
    assert internals.synchronize_batch_norm(model, sum_across=lambda tensor, name: tensor) == 1
    for got, want in zip(layer._moments(x, None), expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6)


def test_a_layer_whose_class_changed_gets_its_training_argument_after_refresh():
    from kerasdist.plugin_tools import refresh_call_signature, state_unlocked

    class WithTraining(keras.layers.Identity):
        def call(self, inputs, training=None):
            return inputs * (2.0 if training else 1.0)

    layer = keras.layers.Identity()
    layer.build((None, 3))
    assert layer._call_has_training_arg is False  # recorded at __init__ from Identity.call
    layer.__class__ = WithTraining
    refresh_call_signature(layer)
    assert layer._call_has_training_arg is True and "training" in layer._call_signature.parameters
    x = np.ones((1, 3), "float32")
    assert float(layer(x, training=True)[0, 0]) == 2.0
    with pytest.raises(Exception, match="already built"):  # Keras locks a built layer's state
        layer.add_weight(shape=(), name="extra")
    with state_unlocked(layer):
        layer.add_weight(shape=(), name="extra")
    assert len(layer.weights) == 1 and layer._tracker.locked


def test_tflite_converter_still_has_its_per_channel_switch():
    import tensorflow as tf

    from kerasdist.plugin_tools import disable_per_channel_quantization

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    disable_per_channel_quantization(converter)
    assert converter._experimental_disable_per_channel is True


def _central_storage():
    from kerasdist.plugin_tools import local_replica_devices

    return tf.distribute.experimental.CentralStorageStrategy(local_replica_devices()[:2])


def test_central_storage_creates_variables_through_its_extended_create_variable():
    """assign_state_from_first_replica replaces StrategyExtended._create_variable on the instance, which the
    strategy's scope calls for every variable; its AggregatingVariables refuse unaggregated replica writes
    (TF 2.21)."""
    import inspect

    from tensorflow.python.distribute import distribute_lib, ps_values

    scope = inspect.getsource(distribute_lib.StrategyExtendedV2._scope)
    assert "self._create_variable(next_creator, **kwargs)" in scope
    assert "aggregation method" in ps_values.values_util.aggregation_error_msg
    strategy = _central_storage()
    internals.assign_state_from_first_replica(strategy)
    internals.assign_state_from_first_replica(strategy)  # idempotent
    with strategy.scope():
        layer = keras.layers.BatchNormalization()
        layer.build((None, 3))
        state = keras.Variable(0.0, trainable=False)
        weight = keras.Variable(0.0)
    assert isinstance(layer.moving_mean.value, ps_values.AggregatingVariable)
    assert layer.moving_mean.value.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA
    assert state.value.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA
    assert weight.value.aggregation == tf.VariableAggregation.NONE  # trainable: updated by the optimizer


def test_keras_metric_updates_are_assign_of_the_sum_and_summed_once_when_patched():
    """Keras's assign_add is ``assign(self + value)`` (Keras 3.15): on a summing AggregatingVariable the
    replicas' writes count the old value once per replica; install_summed_metric_updates patches the TF
    backend's Variable class so that each replica's increment counts once."""
    import inspect

    from kerasdist._keras_internals import central

    Variable = versions.locate("tf_variable")
    assert Variable in keras.Variable.__mro__  # keras.Variable is the TF backend's class or a subclass

    assert "self.assign(self + value)" in inspect.getsource(keras.src.backend.common.variables.Variable.assign_add)
    installed_before = bool(central._patches())  # by a cached central_storage strategy
    strategy = _central_storage()
    internals.assign_state_from_first_replica(strategy)
    assert Variable.assign_add is not central._patches()["assign_add"]
    with strategy.scope():
        metric = keras.metrics.Sum()

    @tf.function
    def step(values):
        strategy.run(lambda v: metric.update_state(v), args=(values,))

    data = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).map(lambda i: tf.cast(i, tf.float32)).batch(4))
    for batch in data:
        step(batch)
    assert float(metric.result()) == 28.0  # unpatched: 2 x 6 + 22 = 34
    if not installed_before:
        central.uninstall_summed_metric_updates()
        assert Variable.assign_add is keras.src.backend.common.variables.Variable.assign_add


def test_loss_scale_optimizer_internals_replaced_for_central_storage():
    """update_loss_scale_once_per_step replaces LossScaleOptimizer._stateful_handle_finite_grads and reads
    _overwrite_variable_with_gradient and _trainable_variables (Keras 3.15)."""
    import inspect

    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    source = inspect.getsource(LossScaleOptimizer._tf_apply)
    assert "self._stateful_handle_finite_grads" in source and "self.check_finite" in source
    assert "ops.cond(" in inspect.getsource(LossScaleOptimizer._stateful_handle_finite_grads)
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build([keras.Variable(np.zeros((2,), "float32"))])
    assert callable(optimizer._overwrite_variable_with_gradient) and len(optimizer._trainable_variables) == 1
    internals.update_loss_scale_once_per_step(optimizer)
    assert "_stateful_handle_finite_grads" in vars(optimizer) and "check_finite" in vars(optimizer)
    assert bool(optimizer.check_finite([tf.constant([1.0])])) and not bool(optimizer.check_finite([tf.constant([np.inf])]))


def test_mirrored_strategy_collective_keys_are_rebuilt_from_the_base_until_first_used():
    """keep_collectives_apart: a MirroredStrategy's group key comes from ``_collective_key_base`` through
    ``_make_collective_ops_with_fallbacks``; its all-reduce then runs under the new key; a strategy whose
    instance keys were given out (a traced collective) keeps its keys."""
    from kerasdist._keras_internals.collectives import collective_group_keys, keep_collectives_apart

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert collective_group_keys(strategy) == {1} and strategy.extended._collective_key_base == 0
    assert strategy.extended._cross_device_ops is strategy.extended._collective_ops
    assert keep_collectives_apart(strategy) and keep_collectives_apart(strategy)
    (group,) = collective_group_keys(strategy)
    assert group == strategy.extended._collective_key_base + 1 > 1
    assert strategy.extended._cross_device_ops is strategy.extended._collective_ops
    assert strategy.extended._collective_ops._collective_keys is strategy.extended._collective_keys

    @tf.function
    def all_reduce():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.ones([3])))

    np.testing.assert_array_equal(strategy.experimental_local_results(all_reduce())[1].numpy(), [2.0] * 3)
    assert any(key > 100 for key in strategy.extended._collective_keys._instance_key_table[group].values())

    used = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    used.extended._collective_keys.get_instance_key(1, used.extended.worker_devices[0])
    assert not keep_collectives_apart(used) and collective_group_keys(used) == {1}
    reduce_to_one = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                                   cross_device_ops=tf.distribute.ReductionToOneDevice())
    assert keep_collectives_apart(reduce_to_one)
    assert isinstance(reduce_to_one.extended._cross_device_ops, tf.distribute.ReductionToOneDevice)


def test_tensorflow_train_step_order_the_strategy_free_multiworker_step_relies_on():
    """training.keras_step_order_is_known on TensorFlow (multiworker's strategy-free step): Keras's own step
    computes the loss, updates the loss tracker (weighted by the rows of x), then ``apply_gradients`` (which calls
    ``apply``, wrapped per instance), then ``compute_metrics``; a replaced ``train_step`` is not Keras's own."""
    import inspect

    from keras.src.optimizers.base_optimizer import BaseOptimizer

    step = inspect.getsource(versions.locate("tf_train_step"))
    order = [step.index(piece) for piece in ("loss = self._compute_loss(", "self._loss_tracker.update_state(",
                                             "self.optimizer.apply_gradients(", "return self.compute_metrics(")]
    assert order == sorted(order), order
    assert "self.apply(grads, trainable_variables)" in inspect.getsource(BaseOptimizer.apply_gradients)
    compiled = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    compiled.compile(loss="mse", metrics=["mae"])
    assert keras_step_order_is_known(compiled)

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    assert not keras_step_order_is_known(OwnStep([keras.Input((3,)), keras.layers.Dense(1)]))
    compiled.train_step = compiled.train_step  # replaced on the instance
    assert not keras_step_order_is_known(compiled)


def test_a_mean_metrics_state_is_its_total_and_count():
    """training.mean_state (the strategy-free step sets the loss tracker to the global batch's sums)."""
    from kerasdist._keras_internals.training import mean_state

    tracker = keras.metrics.Mean(name="loss")
    tracker.update_state(np.array([2.0, 4.0]), sample_weight=np.array([1.0, 3.0]))
    total, count = mean_state(tracker)
    assert float(total.numpy()) == 14.0 and float(count.numpy()) == 4.0 and float(tracker.result()) == 3.5
    total.assign(20.0)
    assert float(tracker.result()) == 5.0
    assert mean_state(keras.metrics.MeanAbsoluteError()) is not None and mean_state(keras.metrics.AUC()) is None


def test_torch_trainer_pieces_data_parallel_on_torch_relies_on():
    """_keras_internals/torch.py and plugins/torch_distributed (in a torch process): the torch trainer's step
    scales the loss through ``optimizer.scale_loss`` and updates through ``optimizer.apply`` (both wrapped per
    instance), the loss tracker before ``apply`` and the compiled metrics (``_compile_metrics``) after it;
    ``BatchNormalization._moments``/``_reduction_axes``, replaced by summed moments, give Keras's
    own moments when the sum is over one process; Keras wraps models in DDP itself from 3.16 on; torch DTensor's
    ``_allow_implicit_replication`` flag, which fsdp's nestable implicit replication sets and restores."""
    import subprocess
    import sys

    code = """
import inspect, numpy as np, torch, keras
from kerasdist._keras_internals.torch import compiled_metrics, keras_wraps_ddp, synchronize_torch_batch_norm
from kerasdist._keras_internals.training import keras_step_order_is_known
from kerasdist._keras_internals.versions import installed_keras_version, locate
step = inspect.getsource(locate("torch_train_step"))
assert "self.optimizer.scale_loss(loss)" in step and "self.optimizer.apply(gradients, trainable_weights)" in step
order = [step.index(piece) for piece in ("self._loss_tracker.update_state(", "self.optimizer.apply(",
                                         "return self.compute_metrics(")]
assert order == sorted(order), order  # loss tracker before apply, compiled metrics after
compiled = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
compiled.compile(loss="mse", metrics=["mae"])
assert keras_step_order_is_known(compiled) and compiled_metrics(compiled) == [compiled._compile_metrics]
plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
plain.compile(loss="mse")
assert compiled_metrics(plain) == []
metrics_step = inspect.getsource(locate("trainer_compute_metrics")).split(chr(34) * 3)[-1]  # its code: updates only these
assert "self._compile_metrics.update_state(" in metrics_step and "return self.get_metrics_result()" in metrics_step
assert metrics_step.count("update_state(") == 1, metrics_step
class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)
assert not keras_step_order_is_known(OwnStep([keras.Input((3,)), keras.layers.Dense(1)]))
assert keras_wraps_ddp() == installed_keras_version().startswith("3.16"), installed_keras_version()
model = keras.Sequential([keras.Input((5, 3)), keras.layers.BatchNormalization()])
layer = model.layers[0]
x = torch.tensor(np.random.default_rng(0).normal(size=(4, 5, 3)), dtype=torch.float32)
want = [t.numpy() for t in layer._moments(x, None)]
assert synchronize_torch_batch_norm(model, lambda t: t) == 1
got = [t.detach().numpy() for t in layer._moments(x, None)]
for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-6)
from torch.distributed.tensor import DTensor
from kerasdist._keras_internals.torch_sharding import implicitly_replicated
flag = lambda: DTensor._op_dispatcher._allow_implicit_replication
assert flag() is False
with implicitly_replicated():
    with implicitly_replicated():
        assert flag() is True
    assert flag() is True  # the outer one holds (a train step's backward pass)
assert flag() is False
print("CONTRACT OK")
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KERASDIST_")}
    env["KERAS_BACKEND"] = "torch"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "CONTRACT OK" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
