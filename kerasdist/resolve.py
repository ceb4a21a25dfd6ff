"""Turns a ``distribute=`` value into a checked :class:`~kerasdist.specs.Plan`."""

from .errors import BackendError, KerasdistError, PluginUnavailableError
from .specs import OptimizationSpec, Plan, PluginSpec, StrategyInstance

ACCEPTED = ("a plugin name such as 'mirrored' (see `kerasdist plugins`), 'auto', a tf.distribute.Strategy "
            "(or a keras.distribution.Distribution on JAX), "
            "a spec such as kerasdist.mirrored(devices=[...]), a list of these, or None")


def resolve_plan(distribute, system, cluster):
    """Resolve, add what the specs require, then check every spec can run here; raises a KerasdistError otherwise."""
    plan = with_required(Plan.combine(_specs(distribute, system, cluster)), system)
    for spec in plan.specs:
        check_available(spec, system)
    return plan


def with_required(plan, system):
    """``plan`` with the optimizations its specs ask for (:meth:`OptimizationSpec.required_optimizations`),
    each added right after the spec that asks (and what it asks for in turn)."""
    specs = list(plan.specs)
    index = 0
    while index < len(specs):
        asking, at = specs[index], index + 1
        for name, options in (asking.required_optimizations() if isinstance(asking, OptimizationSpec) else ()):
            required = _required_spec(asking, name, options, system)
            present = next((spec for spec in specs if spec.name == required.name), None)
            if present is None:
                specs.insert(at, required)
                at += 1
            elif present != required:
                raise KerasdistError(
                    f"distribute= gives {present!r}, but {_asker(asking)} needs {required!r} itself; leave out "
                    f"{present.name!r} (or the option of {asking.name!r} that needs it).")
        index += 1
    return Plan.combine(specs)


def _asker(spec):
    return f"{spec.name!r} ({spec!r})"


def _required_spec(asking, name, options, system):
    """The spec ``asking`` needs, made through the registry; a clear error when no loaded plugin can make it."""
    entry = system.registry.find(name)
    if entry is None or entry.kind != "optimization":
        missing = [f"plugin {f.name!r} ({f.reason})" for f in system.registry.failures]
        raise PluginUnavailableError(
            f"{_asker(asking)} needs the optimization {name!r}, which no loaded plugin registers"
            + (f"; not loaded here: {'; '.join(missing)}" if missing else "")
            + f". Enable the plugin that provides {name!r}, or leave out the option of {asking.name!r} that needs it.")
    reason = entry.unavailable_reason()
    if reason:
        raise PluginUnavailableError(
            f"{_asker(asking)} needs the optimization {entry.name!r} of plugin {entry.plugin!r}, which cannot run "
            f"here: {reason}. Enable it, or leave out the option of {asking.name!r} that needs it.")
    return entry.create(**options)


def _specs(value, system, cluster):
    if isinstance(value, Plan):
        return list(value.specs)
    if isinstance(value, PluginSpec):
        return [value]
    if isinstance(value, str):
        return [_named(value, system, cluster)]
    if isinstance(value, (list, tuple)):
        if not value:
            raise KerasdistError(f"distribute={value!r} is empty; expected {ACCEPTED}.")
        return [spec for item in value for spec in _specs(item, system, cluster)]
    if _is_strategy_object(value):
        return [StrategyInstance(value)]
    raise KerasdistError(f"distribute= got {value!r} of type {type(value).__name__}; expected {ACCEPTED}.")


def _named(name, system, cluster):
    if name.strip().lower() == "auto":
        name = system.hook.kerasdist_auto_strategy(cluster=cluster)
        if name is None:
            raise KerasdistError("distribute='auto' found no strategy plugin for this machine; "
                                 "name one explicitly (see `kerasdist plugins`).")
    return system.registry.get(name).create()


def is_tf_strategy(value):
    """Whether ``value`` is a ``tf.distribute.Strategy`` (never imports TensorFlow)."""
    import sys

    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.distribute.Strategy)


def _is_strategy_object(value):
    """A tf.distribute.Strategy, or a keras.distribution.Distribution (JAX), passed as is."""
    if is_tf_strategy(value):
        return True
    # keras.distribution exports no base class: a Distribution is what has a mesh, layouts and a scope
    return all(callable(getattr(value, name, None)) for name in ("get_data_layout", "get_variable_layout", "scope")) \
        and hasattr(value, "device_mesh")


def entry_for(spec, system):
    """The registry entry a spec was created from, or None for unregistered specs."""
    if isinstance(spec, StrategyInstance):
        return None
    return system.registry.entry_of(spec)


def check_available(spec, system):
    entry = entry_for(spec, system)
    if entry is None:
        return
    reason = entry.unavailable_reason()
    if reason is None:
        return
    if entry.backend_reason():
        from .backend import keras_backend

        backend = keras_backend()
        working = sorted(e.name for e in system.registry.entries.values()
                         if e.kind == entry.kind and (not e.backends or backend in e.backends))
        raise BackendError(f"distribute={entry.name!r} cannot run here: {reason}. The {entry.kind} plugins that "
                           f"work on {backend!r}: {', '.join(working) or '(none)'}.")
    raise PluginUnavailableError(f"distribute={entry.name!r} cannot run here: {reason}.")
