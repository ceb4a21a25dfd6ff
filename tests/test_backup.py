"""The multiworker backup is private, this job's own, and checked before it is read (in-process parts;
the kill-and-resume run is in test_multiworker.py)."""

import dataclasses
import json
import os
import stat

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist
from kerasdist.plugin_tools import int_pieces, private_backups
from kerasdist_plugins.multiworker import backup, strategy_free

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a folder owned by another user")


@dataclasses.dataclass
class Spec:
    backup_dir: str = None


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(loss="mse", optimizer="sgd")
    return model


def _add(folder, model=None, chief=True, scratch=None):
    model = model or _model()
    call_kwargs = {"callbacks": []}
    backup.add_backup(call_kwargs, Spec(str(folder)), model, tf.distribute.get_strategy(), 0, chief,
                      str(scratch or folder.parent / "scratch"))
    return call_kwargs["callbacks"][0], model


def _plant(folder, identity, epoch=3):
    folder.mkdir(parents=True, exist_ok=True)
    _model().save_weights(str(folder / "latest.weights.h5"))
    (folder / "training_metadata.json").write_text(json.dumps({"epoch": epoch, "batch": -1}))
    if identity is not None:
        (folder / backup.IDENTITY_FILE).write_text(json.dumps(identity))


def test_a_folder_others_may_write_is_refused_and_never_read(tmp_path):
    folder = tmp_path / "shared"
    _plant(folder, None)
    os.chmod(folder, 0o777)
    with pytest.raises(kerasdist.KerasdistError, match=r"refusing the backup folder .*shared: others may write it "
                                                        r"\(mode 777\)") as info:
        _add(folder)
    assert "backup_dir=" in str(info.value) and "KERASDIST_BACKUP_DIR" in str(info.value)


@needs_root
def test_a_folder_owned_by_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    _plant(folder, None)
    os.chmod(folder, 0o700)
    os.chown(folder, 12345, 12345)
    with pytest.raises(kerasdist.KerasdistError, match=r"belongs to user id 12345, not to you"):
        _add(folder)


def test_a_link_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(kerasdist.KerasdistError, match="is not a folder"):
        backup.private_folder(str(tmp_path / "link"))


def test_an_unwritable_folder_fails_before_training(tmp_path):
    with pytest.raises(kerasdist.KerasdistError, match="cannot create the backup folder /proc/kerasdist"):
        backup.private_folder("/proc/kerasdist/backup")


