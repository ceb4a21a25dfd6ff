"""The non-TensorFlow strategy contract (``kerasdist.StrategyLike``): a third-party plugin whose
``kerasdist_create_strategy`` returns an object with nothing but ``scope()`` trains with fit, evaluate
and predict, as plain Keras does; an object without ``scope()`` is refused at compile."""

import contextlib
import dataclasses

import keras
import numpy as np
import pytest

import kerasdist


class MinimalStrategy:
    """Only what the contract asks for: ``scope()``. Records what ran inside it."""

    def __init__(self):
        self.active, self.entries = 0, []

    @contextlib.contextmanager
    def scope(self):
        self.active += 1
        try:
            yield self
        finally:
            self.active -= 1


@dataclasses.dataclass
class Minimal(kerasdist.StrategySpec):
    pass


class MinimalPlugin:
    """A third party's strategy plugin, registered in-process."""

    def __init__(self, strategy):
        self.strategy = strategy

    @kerasdist.hookimpl
    def kerasdist_register_strategies(self, register):
        register("minimal", Minimal, description="a strategy meeting only kerasdist.StrategyLike", backends=())

    @kerasdist.hookimpl
    def kerasdist_create_strategy(self, spec):
        return self.strategy if isinstance(spec, Minimal) else None

    @kerasdist.hookimpl
    def kerasdist_prepare_model(self, model, strategy, spec):
        if isinstance(spec, Minimal):
            strategy.entries.append(("prepare_model", strategy.active))

    @kerasdist.hookimpl
    def kerasdist_adjust_call(self, method, strategy, spec):
        if isinstance(spec, Minimal):
            strategy.entries.append((method, strategy.active))

    @kerasdist.hookimpl
    def kerasdist_run_call(self, method, call, call_kwargs, strategy, spec):
        if isinstance(spec, Minimal):
            with strategy.scope():  # the core does not enter it around Keras's own loop
                return call(**call_kwargs)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    return x, (x @ rng.normal(size=(4, 1))).astype("float32")


def _train(distribute):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], distribute=distribute)
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history, model.evaluate(x, y, verbose=0), model.predict(x, verbose=0)


def test_a_strategy_with_only_scope_trains_evaluates_and_predicts_as_plain_keras(fresh_system):
    strategy = MinimalStrategy()
    fresh_system.add_plugin(MinimalPlugin(strategy), name="minimal-plugin")
    assert isinstance(strategy, kerasdist.StrategyLike) and not hasattr(strategy, "num_replicas_in_sync")

    model, history, evaluated, predicted = _train("minimal")
    plain, plain_history, plain_evaluated, plain_predicted = _train(None)

    assert kerasdist.strategy_of(model) is strategy
    assert strategy.entries == [("prepare_model", 1), ("fit", 1), ("evaluate", 1), ("predict", 1)]
    assert strategy.active == 0  # every scope was left
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(evaluated, plain_evaluated, rtol=1e-6)
    np.testing.assert_allclose(predicted, plain_predicted, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_strategy_without_scope_is_refused_at_compile_naming_the_spec(fresh_system):
    fresh_system.add_plugin(MinimalPlugin(object()), name="minimal-plugin")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(kerasdist.PluginValidationError, match=r"returned object for Minimal\(.*no scope\(\).*StrategyLike"):
        model.compile(optimizer="sgd", loss="mse", distribute="minimal")
