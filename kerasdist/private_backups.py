"""kerasdist's BackupAndRestore backup of a ``fit`` (multiworker; data_parallel on torch): private, this job's
own, checked before it is read. Plugins use it through ``kerasdist.plugin_tools.private_backups``.

- The folder is private: created 0700 (files 0600) and refused, never read, when another user owns it
  or others can write it (a planted backup would otherwise be resumed).
- A backup is resumed only by the job that wrote it: ``kerasdist-job.json`` holds the job's identity
  (the script's content hash and arguments, the number of replicas, the model's variables and optimizer).
  Resuming prints one line on the chief; a backup of another job is ignored with one line and replaced.
- An unreadable (truncated) backup stops ``fit`` with the folder to delete; the previous epoch's copy is
  kept (``double_checkpoint``) and used first.
"""

import atexit
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile

from . import process_state
from .errors import KerasdistError

#: Where backups go when a spec names no ``backup_dir`` (one folder per job under it).
BACKUP_DIR_VAR = "KERASDIST_BACKUP_DIR"

#: Where a non-chief worker's scratch folder goes (default: the temp dir; ``kerasdist launch`` sets it).
SCRATCH_DIR_VAR = "KERASDIST_SCRATCH_DIR"

IDENTITY_FILE = "kerasdist-job.json"
_KERAS_FILES = ("latest.weights.h5", "training_metadata.json", "latest.weights.h5.bkp",
                "training_metadata.json.bkp")


def count_fit():
    """The index of this fit call in this process (the same on every worker: it names the fit's backup)."""
    fits = process_state.slot("private_backups.fits", lambda: [0])
    fits[0] += 1
    return fits[0] - 1


def scratch_dir():
    """A per-process temporary directory for a non-chief worker's writes, removed at exit (kept across
    ``process_state.reset()``: one directory a process)."""
    made = process_state.slot("private_backups.scratch_dir", list, keep=True)
    if not made:
        root = os.environ.get(SCRATCH_DIR_VAR) or None
        if root:
            os.makedirs(root, exist_ok=True)
        made.append(tempfile.mkdtemp(prefix="kerasdist-worker-", dir=root))
        atexit.register(shutil.rmtree, made[0], True)
    return made[0]


def job_identity(model, strategy):
    """What makes a backup this job's: the same script (content), arguments, replicas and model; plugins may
    replace the arguments with what an engine keeps across its retries (``kerasdist_job_identity``)."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    try:
        with open(script, "rb") as f:
            script_hash = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        script_hash = "interactive"
    variables = [[v.path, list(v.shape), str(v.dtype)] for v in model.weights]
    identity = {"script": os.path.basename(script) or "interactive", "script_sha256": script_hash,
                "arguments": sys.argv[1:], "replicas": int(strategy.num_replicas_in_sync),
                "model_sha256": hashlib.sha256(json.dumps(variables).encode()).hexdigest(),
                "optimizer": type(model.optimizer).__name__ if model.optimizer is not None else None}
    from .manager import get_system

    get_system().hook.kerasdist_job_identity(identity=identity)  # an engine's stable job (Ray Train's run)
    return identity


def _short_hash(identity):
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def default_root():
    """``$XDG_CACHE_HOME/kerasdist/backups`` (``~/.cache``), else a per-user folder in the temp dir."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if os.access(cache, os.W_OK) or (not os.path.exists(cache) and os.access(os.path.dirname(cache), os.W_OK)):
        return os.path.join(cache, "kerasdist", "backups")
    return os.path.join(tempfile.gettempdir(), f"kerasdist-backup-{os.getuid()}")


def _where(spec):
    return getattr(spec, "name", None) or "multiworker"


def backup_folder(spec, identity, fit_index):
    """The folder of this fit's backup: the spec's ``backup_dir``, else one named by the job's identity
    under KERASDIST_BACKUP_DIR, else under :func:`default_root`."""
    if spec.backup_dir:
        return os.path.abspath(spec.backup_dir)
    root = os.environ.get(BACKUP_DIR_VAR)
    if root:
        return os.path.abspath(os.path.join(root, f"fit{fit_index}-{_short_hash(identity)}"))
    stem = os.path.splitext(identity["script"])[0]
    root = default_root()
    private_folder(root, "the backup root", _where(spec))
    return os.path.join(root, f"{stem}-{_short_hash(identity)}-fit{fit_index}")


def private_folder(path, what="the backup folder", where="multiworker"):
    """Create ``path`` 0700 if missing; refuse it if another user owns it or others may write it (``where``: the
    strategy's name, for the messages)."""
    fix = (f"Delete it if it is yours to delete, or choose a private folder: kerasdist.{where}(backup_dir=...) "
           f"or {BACKUP_DIR_VAR}=...")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        raise KerasdistError(f"{where}: cannot create {what} {path} ({exc.strerror}); give a writable "
                             f"folder: kerasdist.{where}(backup_dir=...) or {BACKUP_DIR_VAR}=...") from None
    if not stat.S_ISDIR(info.st_mode):
        raise KerasdistError(f"{where}: {what} {path} is not a folder (a link or a file); refusing it. {fix}")
    if info.st_uid != os.getuid():
        raise KerasdistError(f"{where}: refusing {what} {path}: it belongs to user id {info.st_uid}, not to you "
                             f"({os.getuid()}), so a backup in it could be planted. {fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KerasdistError(f"{where}: refusing {what} {path}: others may write it (mode "
                             f"{stat.S_IMODE(info.st_mode):o}), so a backup in it could be planted. {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise KerasdistError(f"{where}: cannot write {what} {path}; give a writable folder: "
                             f"kerasdist.{where}(backup_dir=...) or {BACKUP_DIR_VAR}=...")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)


