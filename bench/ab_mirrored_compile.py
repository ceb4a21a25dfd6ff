"""Interleaved A/B of compile(distribute="mirrored")'s extra time on ResNet50: how variables were moved before
issue 22 (two new tf.Variables per variable), "reuse only" (the old variable as replica 0's component, replica 1
through TensorFlow's creator), "reuse+copy" (reuse, and replica 1 as UninitializedVariable + assign, both through
TensorFlow's variable-creator stack), "no read-back" (reuse+copy, the assign returning nothing), "via TF wrap"
(no creator stack under a plain MirroredStrategy: components made directly, wrapped by TensorFlow's
create_mirrored_variable), "direct wrap" (the same, wrapped directly: no eager no_op per component), "raw ops"
(direct wrap, the copy's read and assign as bare tf.raw_ops) and the current code (raw ops, all copies for one
device made under one device scope, then all wrapped).

    KERASDIST_CPU_REPLICAS=2 .venv/bin/python bench/ab_mirrored_compile.py [--rounds 9] [--variants a,b]

Each round compiles a fresh ResNet50 (64x64x3, 10 classes) plain and with each variant, the order alternating;
prints the medians of each variant minus the plain compile, with the load average.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERASDIST_CPU_REPLICAS", "2")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.ops import resource_variable_ops  # noqa: E402

import kerasdist  # noqa: E402
from kerasdist._keras_internals import strategy_binding  # noqa: E402


def move_before_issue_22(variables, strategy):
    with strategy.scope():
        for variable in variables:
            if getattr(variable, "_value", None) is None:
                continue
            current = variable._value
            if strategy_binding._belonging_to(strategy)(current):
                continue
            variable._initialize(tf.convert_to_tensor(current.read_value()))


def copy_through_tensorflow(variable, kwargs):
    """Replica 1's component as TensorFlow's default creator makes it (the "reuse only" variant)."""
    wanted = ("initial_value", "trainable", "name", "dtype", "synchronization", "aggregation", "shape")
    return resource_variable_ops.ResourceVariable(**{k: v for k, v in kwargs.items() if k in wanted})


def copy_read_back(variable, kwargs):
    """Replica 1's component as "reuse+copy" made it: the assign also built an unread-variable object."""
    copy = resource_variable_ops.UninitializedVariable(
        shape=variable.shape, dtype=variable.dtype, name=kwargs["name"], trainable=kwargs.get("trainable", True),
        synchronization=kwargs.get("synchronization"), aggregation=kwargs.get("aggregation"))
    copy.assign(variable.value())
    return copy


def copy_assign(variable, kwargs):
    """Replica 1's component as "no read-back" made it: the read and the assign through the variables' methods."""
    copy = resource_variable_ops.UninitializedVariable(
        shape=variable.shape, dtype=variable.dtype, name=kwargs["name"], trainable=kwargs.get("trainable", True),
        synchronization=kwargs.get("synchronization"), aggregation=kwargs.get("aggregation"))
    copy.assign(variable.value(), read_value=False)
    return copy


def no_direct_mirroring(strategy):
    return None


def _copy_on(device, variable, kwargs):
    with tf.device(device):
        return strategy_binding._copy_on_this_device(variable, kwargs)


def _each_movable(self, variables, left):
    """(variable, its tf.Variable, that one's name) of each variable the direct path takes; the others go to
    ``left``."""
    for variable in variables:
        old = variable._value
        if self._movable(variable, old):
            yield variable, old, old.name.split(":")[0]
        else:
            left.append(variable)


def move_through_create_mirrored_variable(self, variables):
    """The wrapper made by TensorFlow's ``create_mirrored_variable`` (two eager ``no_op`` per variable more)."""
    from tensorflow.python.distribute import distribute_utils

    left = []
    for variable, old, name in _each_movable(self, variables, left):

        def components(old=old, name=name, **kwargs):
            return [old] + [_copy_on(device, old, dict(kwargs, name=f"{name}/replica_{i}/"))
                            for i, device in enumerate(self.devices[1:], start=1)]

        variable._initialize(distribute_utils.create_mirrored_variable(
            self.strategy, components, distribute_utils.VARIABLE_CLASS_MAPPING,
            distribute_utils.VARIABLE_POLICY_MAPPING, initial_value=None, name=name, trainable=old.trainable,
            dtype=old.dtype, synchronization=old.synchronization, aggregation=old.aggregation))
    return left


