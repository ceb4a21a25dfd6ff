"""Fails loudly when a Keras release changes the private attributes kerasdist relies on (the version table: in
tests/test_keras_internals.py): what the multi-worker and parameter-server plugins need of Keras's TensorFlow
trainer, gradient all-reduce, loss scaling, BatchNormalization and the TFLite converter.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdist import _keras_internals as internals
from kerasdist._keras_internals import multiworker_fit, versions


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
