"""Private Keras/TF internals for variables that live in one place while replicas compute
(CentralStorageStrategy; part of kerasdist._keras_internals).

Under ``tf.distribute.experimental.CentralStorageStrategy`` every variable is one
``AggregatingVariable`` on the parameter device, not one copy per replica as under MirroredStrategy.
Keras 3 writes some variables from inside the replicas and relies on the per-replica copies:

- without an aggregation (BatchNormalization's moving statistics, the loss scale and its counter, seed
  generators): AggregatingVariables refuse such writes;
- metrics (``synchronization="on_read"``, ``aggregation="sum"``): ``assign_add(x)`` is
  ``assign(self + x)``, so the replicas' writes sum the old value once per replica.

The functions below give those writes MirroredStrategy's results.
"""

from .. import process_state


def _patches():
    """Keras's own ``assign_add``/``assign_sub`` while patched. Kept across ``process_state.reset()``: the
    patches stay on the Variable class (models compiled before need them) until uninstalled."""
    return process_state.slot("kerasdist.summed_metric_patches", dict, keep=True)


def assign_state_from_first_replica(strategy):
    """Non-trainable variables created under ``strategy`` without an aggregation take the first replica's
    value when written in replica context (aggregation ``ONLY_FIRST_REPLICA``): the value of a
    MirroredStrategy's primary copy, the one ``get_weights`` and saving read. Where the replicas write
    equal values (synchronized batch statistics, the loss scale) that is exactly one device's value.
    Also makes a metric's ``assign_add`` in replica context add each replica's increment once (see
    :func:`install_summed_metric_updates`). Idempotent.

    Private: ``StrategyExtended._create_variable`` (TF 2.21 ``ParameterServerStrategyExtended``),
    replaced on this strategy's instance; the strategy's ``scope()`` calls it for every variable.
    """
    import tensorflow as tf

    install_summed_metric_updates()
    extended = strategy.extended
    if "_create_variable" in vars(extended):
        return
    create_variable = extended._create_variable

    def create_variable_first_replica_writes(next_creator, **kwargs):
        unaggregated = kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE)
        if unaggregated and not kwargs.get("trainable", True):
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return create_variable(next_creator, **kwargs)

    extended._create_variable = create_variable_first_replica_writes


def install_summed_metric_updates():
    """Make ``keras.Variable.assign_add``/``assign_sub`` in replica context, on a variable backed by a
    summing ``AggregatingVariable`` (a metric's total and count under CentralStorageStrategy), add the
    replicas' increments to the variable once. Keras writes ``assign(self + x)``: summed over 2 replicas
    that doubles the old value at every step, so logs and ``evaluate`` were wrong after the first batch.
    Every other variable takes Keras's own code. Idempotent.

    Private: the TF backend's variable class (patched; ``versions.PIECES["tf_variable"]``: it moved in
    Keras 3.16), ``Variable._value`` (its tf.Variable) and
    ``tensorflow.python.distribute.ps_values.AggregatingVariable``.
    """
    patches = _patches()
    if patches:
        return
    import tensorflow as tf
    from tensorflow.python.distribute import ps_values

    from .versions import locate

    Variable = locate("tf_variable")

    def summed(keras_update, tf_update):
        def update(self, value):
            backing = getattr(self, "_value", None)
            if (not isinstance(backing, ps_values.AggregatingVariable)
                    or backing.aggregation != tf.VariableAggregation.SUM
                    or tf.distribute.in_cross_replica_context()):
                return keras_update(self, value)
            value = self._convert_to_tensor(value, dtype=self._dtype)
            if not value.shape.is_compatible_with(self.shape):
                return keras_update(self, value)  # Keras's own shape error
            return tf_update(backing, tf.cast(value, backing.dtype))

        return update

    patches.update(assign_add=Variable.assign_add, assign_sub=Variable.assign_sub)
    Variable.assign_add = summed(Variable.assign_add, lambda v, x: v.assign_add(x))
    Variable.assign_sub = summed(Variable.assign_sub, lambda v, x: v.assign_sub(x))


def uninstall_summed_metric_updates():
    """Restore Keras's own ``assign_add``/``assign_sub`` (tests)."""
    from .versions import locate

    Variable = locate("tf_variable")
    patches = _patches()
    for name, original in patches.items():
        setattr(Variable, name, original)
    patches.clear()


