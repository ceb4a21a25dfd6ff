"""Private Keras internals for changing a built layer in place (part of kerasdist._keras_internals)."""

import contextlib
import inspect


def refresh_call_signature(layer):
    """Make Keras re-read ``layer.call``'s signature (after its class changed): ``Layer.__init__`` records
    which call-context arguments (``training``, ``mask``) ``call`` takes in ``_call_signature``,
    ``call_signature_parameters``, ``_call_has_training_arg``, ``_call_has_mask_arg`` and
    ``_call_has_context_arg``; ``Layer.__call__`` passes ``training`` only when recorded."""
    signature = inspect.signature(layer.call)
    parameters = [p.name for p in signature.parameters.values()]
    layer._call_signature = signature
    layer.call_signature_parameters = parameters
    layer._call_has_training_arg = "training" in parameters
    layer._call_has_mask_arg = "mask" in parameters
    layer._call_has_context_arg = {arg: arg in parameters for arg in layer._call_context_args}


@contextlib.contextmanager
def state_unlocked(layer):
    """Let a built layer add variables (Keras locks a layer's ``_tracker`` when ``build`` returns)."""
    locked = layer._tracker.locked
    layer._tracker.unlock()
    try:
        yield
    finally:
        if locked:
            layer._tracker.lock()


def disable_per_channel_quantization(converter):
    """Post-training quantization with one scale per weight tensor: ``TFLiteConverter``'s
    ``_experimental_disable_per_channel`` (private; checked with TensorFlow 2.21)."""
    if not hasattr(converter, "_experimental_disable_per_channel"):
        raise AttributeError("TFLiteConverter has no _experimental_disable_per_channel: re-check "
                             "kerasdist/_keras_internals/layers.py against this TensorFlow")
    converter._experimental_disable_per_channel = True


def first_replica_assigns_unaggregated(strategy):
    """Let Keras assign its unaggregated non-trainable variables in replica context under ``strategy``.

    Keras creates BatchNormalization's moving statistics and the loss scale of mixed precision with ``aggregation="none"`` and assigns them
    inside the replicated step. CentralStorageStrategy wraps each variable in an ``AggregatingVariable``,
    which refuses such an assignment ("You must specify an aggregation method to update a
    AggregatingVariable in Replica Context"). Variables created in this strategy's ``scope()`` that are
    non-trainable and unaggregated get ``ONLY_FIRST_REPLICA`` instead: with synchronized batch statistics
    every replica computes the same value, and the first replica's is written once. Mixed precision's loss
    scale gets the same, with :func:`loss_scale_updates_without_cond` (its ``cond`` forbids the
    ``merge_call`` such an assignment needs). ``scope`` is overridden on the
    object's own subclass (checked with TF 2.21 / Keras 3.15)."""
    import contextlib

    import tensorflow as tf

    def creator(next_creator, **kwargs):
        if kwargs.get("trainable") is False and kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE):
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return next_creator(**kwargs)

    base = type(strategy)

    @contextlib.contextmanager
    def scope(self):
        with base.scope(self) as entered, tf.variable_creator_scope(creator):
            yield entered

    strategy.__class__ = type(base.__name__, (base,), {"scope": scope, "__module__": base.__module__})
    return strategy


def loss_scale_updates_without_cond(optimizer):
    """Make a ``LossScaleOptimizer`` update its loss scale with unconditional assignments.

    ``LossScaleOptimizer._stateful_handle_finite_grads`` (Keras 3.15) chooses between "double the scale,
    reset the counter" and "count one more step" with a ``cond`` in replica context. Under
    CentralStorageStrategy a replica-context assignment is a ``merge_call``, which TensorFlow forbids
    inside such a ``cond``. The same update as ``where``: both variables are always assigned, with the
    value the chosen branch would have given."""
    import types

    from keras import ops

    def handle_finite_grads(self, grads, trainable_variables):
        scale = self.dynamic_scale
        tvs = trainable_variables or self._trainable_variables
        unscaled = [g if g is None or self._overwrite_variable_with_gradient(v) else ops.divide(g, scale)
                    for g, v in zip(grads, tvs)]
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        grow = ops.equal(self.step_counter, self.dynamic_growth_steps - 1)
        counter, current = ops.convert_to_tensor(self.step_counter), ops.convert_to_tensor(self.dynamic_scale)
        self.step_counter.assign(ops.where(grow, ops.zeros_like(counter), counter + 1))
        self.dynamic_scale.assign(ops.where(grow, current * 2.0, current))

    if not hasattr(optimizer, "_stateful_handle_finite_grads"):
        raise AttributeError("LossScaleOptimizer has no _stateful_handle_finite_grads: re-check "
                             "kerasdist/_keras_internals/layers.py against this Keras")
    object.__setattr__(optimizer, "_stateful_handle_finite_grads", types.MethodType(handle_finite_grads, optimizer))
    return optimizer
