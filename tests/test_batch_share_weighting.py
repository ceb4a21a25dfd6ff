"""set_batch_share_weighting (kerasdist/_keras_internals/training.py): what a caller leaves out stays as set
before, and the train step is retraced only when something changed. In one process, no training."""

from kerasdist._keras_internals import training


class Model:
    def __init__(self, replicas, sum_counts):
        self._kerasdist_uneven = training._BatchShare(replicas, sum_counts)
        self.train_function = "traced"


class Ring:
    def sum_count(self, count):
        return count


def test_left_out_row_count_settings_stay_and_only_a_change_retraces():
    ring = Ring()
    model = Model(2, ring.sum_count)
    training.set_batch_share_weighting(model, True)  # replicas and sum_counts left out: kept
    assert (model._kerasdist_uneven.replicas, model._kerasdist_uneven.sum_counts) == (2, ring.sum_count)
    assert model.train_function == "traced"
    training.set_batch_share_weighting(model, True, replicas=2, sum_counts=ring.sum_count)  # the same bound method
    assert model.train_function == "traced"
    training.set_batch_share_weighting(model, True, replicas=2, sum_counts=Ring().sum_count)  # another ring's
    assert model.train_function is None and model._kerasdist_uneven.sum_counts != ring.sum_count
    model.train_function = "traced"
    training.set_batch_share_weighting(model, True, replicas=None, sum_counts=None)  # the strategy's all-reduce
    assert model.train_function is None and model._kerasdist_uneven.sum_counts is None
