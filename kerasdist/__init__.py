"""kerasdist: distributed training and model optimization for Keras 3 as a one-word choice.

    import kerasdist
    model.compile(loss=..., optimizer=..., distribute="mirrored")
"""

from . import process_state  # first: submodules import it before __getattr__ below exists
from .cluster import ClusterInfo, LaunchWorker, cluster_hint_variables
from .devices import cpu_replicas_from_env as _cpu_replicas_from_env, split_cpu
from .errors import (BackendError, ClusterConfigError, DuplicatePluginError, KerasdistError,
                     PluginUnavailableError, PluginValidationError, PluginWarning, StrategyConflictError,
                     UnknownPluginError)
from .exporting import ExportResult, export
from .hookspecs import StrategyLike, hookimpl
from .specs import OptimizationSpec, Plan, PluginSpec, StrategySpec

__version__ = "0.1.0"

__all__ = [
    "BackendError", "ClusterConfigError", "ClusterInfo", "DuplicatePluginError", "ExportResult", "KerasdistError",
    "LaunchWorker", "OptimizationSpec", "Plan", "PluginSpec", "PluginUnavailableError", "PluginValidationError",
    "PluginWarning", "cluster_hint_variables",
    "StrategyConflictError", "StrategyLike", "StrategySpec", "UnknownPluginError", "detect_cluster", "export",
    "hookimpl", "is_chief", "list_plugins", "load_plain", "register_plugin", "spec", "split_cpu", "strategy_of",
    "unregister_plugin",
]


def spec(name, **options):
    """The spec of a registered plugin: ``kerasdist.spec("mirrored", devices=[...])``."""
    from .manager import get_system

    return get_system().registry.get(name).create(**options)


def list_plugins():
    """Every plugin known to this process, as dicts (what ``kerasdist plugins --json`` prints)."""
    from .manager import get_system

    return get_system().registry.rows()


def register_plugin(plugin, name=None):
    """Register a plugin object or module in this process (no entry point needed); raises a
    :class:`PluginValidationError` or :class:`DuplicatePluginError` if it is not valid."""
    from .manager import get_system

    return get_system().add_plugin(plugin, name=name)


def unregister_plugin(name):
    """Unregister a plugin by the name it was registered under; names it overrode come back."""
    from .manager import get_system

    get_system().remove_plugin(name)


def detect_cluster():
    """The :class:`ClusterInfo` this process belongs to (``ClusterInfo.local()`` if none)."""
    from .manager import get_system

    return get_system().detect_cluster()


def is_chief():
    """True in the one process of a job that should write files (``model.save``, exports, reports):
    the chief, else worker 0, of a multi-worker cluster; Horovod rank 0; the parameter-server
    coordinator; any process that is not part of a cluster."""
    return detect_cluster().is_chief


def strategy_of(model):
    """The strategy a model compiled with ``distribute=`` runs under, or None."""
    from .session import session_of

    session = session_of(model)
    return session.strategy if session else None


def load_plain(filepath, **kwargs):
    """``keras.models.load_model(filepath, **kwargs)`` without the ``distribute=`` the model was saved with
    (``keras.models.load_model`` compiles a model saved after ``compile(distribute=...)`` with it again)."""
    from .saving import load_plain

    return load_plain(filepath, **kwargs)


def __getattr__(name):
    """``kerasdist.<plugin name>(**options)`` builds that plugin's spec, e.g. ``kerasdist.mirrored()``."""
    if name.startswith("__"):
        raise AttributeError(name)
    from .manager import get_system

    entry = get_system().registry.find(name)
    if entry is None or entry.kind == "export":
        raise AttributeError(f"module 'kerasdist' has no attribute {name!r} (and no plugin named {name!r}; "
                             "run `kerasdist plugins`)")
    return entry.create


def _setup():
    """Patch Keras when it is imported, split the CPU when TensorFlow is, and join a cluster only when
    a cluster variable is set: ``import kerasdist`` itself imports neither."""
    import os
    import warnings

    from ._keras_internals import SUPPORTED_KERAS, installed_keras_version, keras_version_checked
    from .import_hooks import when_imported

    if not keras_version_checked():
        warnings.warn(f"kerasdist {__version__} was checked against {SUPPORTED_KERAS}, but Keras "
                      f"{installed_keras_version()} is installed: compiling under a strategy raises an error "
                      "if a private piece kerasdist needs has moved, and training may break.", stacklevel=3)
    count = _cpu_replicas_from_env()
    if count is not None:
        when_imported("tensorflow", lambda tf: split_cpu(count))
    when_imported("keras", _patch_keras)
    if _process_start_wanted() and any(var in os.environ for var in cluster_hint_variables()):
        from .manager import get_system

        system = get_system()
        cluster = system.detect_cluster()
        if not cluster.is_local:
            system.hook.kerasdist_process_start(cluster=cluster, environ=system.environ)


def _patch_keras(keras_module):
    from .integration import install
    from .manager import keras_imported

    install()
    keras_imported(keras_module)


def _process_start_wanted():
    """False for the ``kerasdist`` command itself (env, launch must not join a cluster) and when
    KERASDIST_PROCESS_START=0."""
    import os
    import sys

    if os.environ.get("KERASDIST_PROCESS_START", "1").strip().lower() in ("0", "false", "no"):
        return False
    if os.path.basename(sys.argv[0] if sys.argv else "") == "kerasdist":
        return False
    argv = list(getattr(sys, "orig_argv", []))
    return not ("-m" in argv and argv.index("-m") + 1 < len(argv)
                and argv[argv.index("-m") + 1] in ("kerasdist", "kerasdist.cli"))


_setup()
