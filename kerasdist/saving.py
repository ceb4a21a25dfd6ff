"""``distribute=`` survives ``model.save`` / ``keras.models.load_model`` (``keras.models.clone_model`` still
returns a plain-compiled copy).

Keras saves ``model.get_compile_config()`` and calls ``compile_from_config`` on load. kerasdist adds the
plan to that config under the key :data:`KEY` of the optimizer's entry, beside its ``class_name`` and
``config``: stock Keras reads only the keys it knows there, so the file still loads (compiled plain)
where kerasdist is not installed. On load the model is compiled with the plan again when its plugins
can run there (one log line says so), else plain (one log line says why).

Only registered plugins' specs whose options are plain values (names, numbers, lists of strings) travel.
A ``tf.distribute.Strategy`` object, or an option such as ``prune(layers=<function>)``, does not: the
file then carries no plan at all (it loads plain) and the first save says so.
"""

import contextlib
import dataclasses
import logging
import math
import numbers
import threading

from .errors import KerasdistError
from .specs import Plan, StrategyInstance

KEY = "kerasdist_distribute"
log = logging.getLogger("kerasdist")
_state = threading.local()


def add_plan(model, config):
    """``config`` (a model's serialized compile config) with the model's plan, when it can travel."""
    from .session import session_of

    session = session_of(model)
    if session is None or not isinstance(config, dict) or not isinstance(config.get("optimizer"), dict):
        return config
    records = plan_record(session)
    if records is not None:
        config["optimizer"][KEY] = _state.handed_out = records
    return config


def plan_record(session):
    """The session's plan as ``[{"name": ..., "options": {...}}, ...]``, or None (noted once) when a spec
    cannot be saved."""
    from .resolve import entry_for

    records = []
    for spec in session.plan.specs:
        why = None
        if isinstance(spec, StrategyInstance):
            why = f"a {spec.name} object cannot be saved; pass a plugin name or spec such as 'mirrored' instead"
        elif entry_for(spec, session.system) is None or not dataclasses.is_dataclass(spec):
            why = f"{spec.name!r} is not a registered plugin's spec"
        else:
            options = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
            bad = next((name for name, value in options.items() if _plain(value) is _NOT_PLAIN), None)
            if bad is not None:
                why = f"its option {bad}={options[bad]!r} cannot be saved"
            else:
                records.append({"name": spec.name, "options": {k: _plain(v) for k, v in options.items()}})
        if why is not None:
            if not getattr(session, "save_noted", False):
                session.save_noted = True
                log.warning("kerasdist: distribute=%s is not saved with the model (%s); keras.models.load_model "
                            "will return it compiled without distribute=.", session.plan.describe(), why)
            return None
    return records


_NOT_PLAIN = object()


def _plain(value):
    """``value`` as JSON (lists for tuples), or ``_NOT_PLAIN``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else _NOT_PLAIN
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if any(i is _NOT_PLAIN for i in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _NOT_PLAIN if any(i is _NOT_PLAIN for i in items.values()) else items
    return _NOT_PLAIN


def take_plan(model, config):
    """``(config without the plan, the Plan to compile with or None)``; a plan that cannot run here is
    logged and dropped (the model then compiles plain)."""
    optimizer = config.get("optimizer") if isinstance(config, dict) else None
    if not isinstance(optimizer, dict) or KEY not in optimizer:
        return config, None
    config = {**config, "optimizer": {k: v for k, v in optimizer.items() if k != KEY}}
    if getattr(_state, "plain", False) or optimizer[KEY] is getattr(_state, "handed_out", None):
        return config, None  # load_plain; or clone_model, which hands get_compile_config's dict over as is:
        # a clone stays a plain-compiled copy, not bound to the strategy (how a bound model gets a free copy)
    try:
        return config, _restored_plan(optimizer[KEY])
    except (KerasdistError, TypeError, KeyError) as exc:
        log.warning("kerasdist: model %r was saved with distribute=%s, which cannot run here (%s); it is "
                    "compiled without distribute=.", model.name, _describe(optimizer[KEY]), exc)
        return config, None


def _restored_plan(records):
    from .manager import get_system
    from .resolve import resolve_plan
    from .session import strategy_for

    system = get_system()
    cluster = system.detect_cluster()
    specs = [system.registry.get(record["name"]).create(**record.get("options", {})) for record in records]
    plan = resolve_plan(Plan.combine(specs), system, cluster)
    strategy_for(plan.strategy, cluster, system)  # devices missing here, a conflicting strategy: refused now
    return plan


def _describe(records):
    try:
        return " + ".join(repr(record["name"]) for record in records)
    except (TypeError, KeyError):
        return repr(records)


@contextlib.contextmanager
def restoring(model, plan):
    """While Keras's ``compile_from_config`` runs, a plain ``compile`` of ``model`` uses ``plan``, and the
    optimizer Keras builds right after it is built under the plan's strategy."""
    from .manager import get_system
    from .session import strategy_for

    system = get_system()
    previous = getattr(_state, "pending", None)
    _state.pending = (model, plan)
    try:
        with strategy_for(plan.strategy, system.detect_cluster(), system).scope():
            yield
    finally:
        _state.pending = previous
    log.warning("kerasdist: model %r is compiled with distribute=%r, as it was saved (kerasdist.load_plain(path) "
                "loads it without).", model.name, plan.describe())


def pending_plan(model):
    """The plan a ``compile`` of ``model`` called by ``compile_from_config`` restores, or None."""
    pending = getattr(_state, "pending", None)
    return pending[1] if pending is not None and pending[0] is model else None


def load_plain(filepath, **kwargs):
    """``keras.models.load_model(filepath, **kwargs)``, compiled as saved but without its ``distribute=``."""
    import keras

    previous = getattr(_state, "plain", False)
    _state.plain = True
    try:
        return keras.models.load_model(filepath, **kwargs)
    finally:
        _state.plain = previous
