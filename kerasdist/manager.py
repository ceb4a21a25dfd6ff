"""Builds the plugin manager: hook specs, entry points, allow/deny lists, registry.

Loading is safe: a plugin package that fails in any way (import error, invalid
hooks, a name another plugin already has) is listed by ``kerasdist plugins`` as
failed, with its reason, and everything else keeps working. kerasdist's own
plugins load first, so a third party can replace a built-in name only on purpose
(``override=True``). In-process registration (``kerasdist.register_plugin``) is
explicit, so it raises instead.
"""

import importlib.metadata
import os
import sys
import warnings

import pluggy

from . import hookspecs, process_state
from .cluster import ClusterInfo
from .errors import DuplicatePluginError, KerasdistError, PluginValidationError, PluginWarning, did_you_mean
from .registry import PluginFailure, Registry

ENTRY_POINT_GROUP = "kerasdist"
OWN_DISTRIBUTION = "kerasdist"
TRACE_VAR = "KERASDIST_TRACE_PLUGINS"

_REGISTRATION_HOOKS = (
    ("strategy", "kerasdist_register_strategies"),
    ("optimization", "kerasdist_register_optimizations"),
    ("export", "kerasdist_register_exporters"),
)
HOOK_NAMES = tuple(sorted(name for name in dir(hookspecs) if name.startswith("kerasdist_")))


#: Built-in plugins renamed for what they write; their old names in the two variables still select them
#: (for one release): "quantization" was the LiteRT exporter, "tensorrt" held the ONNX exporter too.
RENAMED_PLUGINS = {"quantization": ("litert",), "tensorrt": ("onnx",)}


def _name_list(environ, var):
    value = environ.get(var)
    if value is None:
        return None
    names = {n.strip().lower() for n in value.split(",") if n.strip()}
    return names | {new for old in names for new in RENAMED_PLUGINS.get(old, ())}


def _mid_import(module_name):
    """Whether ``module_name`` or a package above it is being imported right now (its body has not finished
    running). CPython's import system marks such a module's spec ``_initializing`` (3.4 to 3.13)."""
    parts = module_name.split(".")
    for name in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
        if getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False):
            return True
    return False


def _is_own(entry_point):
    dist = getattr(entry_point, "dist", None)
    return dist is not None and dist.name == OWN_DISTRIBUTION


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
        self._importing = []  # entry points whose module was mid-import when this system was built
        if self.environ.get(TRACE_VAR, "").strip() not in ("", "0"):
            self.pm.add_hookcall_monitoring(_trace_before, _trace_after)
        if load_entrypoints:
            self._load_entrypoints()
        self._keras_announced = False
        imported = _keras_imported()
        if imported:  # Keras came before this system: its plugins (and later ones) hear it all the same
            self.announce_keras(imported[0])

    def announce_keras(self, keras_module):
        """Call ``kerasdist_keras_imported`` (historic: plugins registered later are called when they
        register); once per system."""
        if not self._keras_announced:
            self._keras_announced = True
            self.pm.hook.kerasdist_keras_imported.call_historic(kwargs={"keras": keras_module})

    @property
    def hook(self):
        return self.pm.hook

    def _is_disabled(self, name):
        name = name.lower()
        return name in self.disabled or (self.allowed is not None and name not in self.allowed)

    def _load_entrypoints(self):
        points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        ordered = sorted(points, key=lambda ep: (not _is_own(ep), ep.name))  # built-ins first
        for ep in ordered:
            self._load_entrypoint(ep)

    def _load_entrypoint(self, ep):
        dist = getattr(ep, "dist", None)
        package, version = (dist.name, dist.version) if dist else (None, None)
        if self._is_disabled(ep.name):
            self.registry.failures.append(PluginFailure(
                ep.name, "disabled by KERASDIST_DISABLE_PLUGINS / KERASDIST_LOAD_PLUGINS", package, version))
            return
        if _mid_import(ep.module):  # the import running now began at this plugin or its package
            self._importing.append(ep)
            return
        try:
            plugin = ep.load()
        except Exception as exc:
            hint = f"pip install --force-reinstall {package}" if package else None
            self.registry.failures.append(PluginFailure(
                ep.name, f"import of {ep.value} failed: {type(exc).__name__}: {exc}", package, version, hint))
            return
        try:
            self.add_plugin(plugin, ep.name, package, version)
        except Exception as exc:  # a broken third-party plugin must never break kerasdist
            where = f"pip uninstall {package}, or " if package and package != OWN_DISTRIBUTION else ""
            self.registry.failures.append(PluginFailure(
                ep.name, f"{type(exc).__name__}: {exc}", package, version,
                f"{where}set KERASDIST_DISABLE_PLUGINS={ep.name}"))

    def load_imported(self):
        """Load the entry points that were mid-import when this system was built, once their import is done."""
        if self._importing:
            waiting, self._importing = self._importing, []
            for ep in waiting:
                self._load_entrypoint(ep)  # one still mid-import waits again

    def add_plugin(self, plugin, name=None, package=None, version=None):
        """Register a plugin object/module and run its registration hooks.

        All or nothing: on any error nothing of the plugin stays registered and the
        error (a :class:`KerasdistError`) is raised.
        """
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        if self.pm.has_plugin(name) or self.pm.is_registered(plugin):
            raise DuplicatePluginError(f"A plugin named {name!r} (or the same object) is already registered; "
                                       "unregister it first or choose another name.")
        _warn_about_lookalikes(plugin, name)
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except (ValueError, pluggy.PluginValidationError) as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            raise PluginValidationError(f"Plugin {name!r} is not valid: {_explain(exc)}") from exc
        except Exception as exc:  # its kerasdist_keras_imported, called at registration (historic)
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            raise PluginValidationError(
                f"Plugin {name!r} failed in kerasdist_keras_imported: {type(exc).__name__}: {exc}") from exc
        self.packages[name] = (package, version)
        try:
            self._run_registration(name)
        except Exception as exc:
            self.remove_plugin(name)
            if isinstance(exc, KerasdistError):
                raise
            raise PluginValidationError(
                f"Plugin {name!r} failed in its registration hook: {type(exc).__name__}: {exc}") from exc
        return name

    def remove_plugin(self, name):
        """Unregister a plugin; names it had replaced (``override=True``) come back."""
        if not self.pm.has_plugin(name):
            raise KerasdistError(f"No plugin named {name!r} is registered; registered: "
                                 f"{', '.join(sorted(n for n, _ in self.pm.list_name_plugin()))}.")
        self.pm.unregister(name=name)
        self.packages.pop(name, None)
        self.registry.remove_plugin(name)

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


