"""Errors kerasdist raises: each message names the bad value and the fix."""

import difflib


class KerasdistError(ValueError):
    """Base class of every error kerasdist raises for bad input or set-up."""


class UnknownPluginError(KerasdistError):
    def __init__(self, value, available, kind="plugin", where="distribute="):
        self.value, self.available = value, sorted(available)
        close = difflib.get_close_matches(str(value).lower(), self.available, n=1, cutoff=0.6)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        names = ", ".join(self.available) or "(none)"
        super().__init__(
            f"Unknown {kind} {value!r} for {where}. Available: {names}.{hint} "
            "(A plugin may not be installed or may be disabled: run `kerasdist plugins`.)"
        )


class PluginUnavailableError(KerasdistError):
    """The plugin is registered but cannot run here (missing dependency, hardware, backend)."""


class BackendError(PluginUnavailableError):
    pass


class DuplicatePluginError(KerasdistError):
    pass


class StrategyConflictError(KerasdistError):
    pass


class PluginValidationError(KerasdistError):
    """A plugin broke the hook contract (bad registration, missing hook)."""


class ClusterConfigError(KerasdistError):
    """The cluster description (TF_CONFIG, Slurm, launcher arguments) is invalid."""
