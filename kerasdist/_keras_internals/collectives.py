"""Private TensorFlow internals for MirroredStrategy's collective ops (part of kerasdist._keras_internals).

Every ``tf.distribute.MirroredStrategy`` numbers its collective ops the same way: group key 1 (plus the
class attribute ``_collective_key_base``, 0 outside TF's own tests) and instance keys from 100, counted up
as functions are traced. TensorFlow's runtime remembers each (group key, instance key) it has run, with
its shape, for the life of the process. Two MirroredStrategy objects over the same devices therefore
reuse each other's keys, and the second one's first all-reduce of another shape aborts every collective
("Shape mismatch in the collective instance 100"): two models in one process, each with its own
strategy, cannot both train, in stock Keras too.
"""

import itertools
import sys
import threading

from .. import process_state

#: Group keys kerasdist gives out: far above TensorFlow's default (1) and its tests' bases (multiples of 100000).
_FIRST_BASE, _BASE_STEP = 1 << 24, 1 << 10
_lock = threading.Lock()


def _bases():
    """The next collective key bases. Kept across ``process_state.reset()``: TensorFlow's runtime remembers
    every key it ran for the life of the process, so a base is never given out twice."""
    return process_state.slot("kerasdist.collective_key_bases", lambda: itertools.count(_FIRST_BASE, _BASE_STEP),
                              keep=True)
_MARK = "_kerasdist_own_collective_keys"


def keep_collectives_apart(strategy):
    """Give ``strategy`` (a ``tf.distribute.MirroredStrategy``) collective keys of its own, unless it has
    already traced a collective op (its keys are then in functions TensorFlow may run again). Returns
    True when its keys are kerasdist's own (now or before), False when they were left as they were.
    Other strategies are left alone (False). Idempotent.

    Private (TF 2.21 ``MirroredExtended``): ``_collective_key_base``, ``_collective_keys`` (a
    ``CollectiveKeys``; its ``_instance_key_table`` counts the instance keys given out),
    ``_collective_ops``, ``_cross_device_ops`` and ``_make_collective_ops_with_fallbacks``, which builds
    the keys and the all-reduce from the base, as the strategy's ``__init__`` does.
    """
    tf = sys.modules.get("tensorflow")  # never imports TensorFlow (JAX)
    if tf is None or not isinstance(strategy, tf.distribute.MirroredStrategy):
        return False
    from tensorflow.python.distribute import cross_device_utils

    extended = strategy.extended
    with _lock:
        if getattr(extended, _MARK, False):
            return True
        table = extended._collective_keys._instance_key_table
        if any(key != cross_device_utils.INSTANCE_KEY_START_NUMBER
               for group in table.values() for key in group.values()):
            return False  # already traced collectives with these keys
        default_ops = extended._cross_device_ops is extended._collective_ops
        extended._collective_key_base = next(_bases())
        extended._collective_ops = extended._make_collective_ops_with_fallbacks()
        if default_ops:  # no cross_device_ops given: the strategy all-reduces with its collective ops
            extended._cross_device_ops = extended._collective_ops
        setattr(extended, _MARK, True)
        return True


def collective_group_keys(strategy):
    """The collective group keys ``strategy`` (a MirroredStrategy) uses (for tests)."""
    return set(strategy.extended._collective_keys._known_groups.values())
