"""The ray_train plugin's decisions without starting Ray (tests/test_ray.py runs a real local Ray): the identity
of fit's backup under Ray, which models rank 0 cannot save alone, and how kerasdist's errors travel to Ray's
driver (pickled)."""

import pickle
import sys

import keras
import pytest

import kerasdist
from kerasdist_plugins import ray_train


class TrainContext:
    """Ray Train's context as a training function sees it: V1 inside a Tune trial gives the trial, V2 raises."""

    def __init__(self, trial_id=None, trial_name=None, experiment="tune_run", world_size=2):
        self.trial_id, self.trial_name, self.experiment, self.world_size = trial_id, trial_name, experiment, world_size

    def get_experiment_name(self):
        return self.experiment

    def get_world_size(self):
        return self.world_size

    def get_trial_id(self):
        if self.trial_id is None:
            raise DeprecationWarning("get_trial_id is deprecated in Ray Train V2")
        return self.trial_id

    def get_trial_name(self):
        if self.trial_name is None:
            raise DeprecationWarning("get_trial_name is deprecated in Ray Train V2")
        return self.trial_name


def test_trials_of_one_tune_experiment_get_their_own_backup():
    first, second = ray_train.backup_identity(TrainContext("a1")), ray_train.backup_identity(TrainContext("b2"))
    assert first == ["ray-train", "tune_run", "a1", 2] and first != second
    assert ray_train.backup_identity(TrainContext(trial_name="trial_0")) == ["ray-train", "tune_run", "trial_0", 2]
    assert ray_train.backup_identity(TrainContext()) == ["ray-train", "tune_run", 2]  # Train V2, no Tune: the run


class SplitArray:
    """What a JAX array sharded over processes answers (one process cannot be given here)."""
    is_fully_addressable = False
    is_fully_replicated = False


class Variable:
    def __init__(self, value):
        self.value = value


class Model:
    def __init__(self, *values):
        self.variables = [Variable(value) for value in values]


def test_which_models_rank_0_cannot_save_alone():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    assert not ray_train.split_across_processes(model)
    replicated = SplitArray()
    replicated.is_fully_replicated = True  # data parallel JAX over processes: every process holds all of it
    assert not ray_train.split_across_processes(Model(replicated))
    assert ray_train.split_across_processes(Model(replicated, SplitArray()))


def test_rank_0_reports_a_split_model_without_a_checkpoint_and_says_why_once():
    callback = ray_train._report_to_ray(0)
    callback.set_model(Model(SplitArray()))
    with pytest.warns(UserWarning, match="split across processes") as warned:
        callback.on_train_begin()
    assert not callback.checkpoints and len(warned) == 1
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    callback.set_model(model)
    callback.on_train_begin()
    assert callback.checkpoints


def test_a_kerasdist_error_reaches_the_driver_with_its_message_even_from_a_failed_import(monkeypatch):
    """Ray pickles a worker's error for the driver. A ClusterConfigError of the join at ``import kerasdist`` left
    the package out of sys.modules, so pickle could not name its class ("Can't pickle ...: import of module
    'kerasdist.errors' failed") and the message was lost; a subclass taking other arguments did not unpickle."""
    unknown = kerasdist.UnknownPluginError("mirorred", ["mirrored"])
    again = pickle.loads(pickle.dumps(unknown))
    assert type(again) is kerasdist.UnknownPluginError and str(again) == str(unknown)
    assert again.available == ["mirrored"]
    assert type(pickle.loads(pickle.dumps(kerasdist.ClusterConfigError("x")))) is kerasdist.ClusterConfigError

    monkeypatch.setitem(sys.modules, "kerasdist", None)  # what a failed `import kerasdist` leaves
    sent = pickle.loads(pickle.dumps(kerasdist.ClusterConfigError("Port 5 of worker 0 is already in use")))
    assert type(sent) is ValueError
    assert str(sent) == "kerasdist.errors.ClusterConfigError: Port 5 of worker 0 is already in use"
