"""Errors kerasdist raises: each message names the bad value and the fix."""

import copyreg
import difflib
import sys


def did_you_mean(value, choices):
    """`` Did you mean 'x'?`` for the closest of ``choices`` to ``value``, or ``""``."""
    close = difflib.get_close_matches(str(value).lower(), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class KerasdistError(ValueError):
    """Base class of every error kerasdist raises for bad input or set-up."""

    def __reduce__(self):
        """Pickled (Ray sends a worker's error to the driver so) with its arguments and attributes, whatever the
        subclass's ``__init__`` takes. An error that made ``import kerasdist`` fail (joining the cluster at
        import) leaves the package unimportable in that process, and pickle, which imports a class's module to
        name it, would fail and lose the message: then it goes as the built-in base class carrying the
        error's type and message."""
        if sys.modules.get("kerasdist") is None:
            builtin = next(base for base in type(self).__mro__ if base.__module__ == "builtins")
            return builtin, (f"{type(self).__module__}.{type(self).__qualname__}: {self}",)
        return copyreg.__newobj__, (type(self), *self.args), self.__dict__ or None


class PluginWarning(UserWarning):
    """A plugin looks wrong but still loads (e.g. a ``kerasdist_*`` function without ``@hookimpl``)."""


class UnknownPluginError(KerasdistError):
    def __init__(self, value, available, kind="plugin", where="distribute="):
        self.value, self.available = value, sorted(available)
        hint = did_you_mean(value, self.available)
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