def _explain(exc):
    """pluggy's message, plus a did-you-mean for a misspelled hook name."""
    message = str(exc)
    unknown = [word.strip("'\"(),") for word in message.split() if word.strip("'\"(),").startswith("kerasdist_")]
    unknown = [w for w in unknown if w not in HOOK_NAMES]
    if unknown:
        message += f" ({unknown[0]!r} is not a kerasdist hook.{did_you_mean(unknown[0], HOOK_NAMES)})"
    return message


def _warn_about_lookalikes(plugin, name):
    """Warn about ``kerasdist_*`` functions that kerasdist will never call."""
    marker = f"{hookspecs.PROJECT}_impl"
    for attr in dir(plugin):
        if not attr.startswith("kerasdist_"):
            continue
        value = getattr(plugin, attr, None)
        if not callable(value) or hasattr(value, marker):
            continue
        if attr in HOOK_NAMES:
            problem = "has no @kerasdist.hookimpl decorator, so kerasdist never calls it."
        else:
            problem = f"is not a kerasdist hook, so kerasdist never calls it.{did_you_mean(attr, HOOK_NAMES)}"
        warnings.warn(f"Plugin {name!r}: function {attr!r} {problem}", PluginWarning, stacklevel=3)


# -- KERASDIST_TRACE_PLUGINS --------------------------------------------------------

def _summary(name, value):
    if name == "environ":
        return f"<environment: {len(value)} variables>"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _trace_before(hook_name, hook_impls, kwargs):
    arguments = ", ".join(f"{k}={_summary(k, v)}" for k, v in kwargs.items())
    plugins = ", ".join(impl.plugin_name for impl in hook_impls) or "(no implementation)"
    sys.stderr.write(f"kerasdist trace: {hook_name}({arguments}) -> {plugins}\n")


def _trace_after(outcome, hook_name, hook_impls, kwargs):
    exception = outcome.exception
    if exception is not None:
        result = f"raised {type(exception).__name__}: {exception}"
    else:
        result = _summary("result", outcome.get_result())
    sys.stderr.write(f"kerasdist trace: {hook_name} returned {result}\n")


def _keras_imported():
    """[the keras module] once Keras was imported and kerasdist patched it (kept: that is for good)."""
    return process_state.slot("kerasdist.keras_imported", list, keep=True)


def keras_imported(keras_module):
    """Keras is imported: tell the plugin system, and every system built from now on."""
    imported = _keras_imported()
    if not imported:
        imported.append(keras_module)
    get_system().announce_keras(keras_module)


def _holder():
    return process_state.slot("kerasdist.plugin_system", lambda: [None])


def get_system():
    """The process-wide plugin system, built on first use (and after ``process_state.reset()``)."""
    holder = _holder()
    if holder[0] is None:
        holder[0] = PluginSystem()
    holder[0].load_imported()
    return holder[0]


def reset_system(system=None):
    """Replace the process-wide plugin system (tests; after installing a plugin); None: build a new one
    on next use."""
    _holder()[0] = system
    return system
