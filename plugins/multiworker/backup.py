"""The BackupAndRestore backup of a multiworker ``fit``: kerasdist's private, identity-checked backups
(``kerasdist.plugin_tools.private_backups``, shared with data_parallel on torch)."""

from kerasdist.plugin_tools import private_backups

IDENTITY_FILE = private_backups.IDENTITY_FILE
add_backup = private_backups.add_backup
default_root = private_backups.default_root
job_identity = private_backups.job_identity
private_folder = private_backups.private_folder
