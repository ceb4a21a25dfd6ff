"""The multi-worker backup callback: read the chief's backup, write one's own (part of
kerasdist._keras_internals)."""

from . import versions

def make_chief_aware_backup(backup_dir, write_dir, **kwargs):
    """A ``keras.callbacks.BackupAndRestore`` that restores from ``backup_dir`` but
    writes (and deletes at the end) ``write_dir``: non-chief workers read the
    chief's backup and write theirs to a temporary directory."""
    import keras

    join = versions.locate("file_utils_join")

    class ChiefAwareBackupAndRestore(keras.callbacks.BackupAndRestore):
        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            self.backup_dir = write_dir
            self._weights_path = join(write_dir, "latest.weights.h5")
            self._training_metadata_path = join(write_dir, "training_metadata.json")
            self._prev_weights_path = f"{self._weights_path}.bkp"
            self._prev_training_metadata_path = f"{self._training_metadata_path}.bkp"

    return ChiefAwareBackupAndRestore(backup_dir, **kwargs)
