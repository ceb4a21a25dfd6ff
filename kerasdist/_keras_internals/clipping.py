"""An optimizer's gradient clipping applied to the replicas' summed gradient (part of kerasdist._keras_internals).

Keras clips each replica's gradient (``BaseOptimizer._clip_gradients``, private, replaced per optimizer
instance) before the TensorFlow backend sums them over the replicas: ``clip(g1) + clip(g2)``, not one process's
``clip(g1 + g2)``. See :func:`clip_summed_gradients`.
"""

from .gradient_routing import _PRESUMMED_ATTR  # the gradients reaching apply are already summed
from .strategy_binding import optimizer_chain
from .versions import require

_CLIP_ATTR = "_clip_gradients"
_MARK = "_kerasdist_clips_summed_gradients"


def clip_summed_gradients(optimizer):
    """Make ``clipvalue``, ``clipnorm`` and ``global_clipnorm`` of ``optimizer`` (and the optimizers it wraps)
    clip the gradient summed over a tf.distribute strategy's replicas, once, as one process clips its gradient.

    In replica context of several replicas the gradients are all-reduced (SUM) first, clipped by Keras's own
    clipping, and each replica hands on ``clipped / replicas``: Keras's own all-reduce that follows sums those
    back to the clipped global gradient. Elsewhere (one replica, cross-replica context, gradients already
    summed) Keras clips as it does. Idempotent."""
    for inner in optimizer_chain(optimizer):
        if not _clips(inner) or inner.__dict__.get(_MARK):
            continue
        require("optimizer_clip_gradients")
        object.__setattr__(inner, _CLIP_ATTR, _clip_summed(inner, getattr(inner, _CLIP_ATTR)))
        object.__setattr__(inner, _MARK, True)


def _clips(optimizer):
    return any(getattr(optimizer, name, None) for name in ("clipvalue", "clipnorm", "global_clipnorm"))


def _clip_summed(optimizer, keras_clip):
    import tensorflow as tf

    def clip_gradients(grads):
        context = tf.distribute.get_replica_context()
        if (not tf.distribute.has_strategy() or context is None or context.num_replicas_in_sync == 1
                or optimizer.__dict__.get(_PRESUMMED_ATTR, False)):
            return keras_clip(grads)
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        totals = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
        clipped = keras_clip(list(totals))
        replicas = context.num_replicas_in_sync
        first = tf.equal(context.replica_id_in_sync_group, 0)
        for i, total in zip(present, clipped):
            grads[i] = _share(total, replicas, first)
        return grads

    return clip_gradients


def _share(gradient, replicas, first):
    """This replica's part of the clipped sum: Keras's all-reduce that follows adds the parts back to it. Sparse
    slices are all-reduced by concatenation, so the first replica hands on every slice and the others none (halved
    slices would reach the optimizer twice: Adagrad and Adam square each slice, (g/2)^2 + (g/2)^2 is not g^2)."""
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        rows = tf.shape(gradient.indices)[0] * tf.cast(first, tf.int32)
        return tf.IndexedSlices(gradient.values[:rows], gradient.indices[:rows], gradient.dense_shape)
    return gradient / replicas
