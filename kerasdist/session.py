"""What ``compile(distribute=...)`` does, and how fit/evaluate/predict then run."""

import contextlib
import inspect
import sys
import threading

from . import _keras_internals as internals
from . import process_state
from ._keras_internals.collectives import keep_collectives_apart
from .batch_split import input_kind
from .errors import KerasdistError, PluginValidationError, StrategyConflictError
from .manager import get_system
from .resolve import is_tf_strategy, resolve_plan
from .specs import StrategyInstance, spec_key

_inside_keras = threading.local()  # per call (Keras's own nested fit/evaluate), not process state
_strategies_lock = threading.Lock()


class _Strategies:
    """The strategies this process created, by spec key, and the local ones that run collective ops:
    ``(spec, strategy, devices)``. Reset by ``process_state.reset()``: every later compile creates its
    strategy anew, and a new MirroredStrategy gets collective keys of its own (``keep_collectives_apart``),
    so it cannot disturb the strategies of models compiled before."""

    def __init__(self):
        self.by_key, self.collective_owners = {}, []


def _created():
    return process_state.slot("kerasdist.strategies", _Strategies)


def strategy_for(spec, cluster, system):
    """The strategy for ``spec``, created once per process (collective ops allow no second set-up)."""
    if spec is None:
        return current_strategy()
    if isinstance(spec, StrategyInstance):
        check_local_devices(spec.strategy)
        keep_collectives_apart(spec.strategy)
        return spec.strategy
    key = spec_key(spec)
    with _strategies_lock:
        strategies = _created().by_key
        if key not in strategies:
            strategy = system.hook.kerasdist_create_strategy(spec=spec, cluster=cluster)
            if strategy is None:
                raise PluginValidationError(
                    f"Strategy {spec.name!r} is registered but no plugin's kerasdist_create_strategy "
                    f"returned a strategy for {spec!r}.")
            _check_strategy_like(spec, strategy)
            _check_no_collective_overlap(spec, strategy)
            keep_collectives_apart(strategy)
            strategies[key] = strategy
        return strategies[key]


