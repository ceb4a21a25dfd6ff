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
