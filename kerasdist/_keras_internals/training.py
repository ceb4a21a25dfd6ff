"""Private Keras internals for a training step and its variables (part of kerasdist._keras_internals)."""

import inspect


# -- the order of Keras's own train_step (torch_distributed, multiworker's strategy-free step) ---------------

#: The piece of versions.PIECES that is each backend's own Keras ``train_step``.
_BACKEND_TRAIN_STEPS = {"tensorflow": "tf_train_step", "torch": "torch_train_step"}


def keras_step_order_is_known(model):
    """Whether ``model`` trains with the backend's own Keras ``train_step`` and ``compute_metrics`` (TensorFlow or
    torch; neither replaced by its class or on the instance): then ``compute_loss`` runs once, the loss tracker
    is updated before ``optimizer.apply`` (TensorFlow: through ``apply_gradients``) and only the compiled metrics
    after it. Ask before wrapping the instance's step. False on a Keras lacking those pieces (the general path)."""
    import keras

    from .versions import locate, missing

    step = _BACKEND_TRAIN_STEPS.get(keras.backend.backend())
    if step is None or missing(step, "trainer_compute_metrics"):
        return False
    own = vars(model)
    own_step = own.get("train_step")  # kerasdist's per-output loss weighting wraps Keras's own step
    return (type(model).train_step is locate(step)
            and (own_step is None or getattr(own_step, "_kerasdist_output_losses", False))
            and type(model).compute_metrics is locate("trainer_compute_metrics") and "compute_metrics" not in own)


def output_loss_trackers(model):
    """The ``Mean`` trackers Keras's compiled loss keeps per output (``out_loss``, ``aux_loss``; none for one loss),
    once it is built (private: ``model._compile_loss``, its ``metrics``)."""
    compile_loss = getattr(model, "_compile_loss", None)
    return list(getattr(compile_loss, "metrics", None) or []) if getattr(compile_loss, "built", False) else []


def mean_state(metric):
    """The (total, count) variables of a ``keras.metrics.Mean``-like metric (Keras's ``loss`` tracker: the running
    sum of the values times their weights, and the summed weights), or None. Private: ``Reduce.total/.count``."""
    total, count = getattr(metric, "total", None), getattr(metric, "count", None)
    if total is None or count is None or not hasattr(total, "assign") or not hasattr(count, "assign"):
        return None
    return total, count


# -- keras.distribution on JAX (kerasdist_plugins.keras_distribution) --------------------------------

def lay_out_variables(variables, layout_of):
    """Give each Keras variable (JAX backend) ``layout_of(variable)``, a ``keras.distribution.TensorLayout``,
    and move its value there, as creating it under a distribution would have done. Variables that already
    have a layout (built under the user's own distribution) keep it. Returns the variables moved.

    Private: ``Variable._layout`` (read by ``Distribution.get_variable_layout`` and by optimizers for their
    slots) and the JAX Variable's ``_direct_assign`` (which distributes the value by the layout;
    ``versions.PIECES["jax_variable_direct_assign"]``).
    """
    from .versions import require

    require("jax_variable_direct_assign")
    moved = []
    for variable in variables:
        if getattr(variable, "_layout", None) is not None:
            continue
        variable._layout = layout_of(variable)
        variable._direct_assign(variable.value)
        moved.append(variable)
    return moved


def variable_layout(variable):
    """The ``keras.distribution.TensorLayout`` a variable was given, or None."""
    return getattr(variable, "_layout", None)


_PLACERS = {}  # id(distribution) -> (distribution, place): how kerasdist places each batch under it


def place_batches_by(distribution, place):
    """Under ``distribution``, have Keras's JAX trainer give each batch leaf as read in this process (a NumPy
    array) and the sharding Keras chose for it to ``place(batch, sharding)``, which returns the global
    ``jax.Array``, instead of ``jax.make_array_from_process_local_data`` (which takes the batch as this
    process's share and cannot place a batch that does not divide over the devices). Other distributions
    keep Keras's own placement.

    Private: the JAX backend's ``distribution_lib.distribute_data_input``, which Keras's JAX trainer
    looks up for every batch (``versions.PIECES["jax_distribute_data_input"]``).
    """
    import keras

    from .versions import owner_of

    owner, name = owner_of("jax_distribute_data_input")
    original = getattr(owner, name)
    if not getattr(original, "_kerasdist_placing", False):
        def distribute_data_input(per_process_batch, layout, batch_dim_name, *args, **kwargs):
            current = keras.distribution.distribution()
            entry = _PLACERS.get(id(current))
            if layout is None or entry is None or entry[0] is not current:
                return original(per_process_batch, layout, batch_dim_name, *args, **kwargs)
            return entry[1](per_process_batch, getattr(layout, "backend_layout", layout))

        distribute_data_input._kerasdist_placing = True
        setattr(owner, name, distribute_data_input)
    _PLACERS[id(distribution)] = (distribution, place)


# -- uneven per-replica batches (mirrored, central_storage) -----------------------------------------

