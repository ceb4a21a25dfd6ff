"""The registry of named strategy, optimization and export plugins."""

import dataclasses
import importlib.util
import inspect

from .backend import keras_backend
from .option_types import check_option_types
from .errors import DuplicatePluginError, KerasdistError, PluginValidationError, UnknownPluginError, did_you_mean
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
    shadows: list = dataclasses.field(default_factory=list, repr=False)  # entries replaced by override

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
        backend = keras_backend()
        if backend in self.backends:
            return backend_missing(backend)
        wanted, install = " or ".join(self.backends), self.backend_install()
        if install:
            return (f"needs the Keras backend {wanted}, which is not installed (the backend is {backend!r}): "
                    f"{install}, then set KERAS_BACKEND={self.backends[0]}")
        return (f"needs the Keras backend {wanted}, but the backend is "
                f"{backend!r}: set KERAS_BACKEND={self.backends[0]} before importing keras")

    def backend_install(self):
        """How to install the framework this plugin needs when none of its backends' is installed, else None."""
        if not self.backends or any(backend_missing(b) is None for b in self.backends):
            return None
        return BACKEND_INSTALL.get(self.backends[0], f"install {self.backends[0]}")

    def create(self, **options):
        self.check_options(options)
        spec = self.factory(**{**self.defaults, **options})
        check_option_types(spec, self.name)
        object.__setattr__(spec, "_kerasdist_name", self.name)
        return spec

    def options(self):
        """``{option: default}`` this plugin accepts (``inspect.Parameter.empty`` when required), or
        None when its factory takes ``**kwargs`` (anything goes)."""
        if dataclasses.is_dataclass(self.factory):
            found = {f.name: _field_default(f) for f in dataclasses.fields(self.factory) if f.init}
        else:
            parameters = list(inspect.signature(self.factory).parameters.values())
            if self.kind == "export":
                parameters = parameters[2:]  # export_function(model, filepath, **options)
            if any(p.kind is p.VAR_KEYWORD for p in parameters):
                return None
            found = {p.name: p.default for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        found.update({k: v for k, v in self.defaults.items() if k in found})
        return found

    def check_options(self, options):
        """Raise a KerasdistError naming each option the plugin does not have, with the valid ones."""
        valid = self.options()
        if valid is None:
            return
        unknown = [name for name in options if name not in valid]
        if unknown:
            what = "export format" if self.kind == "export" else self.kind
            listing = ", ".join(_describe_option(k, v) for k, v in valid.items()) or "(none)"
            raise KerasdistError(
                f"The {what} {self.name!r} has no option {unknown[0]!r}.{did_you_mean(unknown[0], valid)} "
                f"Its options: {listing}. (`kerasdist plugins -v` lists every plugin's options.)")

    def as_row(self):
        reason = self.unavailable_reason()
        options = self.options()
        return {"name": self.name, "kind": self.kind, "available": reason is None, "reason": reason,
                "package": self.package, "version": self.version, "plugin": self.plugin,
                "description": self.description, "aliases": list(self.aliases),
                "backends": list(self.backends),
                "options": None if options is None else {k: _describe_default(v) for k, v in options.items()},
                "install": "; then ".join(filter(None, (self.backend_install(), self.install_hint()))) or None
                if reason else None}


#: How to install each Keras backend's framework (TensorFlow is an extra, never a hard dependency).
BACKEND_INSTALL = {
    "tensorflow": "pip install 'kerasdist[cpu]' (CPU), 'kerasdist[cuda]' (NVIDIA GPUs), or your own tensorflow",
    "jax": "pip install 'kerasdist[jax]'",
    "torch": "pip install 'kerasdist[torch]'",
}


def backend_missing(backend):
    """Why the framework of ``backend`` is missing, or None (found without importing it)."""
    if backend not in BACKEND_INSTALL or _module_exists(backend):
        return None
    return f"the Keras backend {backend!r} is not installed: {BACKEND_INSTALL[backend]}"


def _field_default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return inspect.Parameter.empty


def _describe_default(value):
    return "(required)" if value is inspect.Parameter.empty else repr(value)


def _describe_option(name, default):
    return f"{name} (required)" if default is inspect.Parameter.empty else f"{name}={default!r}"


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
                "description": "", "aliases": [], "backends": [], "options": None, "install": self.hint}


def _package(entry):
    if not entry.package:
        return " (in-process)"
    return f" (package {entry.package}{' ' + entry.version if entry.version else ''})"


def _namespace(kind):
    """Strategies and optimizations share names (both go in ``distribute=``); export formats have their
    own (``kerasdist.export(format=...)``), so "tensorrt" can be both an optimization and a format."""
    return "export" if kind == "export" else "train"


