"""Routing a Keras optimizer's gradient all-reduce to another transport (part of kerasdist._keras_internals).

Private: ``TFOptimizer._all_reduce_sum_gradients`` (replaced per optimizer instance) and, for a
``LossScaleOptimizer``, its ``apply`` (see :func:`route_gradient_all_reduce`).
"""

from .strategy_binding import optimizer_chain

def route_gradient_all_reduce(optimizer, strategy, sum_tensors):
    """Sum the dense gradients of ``optimizer`` (and the optimizers it wraps) with ``sum_tensors``
    while it runs under ``strategy``; sparse gradients and other strategies take Keras's own
    all-reduce (``TFOptimizer._all_reduce_sum_gradients``). ``sum_tensors=None`` restores it.

    A ``LossScaleOptimizer`` (mixed_float16) gets its gradients summed before it checks them for
    inf/NaN: Keras checks each worker's local gradients and then all-reduces only inside the branch
    taken for finite ones, so workers that disagree (an overflow on one) would run different
    all-reduces, and the all-reduce nested in that branch is not ordered with the step's other
    collectives. Summed first, every worker checks the same numbers and takes the same branch.
    """
    chain = optimizer_chain(optimizer)
    for inner in chain:
        for attr in (_GRADIENT_ALL_REDUCE_ATTR, _APPLY_ATTR, _PRESUMMED_ATTR):
            inner.__dict__.pop(attr, None)
    if sum_tensors is None:
        return
    for inner in chain:
        object.__setattr__(inner, _GRADIENT_ALL_REDUCE_ATTR,
                           _routed_all_reduce(inner, strategy, sum_tensors, getattr(inner, _GRADIENT_ALL_REDUCE_ATTR)))
    if len(chain) > 1:
        keras_all_reduce = getattr(chain[-1], _GRADIENT_ALL_REDUCE_ATTR).__wrapped_all_reduce__
        object.__setattr__(chain[0], _APPLY_ATTR, _sum_before_apply(chain, strategy, sum_tensors,
                                                                   getattr(chain[0], _APPLY_ATTR), keras_all_reduce))


def _under(strategy):
    import tensorflow as tf

    return tf.distribute.get_replica_context() is not None and tf.distribute.get_strategy() is strategy


def _sum_dense(grads, sum_tensors):
    import tensorflow as tf

    grads = list(grads)
    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    if dense:
        for i, total in zip(dense, sum_tensors([grads[i] for i in dense])):
            grads[i] = total
    return grads


def _routed_all_reduce(optimizer, strategy, sum_tensors, keras_all_reduce):
    import tensorflow as tf

    def all_reduce(grads_and_vars):
        pairs = list(grads_and_vars)
        if not _under(strategy):
            return keras_all_reduce(pairs)
        if optimizer.__dict__.get(_PRESUMMED_ATTR, False):  # summed before the LossScaleOptimizer, sparse ones too
            return pairs
        grads = _sum_dense([g for g, _ in pairs], sum_tensors)
        pairs = [(g, v) for g, (_, v) in zip(grads, pairs)]
        sparse = [i for i, (g, _) in enumerate(pairs) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            for i, pair in zip(sparse, keras_all_reduce([pairs[i] for i in sparse])):
                pairs[i] = pair
        return pairs

    all_reduce.__wrapped_all_reduce__ = keras_all_reduce
    return all_reduce


def _sum_before_apply(chain, strategy, sum_tensors, keras_apply, keras_all_reduce):
    """Every gradient summed before the LossScaleOptimizer sees it: the dense ones over ``sum_tensors``, the sparse
    ones through Keras's all-reduce (its unscaling makes them dense, and the optimizers it wraps sum nothing more:
    an Embedding's gradient was each worker's own, the fuzzer's seed 4002 under mixed_float16)."""
    import tensorflow as tf

    def apply(grads, trainable_variables=None):
        if not _under(strategy):
            return keras_apply(grads, trainable_variables)
        grads = _sum_dense(grads, sum_tensors)
        variables = list(trainable_variables or chain[0]._trainable_variables)
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            for i, (total, _) in zip(sparse, keras_all_reduce([(grads[i], variables[i]) for i in sparse])):
                grads[i] = total
        for inner in chain[1:]:  # set while Keras traces the update (replica threads included)
            object.__setattr__(inner, _PRESUMMED_ATTR, True)
        try:
            return keras_apply(grads, trainable_variables)
        finally:
            for inner in chain[1:]:
                inner.__dict__.pop(_PRESUMMED_ATTR, None)

    return apply


_APPLY_ATTR = "apply"
_PRESUMMED_ATTR = "_kerasdist_gradients_summed"
_GRADIENT_ALL_REDUCE_ATTR = "_all_reduce_sum_gradients"