def _check_no_collective_overlap(spec, strategy):
    """Two MirroredStrategy objects over shared devices abort each other's collective ops (each numbers
    its collectives from 1): refuse the second, naming the first."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(strategy, tf.distribute.MirroredStrategy) or strategy.num_replicas_in_sync < 2:
        return
    from .devices import canonical_devices

    devices = set(canonical_devices(strategy.extended.worker_devices))
    owners = _created().collective_owners
    for other_spec, _, other_devices in owners:
        shared = devices & other_devices
        if shared:
            raise StrategyConflictError(
                f"distribute={spec!r} would create a second MirroredStrategy over {sorted(shared)}, which "
                f"{other_spec!r} already uses in this process; TensorFlow's collective ops cannot serve two "
                "strategies on the same devices (they abort each other). Use the same options as before, or "
                "train the other configuration in another process.")
    owners.append((spec, strategy, devices))


def _check_strategy_like(spec, strategy):
    if not is_tf_strategy(strategy) and not callable(getattr(strategy, "scope", None)):
        raise PluginValidationError(
            f"kerasdist_create_strategy returned {type(strategy).__name__} for {spec!r}, which has no scope() "
            "method: return a tf.distribute.Strategy or an object meeting kerasdist.StrategyLike (a scope() "
            "context manager).")


class NoStrategy:
    """What an optimization used alone runs under on a backend without tf.distribute: one device."""

    num_replicas_in_sync = 1

    def scope(self):
        return contextlib.nullcontext()


def current_strategy():
    """The strategy (TensorFlow) or distribution (JAX: the user's ``set_distribution``) in effect, or
    :class:`NoStrategy`."""
    from .backend import keras_backend

    if keras_backend() == "tensorflow":
        import tensorflow as tf

        return tf.distribute.get_strategy()
    import keras

    return keras.distribution.distribution() or NoStrategy()


def check_local_devices(strategy):
    """A user's own single-machine Strategy over devices this machine lacks hangs in ``fit``
    (``MirroredStrategy(["/gpu:0", "/gpu:1"])`` without GPUs): refuse it at compile."""
    if not is_tf_strategy(strategy):
        return
    import tensorflow as tf

    local_kinds = (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy,
                   tf.distribute.experimental.CentralStorageStrategy)
    if isinstance(strategy, local_kinds):
        from .devices import check_devices_exist

        check_devices_exist(list(strategy.extended.worker_devices), plugin=f"distribute={type(strategy).__name__}")


class Session:
    """A model's distribution: the plan, the strategy and the cluster it runs on."""

    def __init__(self, plan, strategy, cluster, system):
        self.plan, self.strategy, self.cluster, self.system = plan, strategy, cluster, system

    def each_spec(self, hook_name, **kwargs):
        hook = getattr(self.system.hook, hook_name)
        return [hook(spec=spec, strategy=self.strategy, **kwargs) for spec in self.plan.specs]

    def run(self, method, original, model, args, kwargs):
        if any(m is model for m in getattr(_inside_keras, "models", ())):  # Keras's own nested call
            return original(model, *args, **kwargs)
        call_kwargs = _bind(original, model, args, kwargs)
        _check_not_empty(method, call_kwargs.get("x"))
        call_kwargs["callbacks"] = _callback_list(call_kwargs.get("callbacks"))
        with self.strategy.scope():
            call_kwargs["x"] = self._prepare_dataset(call_kwargs.get("x"), method, model)
            validation = call_kwargs.get("validation_data")
            if method == "fit" and input_kind(validation) is not None:
                call_kwargs["validation_data"] = self._prepare_dataset(validation, "evaluate", model)
            self.each_spec("kerasdist_adjust_call", method=method, call_kwargs=call_kwargs, model=model)

        def call(**kw):
            running = getattr(_inside_keras, "models", ())
            _inside_keras.models = running + (model,)
            try:
                return original(model, **kw)
            finally:
                _inside_keras.models = running

        for spec in self.plan.specs:
            result = self.system.hook.kerasdist_run_call(
                method=method, call=call, call_kwargs=call_kwargs, model=model,
                strategy=self.strategy, spec=spec)
            if result is not None:
                return result
        return call(**call_kwargs)

    def _prepare_dataset(self, value, method, model):
        """Run ``kerasdist_prepare_dataset`` over every spec for an input holding whole batches (see
        :func:`input_kind`; in-memory arrays pass through)."""
        kind = input_kind(value)
        if kind is None:
            return value
        for spec in self.plan.specs:
            replaced = self.system.hook.kerasdist_prepare_dataset(
                dataset=value, kind=kind, method=method, model=model, strategy=self.strategy, spec=spec)
            if replaced is not None:
                value, kind = replaced, input_kind(replaced)
                if kind is None:
                    break
        return value


def _check_not_empty(method, x):
    """An input with no example fails here, with its name, not deep inside a strategy's input pipeline."""
    if _is_dataset(x):
        if int(x.cardinality()) == 0:
            raise KerasdistError(f"{method}: the tf.data.Dataset given as x is empty (0 batches); give a dataset "
                                 "with at least one batch.")
        return
    from .plugin_tools import first_array

    shape = getattr(first_array(x), "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] == 0:
        raise KerasdistError(f"{method}: x has 0 examples (shape {tuple(shape)}); give at least one example.")


def _callback_list(callbacks):
    """The user's callbacks as a plain list (Keras also accepts a CallbackList)."""
    import keras

    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    return list(callbacks or [])


def _is_dataset(value):
    from .plugin_tools import is_dataset

    return is_dataset(value)


def _bind(function, model, args, kwargs):
    """The call's arguments as one keyword dict (extra ``**kwargs`` merged in, ``self`` dropped)."""
    signature = inspect.signature(function)
    arguments = dict(signature.bind(model, *args, **kwargs).arguments)
    arguments.pop(next(iter(signature.parameters)))
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def plain_recompile(model, original_compile, args, kwargs, previous_session):
    """compile() without distribute= on a model kerasdist compiled (or load_model restored) under a
    tf.distribute strategy: kerasdist steps aside, and the model keeps that strategy as Keras keeps the
    strategy of a model built in a scope; an optimizer made outside it is moved under it, as Keras would
    have made it there (else Keras fails inside fit with "Mixing different tf.distribute.Strategy objects")."""
    strategy = internals.bound_strategy(model)
    if previous_session is None or strategy is None or not is_tf_strategy(previous_session.strategy):
        return original_compile(model, *args, **kwargs)
    compile_kwargs = _bind(original_compile, model, args, kwargs)
    internals.move_to_strategy(model, strategy, _optimizer_under(strategy, compile_kwargs))
    with strategy.scope():
        return original_compile(model, **compile_kwargs)


def _optimizer_under(strategy, compile_kwargs):
    """compile's optimizer (a name, a config or an instance) made under ``strategy``'s scope, as Keras makes
    it inside a scope; put back into ``compile_kwargs`` and returned."""
    import keras

    with strategy.scope():
        compile_kwargs["optimizer"] = keras.optimizers.get(compile_kwargs.get("optimizer", "rmsprop"))
    return compile_kwargs["optimizer"]


def distributed_compile(model, original_compile, args, kwargs, distribute):
    """compile(distribute=...): resolve the plan, move the model, compile under the strategy."""
    system = get_system()
    cluster = system.detect_cluster()
    plan = resolve_plan(distribute, system, cluster)
    strategy = strategy_for(plan.strategy, cluster, system)
    tf_strategy = is_tf_strategy(strategy)
    if tf_strategy:
        _check_not_bound_elsewhere(model, strategy, plan)
        _check_not_inside_another_scope(strategy, plan)

    compile_kwargs = _bind(original_compile, model, args, kwargs)
    if tf_strategy:
        _check_keras_limits(strategy, compile_kwargs)
    optimizer = _optimizer_under(strategy, compile_kwargs)
    if tf_strategy:  # other backends' plugins place the variables in kerasdist_prepare_model
        internals.move_to_strategy(model, strategy, optimizer)

    session = Session(plan, strategy, cluster, system)
    with strategy.scope():
        session.each_spec("kerasdist_prepare_model", model=model)
        session.each_spec("kerasdist_adjust_compile", compile_kwargs=compile_kwargs, model=model)
        original_compile(model, **compile_kwargs)
    model._kerasdist_session = session
    return None


def _check_keras_limits(strategy, compile_kwargs):
    """Refuse, with the fix, settings that stock Keras 3.15 cannot train under ``strategy``."""
    import tensorflow as tf

    steps = compile_kwargs.get("steps_per_execution", 1)
    if (isinstance(steps, int) and steps > 1 and isinstance(strategy, tf.distribute.MirroredStrategy)
            and strategy.num_replicas_in_sync > 1):
        raise KerasdistError(
            f"steps_per_execution={steps} with MirroredStrategy over {strategy.num_replicas_in_sync} replicas "
            "fails inside TensorFlow in Keras 3.15 ('You must feed a value for placeholder tensor'); "
            "use steps_per_execution=1 (the default).")


def _check_not_bound_elsewhere(model, strategy, plan):
    bound = internals.bound_strategy(model)
    if bound is None or bound is strategy:
        return
    import tensorflow as tf

    if bound is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        return
    raise StrategyConflictError(
        f"This model is bound to {type(bound).__name__} (it was built or compiled under that strategy), "
        f"so it cannot be compiled with distribute={plan.describe()!r}. Pass that strategy object as "
        "distribute=, or build the model outside any strategy scope (or clone it with "
        "keras.models.clone_model outside the scope) and compile again.")


def _check_not_inside_another_scope(strategy, plan):
    """compile(distribute=...) inside ``with other.scope()``: TensorFlow refuses to mix two strategies
    (a raw "Mixing different tf.distribute.Strategy objects"); name both and the fix instead."""
    import tensorflow as tf

    current = tf.distribute.get_strategy()
    if not tf.distribute.has_strategy() or current is strategy:
        return
    raise StrategyConflictError(
        f"compile(distribute={plan.describe()!r}) was called inside `with strategy.scope()` of "
        f"{_describe(current)}, but distribute= gives another strategy object, {_describe(strategy)}; TensorFlow "
        "cannot mix two strategies. Call compile outside the scope (kerasdist enters its strategy's scope "
        "itself), or pass the scope's strategy object: distribute=strategy.")


def _describe(strategy):
    """E.g. "MirroredStrategy(['/device:CPU:0', '/device:CPU:1'])"."""
    from .devices import canonical_devices

    devices = getattr(strategy.extended, "worker_devices", None)
    return f"{type(strategy).__name__}({list(canonical_devices(devices))})" if devices else type(strategy).__name__


def session_of(model):
    return getattr(model, "_kerasdist_session", None)
