"""Fails loudly when a Keras release changes the private attributes kerasdist relies on (the version table: in
tests/test_keras_internals.py): what central_storage, mirrored's collectives, the strategy-free step, Keras's metric
state and the torch plugins (data_parallel's trainer pieces, fsdp's implicit replication) need.
"""

import keras
import numpy as np
import tensorflow as tf

from kerasdist import _keras_internals as internals
from kerasdist._keras_internals import versions
from kerasdist._keras_internals.training import keras_step_order_is_known


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
