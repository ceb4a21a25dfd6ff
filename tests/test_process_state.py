"""kerasdist.process_state: one home for process-wide state and the one reset tests use."""

import pytest

from kerasdist import KerasdistError, process_state


@pytest.fixture
def names():
    made = []
    yield made
    for name in made:  # kept slots made here would outlive the test otherwise
        process_state._slots.pop(name, None)


def test_a_slot_is_made_once_and_reset_makes_it_anew(names):
    names.append("test.counter")
    first = process_state.slot("test.counter", list)
    first.append(1)
    assert process_state.slot("test.counter", list) is first and "test.counter" in process_state.names()
    process_state.reset()
    again = process_state.slot("test.counter", list)
    assert again == [] and again is not first


def test_a_kept_slot_survives_reset_and_callbacks_run(names):
    names.append("test.patches")
    kept = process_state.slot("test.patches", dict, keep=True)
    calls = []
    callback = process_state.on_reset(lambda: calls.append("reset"))
    try:
        process_state.on_reset(callback)  # registered once
        process_state.reset()
        assert process_state.slot("test.patches", dict, keep=True) is kept and calls == ["reset"]
        assert "test.patches" in process_state.names(kept=True)
        assert "test.patches" not in process_state.names(kept=False)
    finally:
        process_state._callbacks.remove(callback)


def test_reset_builds_a_new_plugin_system_on_next_use():
    from kerasdist.manager import get_system, reset_system

    before = get_system()
    try:
        process_state.reset()
        assert get_system() is not before and get_system() is get_system()
    finally:
        reset_system(before)


@pytest.mark.parametrize("call,match", [
    (lambda: process_state.slot("", dict), "name=''"),
    (lambda: process_state.slot(3, dict), "name=3"),
    (lambda: process_state.slot("test.bad", {}), "factory={}"),
    (lambda: process_state.on_reset("nope"), "callback='nope'"),
])
def test_bad_input_is_one_clear_error(call, match):
    with pytest.raises(KerasdistError, match=match):
        call()


def test_one_name_is_one_slot(names):
    names.append("test.once")
    process_state.slot("test.once", dict)
    with pytest.raises(KerasdistError, match="'test.once'.*keep=False"):
        process_state.slot("test.once", dict, keep=True)


def test_plugins_reach_it_through_the_toolkit():
    from kerasdist.plugin_tools import process_state as from_toolkit

    assert from_toolkit is process_state


def test_reset_forgets_the_strategy_cache_and_models_compiled_before_still_train():
    """After a reset a compile creates its strategy anew; it gets collective keys of its own, so the model
    compiled before (on the old strategy) and the new one both train (no "Shape mismatch in the
    collective instance")."""
    import keras
    import numpy as np

    def compiled(width):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(width), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", distribute="mirrored")
        return model

    x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
    before = compiled(4)
    assert kerasdist_strategy(compiled(4)) is kerasdist_strategy(before)  # cached
    process_state.reset()
    after = compiled(7)
    assert kerasdist_strategy(after) is not kerasdist_strategy(before)
    for model in (before, after, before):
        model.fit(x, y, batch_size=8, verbose=0)


def kerasdist_strategy(model):
    import kerasdist

    return kerasdist.strategy_of(model)