def _key(space, name):
    return name if space == "train" else f"export:{name}"


def _other_backends(entry, existing, registered):
    """Whether ``entry`` may share its name with ``registered`` (``existing`` among them): same kind, each
    for its own backends (none empty, none shared), so that lookup picks the running backend's."""
    return bool(entry.backends) and all(
        e.kind == entry.kind and e.name == entry.name and e.backends and not set(e.backends) & set(entry.backends)
        for e in registered)


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
            existing = self._lookup(key, _namespace(entry.kind))
            if existing is not None and not override and _other_backends(entry, existing, self._variants(key, entry)):
                continue  # one word, another implementation for other backends (e.g. data_parallel on torch)
            if existing is not None and not override:
                raise DuplicatePluginError(
                    f"Plugin {entry.plugin!r}{_package(entry)} registers the {entry.kind} name {key!r}, which "
                    f"plugin {existing.plugin!r}{_package(existing)} already has; {existing.plugin!r} keeps it. "
                    "Give the new one another name, or pass override=True to register() to replace it on purpose.")
            if existing is not None:
                self._detach(existing)
                entry.shadows.append(existing)
        if base is not None and "registered_name" not in entry.factory.__dict__:  # not a parent's name
            entry.factory.registered_name = entry.name
        self._attach(entry)

    def _attach(self, entry):
        space = _namespace(entry.kind)
        key = _key(space, entry.name)
        if key in self.entries and self.entries[key] is not entry:  # a variant for other backends
            key = f"{key}@{'+'.join(entry.backends)}"
        self.entries[key] = entry
        for alias in entry.aliases:
            self._aliases.setdefault(_key(space, alias), _key(space, entry.name))

    def _variants(self, key, entry):
        """The entries registered under ``key`` (a name or alias) in ``entry``'s namespace."""
        space = _namespace(entry.kind)
        return self._candidates(_key(space, normalize(key)))

    def _candidates(self, key):
        """Every entry registered under ``key`` (namespaced), one per backend group; its own aliases only."""
        name_key = self._aliases.get(key, key)
        bare = key.split(":", 1)[1] if key.startswith("export:") else key
        found = [e for k, e in self.entries.items() if k == name_key or k.startswith(name_key + "@")]
        return [e for e in found if bare == e.name or bare in e.aliases]

    def _detach(self, entry):
        space = _namespace(entry.kind)
        for key in [k for k, e in self.entries.items() if e is entry]:
            del self.entries[key]
        for alias in entry.aliases:
            if not any(alias in e.aliases for e in self.entries.values() if _namespace(e.kind) == space):
                self._aliases.pop(_key(space, alias), None)

    def remove_plugin(self, plugin):
        """Drop every name ``plugin`` registered; names it replaced come back to their owners."""
        for entry in self.entries.values():
            entry.shadows = [old for old in entry.shadows if old.plugin != plugin]
        for entry in reversed([e for e in self.entries.values() if e.plugin == plugin]):
            self._detach(entry)
            for shadowed in entry.shadows:
                if all(self._lookup(key, _namespace(shadowed.kind)) is None
                       for key in (shadowed.name,) + shadowed.aliases):
                    self._attach(shadowed)

    def find(self, key):
        """The strategy or optimization registered under ``key`` (a name or alias, any case), else the
        export format, or None."""
        return self._lookup(key, "train") or self._lookup(key, "export")

    def _lookup(self, key, space):
        """The entry for ``key``; of one word registered for several disjoint backends, the running backend's."""
        candidates = self._candidates(_key(space, normalize(key)))
        if len(candidates) > 1:
            backend = keras_backend()
            return next((e for e in candidates if backend in e.backends), candidates[0])
        return candidates[0] if candidates else None

    def entry_of(self, spec):
        """The entry ``spec`` was created from (its name and class), or None for unregistered specs."""
        name = getattr(spec, "name", None)
        if not isinstance(name, str):
            return None
        candidates = self._candidates(_key("train", normalize(name)))
        return next((e for e in candidates if isinstance(spec, e.factory)), None)

    def get(self, name, kinds=("strategy", "optimization")):
        entry = self._lookup(name, "export" if tuple(kinds) == ("export",) else "train")
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
        return list(dict.fromkeys(e.name for e in self.entries.values() if e.kind in kinds))

    def rows(self):
        rows = [e.as_row() for e in sorted(self.entries.values(), key=lambda e: (e.kind, e.name))]
        return rows + [f.as_row() for f in self.failures]
