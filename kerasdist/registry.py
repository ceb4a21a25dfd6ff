"""The registry of named strategy, optimization and export plugins."""

from .backend import keras_backend
from .errors import DuplicatePluginError, PluginValidationError, UnknownPluginError
# Re-exported: kerasdist.registry.PluginEntry & co. were here before plugin_entry.py.
from .plugin_entry import BACKEND_INSTALL, PluginEntry, PluginFailure, backend_missing  # noqa: F401
from .specs import OptimizationSpec, StrategySpec

KINDS = ("strategy", "optimization", "export")
_SPEC_BASE = {"strategy": StrategySpec, "optimization": OptimizationSpec}


def normalize(name):
    return str(name).strip().lower()


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


def _other_backends(entry, registered):
    """Whether ``entry`` may share its name with ``registered``: same kind, each for its own backends
    (none empty, none shared), so that lookup picks the running backend's."""
    return bool(entry.backends) and all(
        e.kind == entry.kind and e.name == entry.name and e.backends and not set(e.backends) & set(entry.backends)
        for e in registered)


def _running_backends(candidates):
    """Of the entries registered under one word, the running backend's (else the first), or None."""
    if len(candidates) > 1:
        backend = keras_backend()
        return next((e for e in candidates if backend in e.backends), candidates[0])
    return candidates[0] if candidates else None


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
            candidates = self._candidates(_key(_namespace(entry.kind), normalize(key)))
            existing = _running_backends(candidates)
            if existing is not None and not override and _other_backends(entry, candidates):
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
        return _running_backends(self._candidates(_key(space, normalize(key))))

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