def update_loss_scale_once_per_step(optimizer):
    """Make a ``keras.optimizers.LossScaleOptimizer`` train under CentralStorageStrategy as under
    MirroredStrategy, and under both as on one device when one replica's gradients overflow. Other
    optimizers are left alone. Idempotent.

    - Keras updates the loss scale's step counter (and grows the scale) inside a ``cond`` in replica
      context (``LossScaleOptimizer._stateful_handle_finite_grads``, private; Keras 3.15); a write that
      needs the replicas to agree cannot run there ("merge_call called while defining a new graph").
      Here the gradients are unscaled and applied as Keras does, and the counter update runs once, in
      cross-replica context, as Keras's own overflow branch does.
    - Keras checks each replica's local gradients for inf/NaN and uses the first replica's answer
      (``check_finite``, public): a step whose overflow is in another replica's share would apply inf.
      Here every replica's answer counts, as one device checking the whole batch's gradient would.
    """
    import keras
    import tensorflow as tf

    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or "check_finite" in vars(optimizer):
        return
    ops = keras.ops
    keras_check_finite = optimizer.check_finite

    def check_finite(grads):
        finite = keras_check_finite(grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        overflows = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(overflows, 0.0)

    def grow_or_count(_):
        def upscale():
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(ops.multiply(optimizer.dynamic_scale, 2.0))

        def increment():
            optimizer.step_counter.assign_add(1)

        ops.cond(ops.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1), upscale, increment)

    def handle_finite_grads(grads, trainable_variables):
        scale = optimizer.dynamic_scale
        variables = trainable_variables or optimizer._trainable_variables
        unscaled = [g if g is None or optimizer._overwrite_variable_with_gradient(v) else ops.divide(g, scale)
                    for g, v in zip(grads, variables)]
        optimizer.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        tf.distribute.get_replica_context().merge_call(grow_or_count)

    object.__setattr__(optimizer, "check_finite", check_finite)
    object.__setattr__(optimizer, "_stateful_handle_finite_grads", handle_finite_grads)


def decay_weights_outside_replicas(optimizer):
    """An optimizer with its own ``_apply_weight_decay`` that writes the model's variables from inside the replicas
    (Keras's Muon: ``variable.assign``) runs it once, in cross-replica context: an ``AggregatingVariable`` refuses a
    replica-context write without an aggregation (CentralStorageStrategy: a raw ValueError at the first step, the
    fuzzer's seed 2003). Keras's TensorFlow optimizers decay through the strategy already and are left alone, as
    are the optimizers a LossScaleOptimizer wraps once handled. Idempotent.

    Private: ``BaseOptimizer._apply_weight_decay`` (replaced per instance) and ``TFOptimizer._apply_weight_decay``
    (``versions.PIECES["optimizer_apply_weight_decay"]``, ``["tf_optimizer_apply_weight_decay"]``)."""
    import tensorflow as tf

    from .strategy_binding import optimizer_chain
    from .versions import locate, require

    require("optimizer_apply_weight_decay", "tf_optimizer_apply_weight_decay")
    through_strategy = locate("tf_optimizer_apply_weight_decay")
    for inner in optimizer_chain(optimizer):
        if (type(inner)._apply_weight_decay is through_strategy or "_apply_weight_decay" in vars(inner)
                or getattr(inner, "weight_decay", None) is None):
            continue
        own = inner._apply_weight_decay

        def apply_weight_decay(variables, own=own):
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return own(variables)
            return context.merge_call(lambda _strategy: own(variables))

        object.__setattr__(inner, "_apply_weight_decay", apply_weight_decay)


def assign_own_state_outside_replicas(optimizer):
    """An optimizer whose own step writes its state before the strategy's update, in replica context (Keras's
    Nadam: ``_u_product`` in ``_backend_update_step``), writes it once, outside the replicas: the first replica's
    value (every replica computes the same one). An ``AggregatingVariable`` refuses a replica-context write without
    an aggregation (CentralStorageStrategy: a raw ValueError at the first step, the fuzzer's seed 4002). Writes in
    cross-replica context (the strategy's update of every slot) are left as they are. Idempotent.

    Private: ``TFOptimizer._backend_update_step`` and ``TFOptimizer.assign`` (``versions.PIECES``)."""
    import tensorflow as tf

    from .strategy_binding import optimizer_chain
    from .versions import locate, require

    require("tf_optimizer_backend_update_step", "tf_optimizer_assign")
    keras_step = locate("tf_optimizer_backend_update_step")
    for inner in optimizer_chain(optimizer):
        if type(inner)._backend_update_step is keras_step or "assign" in vars(inner):
            continue
        own = inner.assign

        def assign(variable, value, own=own):
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return own(variable, value)

            def first_replicas(strategy, values):
                return own(variable, strategy.experimental_local_results(values)[0])

            return context.merge_call(first_replicas, args=(value,))

        object.__setattr__(inner, "assign", assign)