class _BatchShare:
    """Per model: whether to weight replicas by their batch share, and each replica's batch (per thread:
    MirroredStrategy traces each replica in its own thread)."""

    def __init__(self, replicas=None, sum_counts=None):
        import threading

        self.enabled, self.replicas, self.sum_counts = True, replicas, sum_counts
        self.local = threading.local()


def weight_replicas_by_batch_share(model, optimizer, strategy=None, *, replicas=None, sum_counts=None):
    """Make training equal to one device when a global batch does not split evenly over the replicas
    (a last batch of 1 over 2 replicas leaves one replica empty). Idempotent.

    Keras averages each replica's mean loss; the global mean needs each replica weighted by its share of
    the batch, n_r * R / N. The factor multiplies the loss in ``optimizer.scale_loss`` (public; called
    after the loss metric is updated, so logs stay per-example means), with n_r recorded by a
    ``model.compute_loss`` wrapper (public) and N summed over the replicas: by the strategy's replica
    context, or by ``sum_counts`` over ``replicas`` processes of one replica each (Horovod). (Keras's
    first-batch build, which averaged the replicas' batches and failed for unequal shapes, builds from the
    input's structure for every model kerasdist moved: ``multiworker_fit.build_from_input_structure``.)
    """
    import tensorflow as tf

    state = getattr(model, "_kerasdist_uneven", None)
    if state is not None:
        _wrap_scale_loss(optimizer, state)
        return
    state = model._kerasdist_uneven = _BatchShare(replicas, sum_counts)
    original_compute_loss = model.compute_loss
    with_training = "training" in inspect.signature(original_compute_loss).parameters

    def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
        leaf = next((t for t in keras_tree().flatten(y_pred) if t is not None), None)
        state.local.batch = tf.shape(leaf)[0] if leaf is not None else None
        if with_training:
            return original_compute_loss(x, y, y_pred, sample_weight, training=training)
        return original_compute_loss(x, y, y_pred, sample_weight)

    model.compute_loss = compute_loss
    _wrap_scale_loss(optimizer, state)


_UNCHANGED = object()  # set_batch_share_weighting's default: keep the value set before


def set_batch_share_weighting(model, enabled, *, replicas=_UNCHANGED, sum_counts=_UNCHANGED):
    """Turn the weighting of :func:`weight_replicas_by_batch_share` on or off for the next ``fit`` (it
    costs one small all-reduce per step; off when every batch splits evenly), its row counts summed by
    ``sum_counts`` over ``replicas`` processes of one replica each (None: the strategy's all-reduce;
    left out: as set before). Retraces when any of them changes."""
    state = getattr(model, "_kerasdist_uneven", None)
    if state is None:
        return
    wanted = (bool(enabled), state.replicas if replicas is _UNCHANGED else replicas,
              state.sum_counts if sum_counts is _UNCHANGED else sum_counts)
    if (state.enabled, state.replicas, state.sum_counts) != wanted:
        state.enabled, state.replicas, state.sum_counts = wanted
        model.train_function = None


def _wrap_scale_loss(optimizer, state):
    import tensorflow as tf

    if getattr(optimizer, "_kerasdist_scale_loss", None) is not None:
        return
    original = optimizer.scale_loss
    optimizer._kerasdist_scale_loss = original

    def scale_loss(loss):
        batch = getattr(state.local, "batch", None)
        if not state.enabled or batch is None:
            return original(loss)
        local = tf.cast(batch, loss.dtype)
        if state.sum_counts is not None:
            replicas, total = state.replicas, tf.cast(state.sum_counts(local), loss.dtype)
        else:
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1:
                return original(loss)
            replicas, total = context.num_replicas_in_sync, context.all_reduce(tf.distribute.ReduceOp.SUM, local)
        return original(loss * tf.math.divide_no_nan(local * replicas, total))

    optimizer.scale_loss = scale_loss


def keras_tree():
    import keras

    return keras.tree


# -- gradient accumulation under a tf.distribute strategy --------------------------------------------

def accumulate_across_replicas(optimizer, strategy):
    """Make Keras's ``gradient_accumulation_steps`` work under ``strategy``. Idempotent.

    Keras accumulates inside ``ops.cond`` and the update step then calls ``merge_call`` inside the
    branch, which tf.distribute refuses ("merge_call called while defining a new graph"). Here the
    micro-batch gradients are all-reduced first, every step (``_all_reduce_sum_gradients``, routed as
    the strategy's plugin set it), and the accumulate-or-update decision runs in cross-replica
    context. Replaces the instance's ``_backend_apply_gradients`` (private; Keras 3.15 TFOptimizer).
    """
    import tensorflow as tf

    if not optimizer.gradient_accumulation_steps or getattr(optimizer, "_kerasdist_accumulates", False):
        return
    unsupported = [name for name in ("clipnorm", "clipvalue", "global_clipnorm", "use_ema")
                   if getattr(optimizer, name, None)]
    if unsupported:
        from ..errors import KerasdistError

        raise KerasdistError(
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} with {', '.join(unsupported)} is "
            f"not supported under {type(strategy).__name__}; drop {unsupported[0]}, or accumulate by a larger "
            "global batch_size instead.")
    optimizer._kerasdist_accumulates = True
    steps = optimizer.gradient_accumulation_steps

    def backend_apply_gradients(grads, trainable_variables):
        grads_and_vars = optimizer._all_reduce_sum_gradients(
            list(zip(grads, [v.value for v in trainable_variables])))
        accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)].value
                        for v in trainable_variables]  # the tf.Variables behind Keras's variables
        tf.distribute.get_replica_context().merge_call(
            _accumulate_or_update, args=(optimizer, steps, grads_and_vars, accumulators, trainable_variables))

    optimizer._backend_apply_gradients = backend_apply_gradients