def test_new_backups_are_private(tmp_path):
    folder = tmp_path / "new"
    callback, model = _add(folder)
    seen = {}

    class Modes(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.update({name: stat.S_IMODE(os.stat(folder / name).st_mode) for name in os.listdir(folder)})
            seen["(folder)"] = stat.S_IMODE(os.stat(folder).st_mode)

    model.fit(np.ones((8, 3)), np.ones((8, 2)), epochs=2, verbose=0, callbacks=[callback, Modes()])
    assert seen.pop("(folder)") == 0o700
    assert {"latest.weights.h5", "training_metadata.json", backup.IDENTITY_FILE} <= set(seen)
    assert set(seen.values()) == {0o600}, seen


def test_the_default_root_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = backup.default_root()
    assert root == str(tmp_path / "cache" / "kerasdist" / "backups")
    backup.private_folder(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_this_jobs_backup_is_resumed_with_one_line(tmp_path, capsys):
    model = _model()
    identity = backup.job_identity(model, tf.distribute.get_strategy())
    _plant(tmp_path / "mine", identity, epoch=3)
    callback, _ = _add(tmp_path / "mine", model)
    assert capsys.readouterr().out == f"kerasdist: resuming at epoch 4 from this job's backup in {tmp_path / 'mine'}\n"
    callback.set_model(model)
    callback.on_train_begin()
    assert model._initial_epoch == 3


@pytest.mark.parametrize("change", ["script_sha256", "replicas", "model_sha256", None],
                         ids=["edited-script", "other-cluster-size", "other-model", "no-identity"])
def test_another_jobs_backup_is_ignored_with_one_line(tmp_path, capsys, change):
    model = _model()
    identity = backup.job_identity(model, tf.distribute.get_strategy())
    planted = None if change is None else {**identity, change: "something else"}
    _plant(tmp_path / "b", planted, epoch=3)
    callback, _ = _add(tmp_path / "b", model)
    out = capsys.readouterr().out
    assert out.startswith(f"kerasdist: ignoring the backup in {tmp_path / 'b'}: another job wrote it")
    assert (change or "no kerasdist job identity") in out and out.count("\n") == 1
    assert not (tmp_path / "b" / "latest.weights.h5").exists()  # never read, replaced
    callback.set_model(model)
    callback.on_train_begin()
    assert getattr(model, "_initial_epoch", 0) in (0, None)


def test_a_non_chief_never_reads_another_jobs_backup(tmp_path, capsys):
    model = _model()
    _plant(tmp_path / "b", None, epoch=3)
    callback, _ = _add(tmp_path / "b", model, chief=False)
    assert capsys.readouterr().out == ""  # the chief speaks
    assert str(tmp_path / "b") not in callback.backup_dir


def test_a_worker_looking_while_the_chief_resumes_sees_the_backup(tmp_path, monkeypatch):
    """The chief rewrites the identity file as it resumes, while the other workers read it (a Ray retry's workers
    start fit together): one that read it truncated took the backup for another job's and trained from epoch 0
    while the chief resumed at epoch 2 (tests/test_ray.py, once under load)."""
    model = _model()
    identity = backup.job_identity(model, tf.distribute.get_strategy())
    _plant(tmp_path / "mine", identity, epoch=3)
    callback, _ = _add(tmp_path / "mine", model)
    seen, dump = [], json.dump

    def dump_while_a_worker_looks(*args, **kwargs):
        seen.append(private_backups.inspect(str(tmp_path / "mine"), identity))
        return dump(*args, **kwargs)

    monkeypatch.setattr(json, "dump", dump_while_a_worker_looks)
    callback.set_model(model)
    callback.on_train_begin()
    assert seen and set(seen) == {("resume", 3)}, seen
    assert model._initial_epoch == 3
    assert sorted(os.listdir(tmp_path / "mine")) == sorted(["latest.weights.h5", "training_metadata.json",
                                                            backup.IDENTITY_FILE])  # no temporary file left


class TwoWorkerRing:
    """The ring as rank 0 of two sees it, the other worker having begun fit at ``other_epoch``."""

    rank, size = 0, 2

    def __init__(self, other_epoch):
        self.other = int_pieces(other_epoch)

    def sum_arrays(self, mine, squares):
        return mine + self.other, squares + self.other ** 2


def test_workers_beginning_fit_at_different_epochs_stop_with_one_error():
    """What the race above led to: the chief resumed at epoch 2 while the other worker began at 0, their steps
    paired up, and the run failed later (the chief done, the other waiting) or trained on."""
    callback = strategy_free.BroadcastFromRankZero(TwoWorkerRing(0))
    callback.began = False  # as on_train_begin leaves it, after the broadcast of rank 0's weights
    with pytest.raises(kerasdist.KerasdistError, match=r"different epochs \(worker 0: epoch 2\).*backup_dir"):
        callback.on_epoch_begin(2)
    callback = strategy_free.BroadcastFromRankZero(TwoWorkerRing(2))
    callback.began = False
    callback.on_epoch_begin(2)
    callback.on_epoch_begin(3)  # checked once, at fit's first epoch


def test_a_truncated_backup_names_the_folder_to_delete(tmp_path):
    model = _model()
    identity = backup.job_identity(model, tf.distribute.get_strategy())
    _plant(tmp_path / "t", identity)
    weights = tmp_path / "t" / "latest.weights.h5"
    weights.write_bytes(weights.read_bytes()[:200])
    callback, _ = _add(tmp_path / "t", model)
    callback.set_model(model)
    with pytest.raises(kerasdist.KerasdistError, match=r"cannot be read .* truncated or corrupt .* rm -r") as info:
        callback.on_train_begin()
    assert str(tmp_path / "t") in str(info.value)
