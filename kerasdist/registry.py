"""The registry of named strategy, optimization and export plugins."""

import dataclasses
import importlib.util

from .errors import DuplicatePluginError, PluginValidationError, UnknownPluginError
from .specs import OptimizationSpec, StrategySpec

KINDS = ("strategy", "optimization", "export")
_SPEC_BASE = {"strategy": StrategySpec, "optimization": OptimizationSpec}


def normalize(name):
    return str(name).strip().lower()


@dataclasses.dataclass
class PluginEntry:
    """One registered name."""

    name: str
    kind: str
    factory: object
    description: str = ""
    aliases: tuple = ()
    requires: tuple = ()
    extra: str = None
    install: str = None
    backends: tuple = ("tensorflow",)
    check: object = None
    defaults: dict = dataclasses.field(default_factory=dict)
    plugin: str = None
    package: str = None
    version: str = None
    disabled: bool = False

    def install_hint(self):
        if self.install:
            return self.install
        if self.extra:
            return f"pip install 'kerasdist[{self.extra}]'"
        if self.requires:
            return "pip install " + " ".join(sorted({m.split(".")[0] for m in self.requires}))
        return None

    def unavailable_reason(self):
        """Why this plugin cannot run here, or None. Never imports its dependencies."""
        if self.disabled:
            return "disabled by KERASDIST_DISABLE_PLUGINS / KERASDIST_LOAD_PLUGINS"
        backend = self.backend_reason()
        if backend:
            return backend
        missing = [m for m in self.requires if not _module_exists(m)]
        if missing:
            hint = self.install_hint()
            return f"needs {', '.join(missing)} (not installed)" + (f": {hint}" if hint else "")
        if self.check is not None:
            try:
                return self.check()
            except Exception as exc:  # a broken check must not hide the plugin
                return f"availability check failed: {type(exc).__name__}: {exc}"
        return None

    def backend_reason(self):
        """Why the running Keras backend cannot run this plugin, or None."""
        if not self.backends:
            return None
        import keras

        backend = keras.backend.backend()
        if backend in self.backends:
            return None
        return (f"needs the Keras backend {' or '.join(self.backends)}, but the backend is "
                f"{backend!r}: set KERAS_BACKEND={self.backends[0]} before importing keras")

    def create(self, **options):
        spec = self.factory(**{**self.defaults, **options})
        object.__setattr__(spec, "_kerasdist_name", self.name)
        return spec

    def as_row(self):
        reason = self.unavailable_reason()
        return {"name": self.name, "kind": self.kind, "available": reason is None, "reason": reason,
                "package": self.package, "version": self.version, "plugin": self.plugin,
                "description": self.description, "aliases": list(self.aliases),
                "install": self.install_hint() if reason else None}


def _module_exists(name):
    """Whether ``name`` (dotted or not) can be imported, found without importing anything."""
    import importlib.machinery
    import sys

    parts = name.split(".")
    if parts[0] in sys.modules:
        return _importable_loaded(name)
    try:
        spec = importlib.machinery.PathFinder.find_spec(parts[0])
        for part in parts[1:]:
            if spec is None or not spec.submodule_search_locations:
                return False
            spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return False
    return spec is not None


def _importable_loaded(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@dataclasses.dataclass
class PluginFailure:
    """A plugin that could not be loaded; listed instead of breaking kerasdist."""

    name: str
    reason: str
    package: str = None
    version: str = None
    hint: str = None

    def as_row(self):
        return {"name": self.name, "kind": None, "available": False, "reason": self.reason,
                "package": self.package, "version": self.version, "plugin": self.name,
                "description": "", "aliases": [], "install": self.hint}


class Registry:
    def __init__(self):
        self.entries = {}
        self._aliases = {}
        self.failures = []

    def registrar(self, kind, plugin=None, package=None, version=None, disabled_names=()):
        """The ``register`` callback handed to a plugin's registration hook."""
        def register(name, factory, *, description="", aliases=(), requires=(), extra=None, install=None,
                     backends=("tensorflow",), check=None, override=False, **defaults):
            entry = PluginEntry(normalize(name), kind, factory, description,
                                tuple(normalize(a) for a in aliases), tuple(requires), extra, install,
                                tuple(backends or ()), check, defaults, plugin, package, version)
            entry.disabled = any(n in disabled_names for n in (entry.name,) + entry.aliases)
            self.add(entry, override=override)
            return factory
        return register

    def add(self, entry, override=False):
        if entry.kind not in KINDS:
            raise PluginValidationError(f"Unknown plugin kind {entry.kind!r}; valid kinds: {', '.join(KINDS)}")
        base = _SPEC_BASE.get(entry.kind)
        if base is not None and not (isinstance(entry.factory, type) and issubclass(entry.factory, base)):
            raise PluginValidationError(
                f"Plugin {entry.plugin!r} registered {entry.kind} {entry.name!r} with {entry.factory!r}; "
                f"it must be a subclass of kerasdist.{base.__name__}.")
        if base is None and not callable(entry.factory):
            raise PluginValidationError(f"Exporter {entry.name!r} of plugin {entry.plugin!r} is not callable.")
        for key in (entry.name,) + entry.aliases:
            existing = self._lookup(key)
            if existing is not None and not override:
                raise DuplicatePluginError(
                    f"{entry.kind.capitalize()} name {key!r} is registered twice: by plugin "
                    f"{existing.plugin!r} (package {existing.package}) and by plugin {entry.plugin!r} "
                    f"(package {entry.package}). Pass override=True to register() to replace it, or "
                    f"disable one with KERASDIST_DISABLE_PLUGINS={entry.plugin}.")
            if existing is not None:
                self._remove(existing)
        if base is not None and "registered_name" not in entry.factory.__dict__:  # not a parent's name
            entry.factory.registered_name = entry.name
        self.entries[entry.name] = entry
        for alias in entry.aliases:
            self._aliases[alias] = entry.name

    def _remove(self, entry):
        self.entries.pop(entry.name, None)
        for alias in entry.aliases:
            self._aliases.pop(alias, None)

    def find(self, key):
        """The entry registered under ``key`` (a name or alias, any case), or None."""
        return self._lookup(key)

    def _lookup(self, key):
        key = normalize(key)
        return self.entries.get(self._aliases.get(key, key))

    def get(self, name, kinds=("strategy", "optimization")):
        entry = self._lookup(name)
        if entry is None:
            failure = next((f for f in self.failures if f.name == normalize(name)), None)
            if failure is not None:
                from .errors import PluginUnavailableError

                hint = f" Fix: {failure.hint}" if failure.hint else ""
                raise PluginUnavailableError(f"Plugin {failure.name!r} is not usable: {failure.reason}.{hint}")
        if entry is None or entry.kind not in kinds:
            if kinds == ("export",):
                raise UnknownPluginError(name, self.names(kinds), kind="export format",
                                         where="kerasdist.export(format=...)")
            raise UnknownPluginError(name, self.names(kinds))
        return entry

    def names(self, kinds=KINDS):
        return [e.name for e in self.entries.values() if e.kind in kinds]

    def rows(self):
        rows = [e.as_row() for e in sorted(self.entries.values(), key=lambda e: (e.kind, e.name))]
        return rows + [f.as_row() for f in self.failures]
