"""Only rank 0 writes: the other ranks drop ModelCheckpoint, TensorBoard, CSVLogger and KerasTuner's SaveBestEpoch
(``plugin_tools.writes_files``; every rank holds the
same weights and logs the same all-reduced metrics) and print nothing. BackupAndRestore: kerasdist's private,
identity-checked backup (``plugin_tools.private_backups``, as multiworker's): rank 0 writes it, the others
restore from it and write to a scratch folder; a relaunched job resumes from it."""

import keras

from kerasdist import KerasdistError
from kerasdist.plugin_tools import private_backups, writes_files


def only_rank0_writes(call_kwargs, rank):
    if rank == 0:
        return
    call_kwargs["verbose"] = 0
    call_kwargs["callbacks"][:] = [cb for cb in call_kwargs["callbacks"] if not writes_files(cb)]


def add_backup(call_kwargs, spec, model, strategy):
    """The private backup (``spec.backup``), or the user's own BackupAndRestore read by every rank."""
    users = any(isinstance(cb, keras.callbacks.BackupAndRestore) for cb in call_kwargs["callbacks"])
    if spec.backup or users:
        private_backups.add_backup(call_kwargs, spec, model, strategy, private_backups.count_fit(),
                                   strategy.rank == 0, private_backups.scratch_dir())


class GatheredForRank0(keras.callbacks.Callback):
    """fsdp: a writing callback that reads the weights (ModelCheckpoint, TensorBoard) runs on rank 0 only, but
    every rank gathers the full weights (a collective) around the hooks where it may read them."""

    def __init__(self, inner, rank, gathered):
        super().__init__()
        self.inner, self.rank, self.gathered = inner, rank, gathered
        self.per_batch = getattr(inner, "save_freq", "epoch") != "epoch"

    def set_model(self, model):
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.inner.set_params(params)

    def _run(self, hook, gather, *args, **kwargs):
        if gather:
            with self.gathered(self.model):
                if self.rank == 0:
                    getattr(self.inner, hook)(*args, **kwargs)
        elif self.rank == 0:
            getattr(self.inner, hook)(*args, **kwargs)

    def on_epoch_end(self, epoch, logs=None):
        self._run("on_epoch_end", True, epoch, logs=logs)

    def on_train_batch_end(self, batch, logs=None):
        self._run("on_train_batch_end", self.per_batch, batch, logs=logs)


def _forwarding(hook):
    def forward(self, *args, **kwargs):
        self._run(hook, False, *args, **kwargs)

    return forward


for _hook in ("on_train_begin", "on_train_end", "on_epoch_begin", "on_train_batch_begin", "on_test_begin",
              "on_test_end", "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
              "on_predict_batch_begin", "on_predict_batch_end"):
    setattr(GatheredForRank0, _hook, _forwarding(_hook))


def fsdp_callbacks(call_kwargs, rank, gathered):
    """fsdp's callbacks: the weight-reading writers gather on every rank and write on rank 0; CSVLogger and the
    output stay on rank 0; BackupAndRestore is refused (its restore would load full weights into shards)."""
    for callback in call_kwargs["callbacks"]:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise KerasdistError(
                "fsdp: keras.callbacks.BackupAndRestore is not supported (it would restore full weights into "
                "sharded variables); use distribute=\"data_parallel\" for BackupAndRestore, or under fsdp a "
                "ModelCheckpoint (it saves the full weights) and model.load_weights before compile to resume.")
    def reading(callback):  # a writer that reads the weights (ModelCheckpoint, TensorBoard, SaveBestEpoch)
        return writes_files(callback) and not isinstance(callback, keras.callbacks.CSVLogger)

    call_kwargs["callbacks"][:] = [GatheredForRank0(cb, rank, gathered) if reading(cb) else cb
                                   for cb in call_kwargs["callbacks"]
                                   if rank == 0 or not writes_files(cb) or reading(cb)]
    if rank:
        call_kwargs["verbose"] = 0
