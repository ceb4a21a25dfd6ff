"""Builds the plugin manager: hook specs, entry points, allow/deny lists, registry."""

import importlib.metadata
import logging
import os

import pluggy

from . import hookspecs
from .cluster import ClusterInfo
from .registry import PluginFailure, Registry

ENTRY_POINT_GROUP = "kerasdist"
log = logging.getLogger("kerasdist")

_REGISTRATION_HOOKS = (
    ("strategy", "kerasdist_register_strategies"),
    ("optimization", "kerasdist_register_optimizations"),
    ("export", "kerasdist_register_exporters"),
)


def _name_list(environ, var):
    value = environ.get(var)
    if value is None:
        return None
    return {n.strip().lower() for n in value.split(",") if n.strip()}


class PluginSystem:
    """A pluggy manager plus the registry its plugins filled."""

    def __init__(self, environ=None, load_entrypoints=True):
        self.environ = os.environ if environ is None else environ
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.packages = {}
        self.disabled = _name_list(self.environ, "KERASDIST_DISABLE_PLUGINS") or set()
        self.allowed = _name_list(self.environ, "KERASDIST_LOAD_PLUGINS")
        if self.environ.get("KERASDIST_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(log.debug)
            self.pm.enable_tracing()
        if load_entrypoints:
            self._load_entrypoints()

    @property
    def hook(self):
        return self.pm.hook

    def _is_disabled(self, name):
        name = name.lower()
        return name in self.disabled or (self.allowed is not None and name not in self.allowed)

    def _load_entrypoints(self):
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            package, version = (dist.name, dist.version) if dist else (None, None)
            if self._is_disabled(ep.name):
                self.registry.failures.append(PluginFailure(
                    ep.name, "disabled by KERASDIST_DISABLE_PLUGINS / KERASDIST_LOAD_PLUGINS", package, version))
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                hint = f"pip install --force-reinstall {package}" if package else None
                self.registry.failures.append(PluginFailure(
                    ep.name, f"import of {ep.value} failed: {type(exc).__name__}: {exc}", package, version, hint))
                continue
            self.add_plugin(plugin, ep.name, package, version)

    def add_plugin(self, plugin, name=None, package=None, version=None):
        """Register a plugin object/module and run its registration hooks."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except Exception as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self.registry.failures.append(PluginFailure(
                name, f"invalid plugin: {type(exc).__name__}: {exc}", package, version))
            return None
        self.packages[name] = (package, version)
        self._run_registration(name)
        return name

    def remove_plugin(self, name):
        self.pm.unregister(name=name)
        for entry in [e for e in self.registry.entries.values() if e.plugin == name]:
            self.registry._remove(entry)

    def _run_registration(self, plugin_name):
        package, version = self.packages.get(plugin_name, (None, None))
        for kind, hook_name in _REGISTRATION_HOOKS:
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name != plugin_name:
                    continue
                register = self.registry.registrar(kind, plugin_name, package, version, self.disabled)
                impl.function(**{arg: register for arg in impl.argnames})

    # -- hook calls used by the core -----------------------------------------

    def detect_cluster(self):
        cluster = self.hook.kerasdist_detect_cluster(environ=self.environ)
        return cluster if cluster is not None else ClusterInfo.local()


_system = None


def get_system():
    """The process-wide plugin system, built on first use."""
    global _system
    if _system is None:
        _system = PluginSystem()
    return _system


def reset_system(system=None):
    """Replace the process-wide plugin system (tests; after installing a plugin)."""
    global _system
    _system = system
    return system