def _accumulate_or_update(distribution, optimizer, steps, grads_and_vars, accumulators, trainable_variables):
    import tensorflow as tf

    def update():
        update_pairs = []
        for (grad, var), acc in zip(grads_and_vars, accumulators):  # acc := (acc + grad) / steps, the update
            distribution.extended.update(acc, lambda a, g: a.assign((a + g) / steps), args=(grad,), group=False)
            update_pairs.append((acc, var))
        if optimizer.weight_decay:
            for variable in trainable_variables:
                if optimizer._use_weight_decay(variable):
                    rate = optimizer.weight_decay * optimizer.learning_rate
                    distribution.extended.update(
                        variable.value, lambda v, r: v.assign_sub(v * tf.cast(r, v.dtype)), args=(rate,),
                        group=False)
        optimizer._distributed_tf_update_step(distribution, update_pairs, optimizer.learning_rate)
        for acc in accumulators:
            distribution.extended.update(acc, lambda a: a.assign(tf.zeros_like(a)), group=False)
        return tf.constant(True)

    def accumulate():
        for (grad, _), acc in zip(grads_and_vars, accumulators):
            distribution.extended.update(acc, lambda a, g: a.assign_add(g), args=(grad,), group=False)
        return tf.constant(False)

    is_update_step = (optimizer._iterations + 1) % steps == 0
    tf.cond(is_update_step, update, accumulate)


def synchronize_batch_norm(model, sum_across=None):
    """Make every ``keras.layers.BatchNormalization`` of ``model`` (nested ones too) use the statistics of
    the whole global batch. Under a tf.distribute strategy: Keras's own ``synchronized=True`` (set after
    construction: ``call`` reads it). With ``sum_across(tensor, name)`` (one replica per process, e.g.
    Horovod): the layer's moments are the sums of every process's sum, squared sum and count, as Keras's
    synchronized moments compute them. Returns the number of layers changed.

    Private: ``Layer._flatten_layers`` finds nested layers; ``BatchNormalization._moments`` is replaced per
    instance for ``sum_across`` (Keras 3.15; both checked by tests/test_keras_internals_training.py).
    """
    import keras

    from .versions import require

    if sum_across is not None:
        return replace_moments(model, lambda layer: _summed_moments(layer, layer._moments, sum_across))
    require("layer_flatten_layers")
    changed = 0
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized:
            layer.synchronized = True
            changed += 1
    return changed


def replace_moments(model, make_moments):
    """Give every ``keras.layers.BatchNormalization`` of ``model`` (nested ones too) whose ``_moments`` is
    not replaced yet the function ``make_moments(layer)`` returns. Returns the number of layers changed."""
    import keras

    from .versions import require

    require("layer_flatten_layers", "batch_norm_moments")
    changed = 0
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and "_moments" not in layer.__dict__:
            layer._moments = make_moments(layer)
            changed += 1
    return changed


def _summed_moments(layer, local_moments, sum_across):
    import tensorflow as tf

    def moments(inputs, mask):
        if mask is not None:  # masked statistics stay local
            return local_moments(inputs, mask)
        axes = list(layer._reduction_axes)
        x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        local_sum = tf.reduce_sum(x, axis=axes, keepdims=True)
        local_squares = tf.reduce_sum(tf.square(x), axis=axes, keepdims=True)
        local_count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        size = tf.size(local_sum)
        total = sum_across(tf.concat([tf.reshape(local_sum, [-1]), tf.reshape(local_squares, [-1]),
                                      tf.reshape(local_count, [1])], 0), f"kerasdist_bn_{layer.name}")
        mean = tf.reshape(tf.math.divide_no_nan(total[:size], total[2 * size]), tf.shape(local_sum))
        squares = tf.reshape(tf.math.divide_no_nan(total[size:2 * size], total[2 * size]), tf.shape(local_sum))
        variance = tf.maximum(squares - tf.square(mean), 0.0)
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

    return moments


def all_layers(model):
    """Every layer of ``model``, nested ones included (``Layer._flatten_layers``, private; Keras 3.15)."""
    return list(model._flatten_layers(include_self=False, recursive=True))


# -- evaluate()'s return value (horovod) ------------------------------------------------------------

def flatten_metrics_in_order(model, logs):
    """What ``evaluate()`` returns without ``return_dict=True``, made from its ``logs`` dict:
    the values in metric order, or the one value (``Trainer._flatten_metrics_in_order``)."""
    from .versions import require

    require("trainer_flatten_metrics")
    return model._flatten_metrics_in_order(logs)
