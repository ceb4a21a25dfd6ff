"""Replicas of one process (a ``tf.distribute.MirroredStrategy``: ``mirrored``, TensorFlow's ``data_parallel``, a
user's own MirroredStrategy object) training and evaluating as one device: the one call both words make at compile.
"""

from ._keras_internals import (accumulate_across_replicas, clip_summed_gradients, synchronize_batch_norm,
                               update_loss_scale_once_per_step, weight_replicas_by_batch_share)
from .errors import KerasdistError


def mirrored_replicas_as_one_device(compile_kwargs, model, strategy, word, sync_batch_norm=False):
    """Uneven global batches, gradient accumulation, clipping, mixed precision and (``sync_batch_norm``) batch
    statistics as on one device (``replicas_train_as_one_device``); a model's own ``train_step`` too
    (``custom_steps_train_as_one_device``); jit_compile on CPU replicas refused or resolved; predict and evaluate
    on fewer rows than replicas; per-output loss logs as one process's. Call from ``kerasdist_adjust_compile``."""
    from . import custom_replica_steps

    no_xla_on_cpu_replicas(compile_kwargs, strategy, word)
    replicas_train_as_one_device(compile_kwargs, model, strategy, sync_batch_norm)
    custom_replica_steps.custom_steps_train_as_one_device(model, compile_kwargs, word)
    predict_on_empty_replicas(model)
    evaluate_on_empty_replicas(model)
    custom_replica_steps.output_losses_weighted_by_share(model)  # outermost: its all-reduce before any tf.cond


def replicas_train_as_one_device(compile_kwargs, model, strategy, sync_batch_norm=False):
    """What makes a tf.distribute strategy's replicas train as one device on the global batch: uneven
    batches weighted by each replica's share, Keras's gradient accumulation decided across replicas,
    (``sync_batch_norm``) batch statistics of the whole batch, and, for the replicas of one process
    (MirroredStrategy, CentralStorageStrategy) under mixed_float16, a step skipped when any replica's
    gradients overflow (the optimizer is wrapped in its LossScaleOptimizer here, as Keras's compile would;
    multi-worker transports sum the gradients before the check instead). Call from ``kerasdist_adjust_compile`` with its ``compile_kwargs``."""
    import keras
    import tensorflow as tf

    in_one_process = isinstance(strategy, (tf.distribute.MirroredStrategy,
                                           tf.distribute.experimental.CentralStorageStrategy))
    if in_one_process and keras.mixed_precision.global_policy().name == "mixed_float16":
        optimizer = compile_kwargs["optimizer"]
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        update_loss_scale_once_per_step(optimizer)
        compile_kwargs["optimizer"] = optimizer
    weight_replicas_by_batch_share(model, compile_kwargs["optimizer"], strategy)
    accumulate_across_replicas(compile_kwargs["optimizer"], strategy)
    clip_summed_gradients(compile_kwargs["optimizer"])
    if sync_batch_norm:
        synchronize_batch_norm(model)


def no_xla_on_cpu_replicas(compile_kwargs, strategy, word):
    """XLA compiles every replica's step for the first CPU, which cannot reach the other CPU replicas' variables
    (TensorFlow's raw "resource .../replica_1 located in device CPU:1 from device CPU:0" at the first step, stock
    MirroredStrategy too): jit_compile=True is refused here, "auto" (Keras's default) resolves to no XLA."""
    cpus = [d for d in strategy.extended.worker_devices if "CPU" in d.upper()]
    if len(cpus) < 2:
        return
    jit_compile = compile_kwargs.get("jit_compile", "auto")
    if jit_compile is True:
        raise KerasdistError(
            f"distribute={word!r} on CPU replicas cannot train with jit_compile=True: TensorFlow's XLA compiles "
            f"every replica's step for the first CPU, which cannot reach the other replicas' variables ({cpus}). "
            "Pass jit_compile=False or 'auto' (Keras's default, no XLA on CPUs), or use "
            "distribute=\"central_storage\" (its variables live on one device: XLA trains there).")
    if jit_compile == "auto":
        compile_kwargs["jit_compile"] = False


def predict_on_empty_replicas(model):
    """A replica given no rows (``predict`` on fewer rows than replicas) predicts one row of zeros and returns none
    of it: TensorFlow's oneDNN convolution gives an empty batch the input's shape, so the next layer fails
    ("Incompatible shapes: [32] vs. [0,64,64,3]", stock MirroredStrategy too; fine with TF_ENABLE_ONEDNN_OPTS=0).
    Rows never mix in inference, so the others' outputs are one device's. Inputs other than dense tensors go to
    the model's own step; a model with its own ``predict_step`` keeps it (its outputs need not be rows). Idempotent."""
    import keras
    import tensorflow as tf

    step = model.predict_step
    if (getattr(step, "_kerasdist_empty_replicas", False) or "predict_step" in vars(model)
            or type(model).predict_step is not keras.Model.predict_step):
        return

    def at_least_one_row(tensor, rows):
        one_row = tf.zeros(tf.concat([[1], tf.shape(tensor)[1:]], 0), tensor.dtype)
        padded = tf.cond(rows > 0, lambda: tensor, lambda: one_row)
        padded.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
        return padded

    def predict_step(data):
        leaves = [leaf for leaf in keras.tree.flatten(data) if leaf is not None]
        if (not leaves or not all(isinstance(leaf, tf.Tensor) and leaf.shape.rank for leaf in leaves)
                or tf.distribute.get_replica_context() is None):
            return step(data)
        rows = tf.shape(leaves[0])[0]
        outputs = step(keras.tree.map_structure(lambda t: t if t is None else at_least_one_row(t, rows), data))
        return keras.tree.map_structure(  # only the replica given no rows drops its row of zeros
            lambda t: tf.cond(rows > 0, lambda: t, lambda: t[:0]) if isinstance(t, tf.Tensor) and t.shape.rank else t,
            outputs)

    predict_step._kerasdist_empty_replicas = True
    model.predict_step = predict_step


def evaluate_on_empty_replicas(model):
    """A replica given no rows skips Keras's own ``test_step`` (the convolution of
    :func:`predict_on_empty_replicas`) and returns its metrics unchanged, as the step on no rows would. A model
    with its own ``test_step`` or ``compute_metrics`` keeps it. Idempotent."""
    import keras
    import tensorflow as tf

    step = model.test_step
    own = vars(model)
    if (getattr(step, "_kerasdist_empty_replicas", False) or "test_step" in own or "compute_metrics" in own
            or type(model).test_step is not keras.Model.test_step
            or type(model).compute_metrics is not keras.Model.compute_metrics):
        return

    def test_step(data):
        leaves = [leaf for leaf in keras.tree.flatten(data) if leaf is not None]
        if (not leaves or not all(isinstance(leaf, tf.Tensor) and leaf.shape.rank for leaf in leaves)
                or tf.distribute.get_replica_context() is None):
            return step(data)
        return tf.cond(tf.shape(leaves[0])[0] > 0, lambda: step(data), model.get_metrics_result)

    test_step._kerasdist_empty_replicas = True
    model.test_step = test_step