def move_one_by_one(self, variables):
    """Each variable's copies made and wrapped before the next one's, each under its own device scope."""
    from tensorflow.python.distribute import distribute_utils

    left = []
    for variable, old, name in _each_movable(self, variables, left):
        synchronization = old.synchronization
        if synchronization == tf.VariableSynchronization.AUTO:
            synchronization = tf.VariableSynchronization.ON_WRITE
        kwargs = {"trainable": old.trainable, "synchronization": synchronization, "aggregation": old.aggregation}
        components = [old] + [_copy_on(device, old, dict(kwargs, name=f"{name}/replica_{i}/"))
                              for i, device in enumerate(self.devices[1:], start=1)]
        wrapper = distribute_utils.VARIABLE_CLASS_MAPPING[synchronization]
        variable._initialize(wrapper(self.strategy, components, old.aggregation))
    return left


CURRENT = {name: getattr(strategy_binding, name) for name in ("_move_variables", "_copy_on_this_device")}
CURRENT["direct_for_strategy"] = strategy_binding._DirectMirroring.for_strategy
CURRENT["direct_move_all"] = strategy_binding._DirectMirroring.move_all
CREATOR_STACK = {"direct_for_strategy": no_direct_mirroring}
VARIANTS = {"plain": {}, "before": {"_move_variables": move_before_issue_22},
            "reuse only": dict(CREATOR_STACK, _copy_on_this_device=copy_through_tensorflow),
            "reuse+copy": dict(CREATOR_STACK, _copy_on_this_device=copy_read_back),
            "no read-back": dict(CREATOR_STACK, _copy_on_this_device=copy_assign),
            "via TF wrap": {"direct_move_all": move_through_create_mirrored_variable,
                            "_copy_on_this_device": copy_assign},
            "direct wrap": {"direct_move_all": move_one_by_one, "_copy_on_this_device": copy_assign},
            "raw ops": {"direct_move_all": move_one_by_one},
            "current": {}}


def _use(variant):
    """Put ``variant``'s replacements (the current code for the rest) into strategy_binding."""
    chosen = dict(CURRENT, **variant)
    strategy_binding._DirectMirroring.for_strategy = staticmethod(chosen.pop("direct_for_strategy"))
    strategy_binding._DirectMirroring.move_all = chosen.pop("direct_move_all")
    for name, value in chosen.items():
        setattr(strategy_binding, name, value)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--variants", default=",".join(list(VARIANTS)[1:]),
                        help="comma-separated, among: " + ", ".join(list(VARIANTS)[1:]))
    args = parser.parse_args()
    variants = ["plain"] + [name for name in args.variants.split(",") if name != "plain"]
    kerasdist.mirrored()  # plugins loaded: measure compile, not start-up
    times = {name: [] for name in variants}
    load_start = os.getloadavg()[0]
    try:
        for round_number in range(args.rounds):
            order = variants if round_number % 2 == 0 else variants[::-1]
            for name in order:
                model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
                _use(VARIANTS[name])
                start = time.perf_counter()
                model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                              distribute=None if name == "plain" else "mirrored")
                times[name].append(time.perf_counter() - start)
                moved = isinstance(model.variables[0].value, tf.distribute.DistributedValues)
                assert moved == (name != "plain"), f"{name}: the variables were not moved as this variant should"
    finally:
        _use({})
    plain = statistics.median(times["plain"])
    print(f"{args.rounds} interleaved rounds, load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} "
          f"at end; plain compile {plain:.3f} s; extra time of compile(distribute='mirrored'):")
    for name in variants[1:]:
        print(f"  {name:<12} {statistics.median(times[name]) - plain:.3f} s")


if __name__ == "__main__":
    main()
