"""Processes that train as one model with no tf.distribute strategy between them (multiworker's strategy-free
step, issue 22). The plugin that runs them declares the group and how to sum tensors across it inside a
training step; other plugins gather through it what a strategy's replica context would have all-gathered
(quantize's int8 ranges)."""

from . import process_state
from .errors import KerasdistError


def _group():
    return process_state.slot("kerasdist.process_group", dict)  # declared again at the next compile after a reset


def set_process_group(size, rank, sum_tensors):
    """Declare that ``size`` processes, this one ``rank``, train as one model; ``sum_tensors(tensors)`` returns
    their float32 sums across the processes (every process calls it at the same point of a step). ``size``
    1 clears the group."""
    if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
        raise KerasdistError(f"set_process_group: size={size!r}, rank={rank!r} is not valid; give an int size >= 1 "
                             "and 0 <= rank < size.")
    _group().clear()
    if size > 1:
        _group().update(size=size, rank=rank, sum_tensors=sum_tensors)


def process_group_size():
    """How many processes train as one model outside a strategy's replicas (1: none declared)."""
    return _group().get("size", 1)


def gather_across_processes(value):
    """A scalar ``value`` from every process of the group, in rank order (a float32 vector of the group's size);
    ``[value]`` when no group is declared. Call it inside a training step, in every process. Its gradient is
    tf.distribute's ``all_gather``'s: the sum over the processes of their gradients for this process's value
    (one more exchange in the backward pass)."""
    import tensorflow as tf

    group = _group()
    value = tf.reshape(tf.cast(value, tf.float32), [1])
    if group.get("size", 1) == 1:
        return value
    rank, sum_tensors = group["rank"], group["sum_tensors"]
    slot = tf.one_hot(rank, group["size"], dtype=tf.float32)

    @tf.custom_gradient
    def gather(local):
        def gradient(upstream):  # as tf.distribute's all_gather: every process's gradient for this one's slot
            return tf.reshape(sum_tensors([upstream])[0][rank], [1])

        return sum_tensors([slot * local])[0], gradient

    return gather(value)
