"""One registered plugin name (``PluginEntry``), a plugin that failed to load (``PluginFailure``), and the
checks that say whether an entry can run here without importing its dependencies."""

import dataclasses
import importlib.util
import inspect

from .backend import keras_backend
from .errors import KerasdistError, did_you_mean
from .option_types import check_option_types

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