def inspect(folder, identity):
    """``("fresh" | "resume" | "foreign", completed epochs or None)`` for the backup in ``folder``."""
    if not any(os.path.exists(os.path.join(folder, name)) for name in _KERAS_FILES):
        return "fresh", None
    try:
        with open(os.path.join(folder, IDENTITY_FILE)) as f:
            written_by = json.load(f)
    except (OSError, ValueError):
        written_by = None
    if written_by != identity:
        return "foreign", None
    try:
        with open(os.path.join(folder, "training_metadata.json")) as f:
            return "resume", int(json.load(f)["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return "resume", None


def _differences(folder, identity):
    try:
        with open(os.path.join(folder, IDENTITY_FILE)) as f:
            other = json.load(f)
    except (OSError, ValueError):
        return "it has no kerasdist job identity"
    changed = [key for key in identity if other.get(key) != identity[key]] if isinstance(other, dict) else ["all"]
    return "its " + ", ".join(changed) + (" differ" if len(changed) > 1 else " differs")


def _write_identity(folder, identity):
    """Write the job's identity beside its backup, whole or not at all (a file of its own, renamed over the old
    one): the other workers read it in :func:`inspect` at the same moment (a Ray retry's workers start ``fit``
    together), and one that read a truncated file took the backup for another job's and trained from epoch 0
    while the chief resumed."""
    handle, path = tempfile.mkstemp(prefix=IDENTITY_FILE, dir=folder)  # 0600
    try:
        with open(handle, "w") as f:
            json.dump(identity, f)
        os.replace(path, os.path.join(folder, IDENTITY_FILE))
    except BaseException:
        os.unlink(path)
        raise


def private_backup_callback(backup_dir, identity):
    """The chief's ``keras.callbacks.BackupAndRestore``: files 0600, the job identity written beside them."""
    import keras

    class PrivateBackupAndRestore(keras.callbacks.BackupAndRestore):
        def __init__(self, backup_dir, identity):
            super().__init__(backup_dir, double_checkpoint=True)
            self.identity = identity

        def on_train_begin(self, logs=None):
            _write_identity(self.backup_dir, self.identity)
            super().on_train_begin(logs)

        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)
            if os.path.isdir(self.backup_dir):
                for name in os.listdir(self.backup_dir):
                    os.chmod(os.path.join(self.backup_dir, name), 0o600)

    return PrivateBackupAndRestore(backup_dir, identity)


def add_backup(call_kwargs, spec, model, strategy, fit_index, chief, scratch):
    """Put the backup callback first in ``fit``'s callbacks (unless the user gave their own): the chief's
    writes this job's backup, the others restore from it and write to ``scratch``."""
    import keras

    from ._keras_internals import make_chief_aware_backup

    callbacks = call_kwargs["callbacks"]
    mine = [cb for cb in callbacks if isinstance(cb, keras.callbacks.BackupAndRestore)]
    if mine:
        if not chief:
            user = mine[0]
            callbacks[callbacks.index(user)] = make_chief_aware_backup(
                user.backup_dir, os.path.join(scratch, "backup"), save_freq=user.save_freq,
                double_checkpoint=user.double_checkpoint, delete_checkpoint=user.delete_checkpoint)
        return
    identity = job_identity(model, strategy)
    folder = backup_folder(spec, identity, fit_index)
    private_folder(folder, where=_where(spec))
    state, completed = inspect(folder, identity)
    if chief and state == "resume":
        at = f"epoch {completed + 1}" if completed is not None else "its last epoch"
        print(f"kerasdist: resuming at {at} from this job's backup in {folder}", flush=True)
    if chief and state == "foreign":
        print(f"kerasdist: ignoring the backup in {folder}: another job wrote it ({_differences(folder, identity)}); "
              "training from the start and replacing it", flush=True)
        for name in _KERAS_FILES:
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
    if chief:
        callback = private_backup_callback(folder, identity)
    else:
        read_from = folder if state == "resume" else os.path.join(scratch, "no-backup")
        callback = make_chief_aware_backup(read_from, os.path.join(scratch, "backup"))
    if state == "resume":
        _explain_unreadable(callback, folder, _where(spec))
    callbacks.insert(0, callback)


def _explain_unreadable(callback, folder, where):
    restore = callback.on_train_begin

    def on_train_begin(logs=None):
        try:
            restore(logs)
        except (OSError, ValueError, KeyError) as exc:
            raise KerasdistError(
                f"{where}: the backup in {folder} cannot be read ({type(exc).__name__}: {exc}); it is "
                f"truncated or corrupt (a crash while it was written?). Delete it to start over: "
                f"rm -r {folder!r}") from exc

    callback.on_train_begin = on_train_begin
