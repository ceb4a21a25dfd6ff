"""Do the ranks start the same call? (issue 35 item 2) — kerasdist.agreement's fingerprint and error, in this process:
each rank's row is made by the same check_agreement a rank runs, and the "all-reduce" adds the other ranks' rows.
The launched case (rank 1 leaves a fit for the next trial's model) is test_multiworker_strategy_free's 'diverged'."""

import numpy as np
import pytest


def _model(name, units=2):
    import keras

    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)], name=name)


def _rows(calls, size=2):
    """Each rank's row of the table: ``calls[rank]`` is (method, model, call_kwargs), checked as rank ``rank``."""
    from kerasdist import process_state
    from kerasdist.agreement import check_agreement

    rows = []
    for rank, (method, model, kwargs) in enumerate(calls):
        process_state.reset()  # each rank its own process's counts
        seen = {}

        def keep(table, seen=seen, rank=rank):
            seen["row"] = np.array(table[rank])
            raise StopIteration

        with pytest.raises(StopIteration):
            check_agreement(method, model, dict(kwargs), rank=rank, size=size, sum_arrays=keep, word="multiworker")
        rows.append(seen["row"])
    return rows


def _check_as_rank_zero(calls):
    from kerasdist import process_state
    from kerasdist.agreement import check_agreement

    rows = _rows(calls)
    process_state.reset()
    method, model, kwargs = calls[0]
    kwargs = dict(kwargs)
    check_agreement(method, model, kwargs, rank=0, size=len(calls), word="multiworker",
                    sum_arrays=lambda table: [table + sum(np.eye(len(calls))[r][:, None] * rows[r]
                                                          for r in range(1, len(calls)))])
    return kwargs


def test_the_same_call_passes_and_fit_adds_an_epoch_check():
    model = _model("same")
    kwargs = _check_as_rank_zero([("fit", model, {"epochs": 2, "batch_size": 8})] * 2)
    assert type(kwargs["callbacks"][-1]).__name__ == "EpochAgreement"


@pytest.mark.parametrize("case", ["other_model", "other_arguments", "other_method", "tuner_trial"])
def test_ranks_in_different_calls_raise_one_error_naming_both(case):
    """Before: nothing compared them; their collectives paired across calls (an abort, a hang, or two models'
    gradients averaged together, silently where the shapes matched)."""
    import keras

    from kerasdist import KerasdistError

    first = ("fit", _model("trial_1"), {"epochs": 2})
    second = {"other_model": ("fit", _model("trial_2", units=3), {"epochs": 2}),
              "other_arguments": ("fit", first[1], {"epochs": 3}),
              "other_method": ("evaluate", first[1], {}),
              "tuner_trial": ("fit", _model("trial_2"), {"epochs": 2})}[case]
    if case == "tuner_trial":  # KerasTuner's SaveBestEpoch writes under trial_<id>
        save = type("SaveBestEpoch", (keras.callbacks.Callback,), {"__module__": "keras_tuner.engine.tuner_utils"})
        first, second = [(m, model, {**kw, "callbacks": [save()]}) for m, model, kw in (first, second)]
        first[2]["callbacks"][0].filepath = "/tmp/project/trial_01/checkpoint.weights.h5"
        second[2]["callbacks"][0].filepath = "/tmp/project/trial_02/checkpoint.weights.h5"
        first[2]["epochs"] = 2
    with pytest.raises(KerasdistError) as raised:
        _check_as_rank_zero([first, second])
    text = str(raised.value)
    assert text.startswith("distribute='multiworker': the ranks are not in the same call: ")
    if case == "tuner_trial":
        assert "rank 1 is in trial 2, rank 0 in trial 1" in text
    want = {"other_model": "rank 1 is in fit #1 of model 'trial_2' (its start), call 1 of its process, rank 0 in "
                           "fit #1 of model 'trial_1' (its start), call 1 of its process (the model (its layers or "
                           "variable shapes) differ)",
            "other_arguments": "(the call's arguments differ)",
            "other_method": "rank 1 is in evaluate #1 of model 'trial_1'",
            "tuner_trial": "rank 1 is in fit #1 of model 'trial_2'"}[case]
    assert want in text, text


def test_one_process_and_predict_are_not_checked():
    from kerasdist.agreement import check_agreement

    def never(*arrays):
        raise AssertionError("no collective")

    model = _model("alone")
    check_agreement("fit", model, {}, rank=0, size=1, sum_arrays=never, word="multiworker")
    check_agreement("predict", model, {}, rank=0, size=2, sum_arrays=never, word="multiworker")


def test_epoch_check_at_the_end_announces_the_next_epoch_but_not_after_the_last():
    """JAX over several processes (plugins/keras_distribution/processes.py): Keras resets the metrics (a collective
    there) before on_epoch_begin, so the next epoch is checked at the end of the one before (before: a rank that left
    the fit met that reset: gloo's 'Received data size doesn't match expected size', an abort)."""
    from kerasdist import process_state
    from kerasdist.agreement import check_agreement

    process_state.reset()
    seen = []

    def keep(table):  # rank 1 in the same call: its row is rank 0's
        seen.append(int(table[0][3]))
        return [table + table[[0]] * np.array([[0.0], [1.0]])]

    kwargs = {"epochs": 3}
    check_agreement("fit", _model("end"), kwargs, rank=0, size=2, sum_arrays=keep, word="data_parallel",
                    epoch_check="end")
    callback = kwargs["callbacks"][-1]
    callback.set_params({"epochs": 3})
    for epoch in range(3):
        callback.on_epoch_begin(epoch)
        callback.on_epoch_end(epoch)
    assert seen == [-1, 1, 2]
