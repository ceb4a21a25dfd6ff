"""``kerasdist.export``: post-training conversion through a registered exporter, and what it returns."""

import dataclasses
from typing import Optional

from .errors import PluginUnavailableError


@dataclasses.dataclass
class ExportResult:
    """What an exporter wrote; ``os.fspath(result)`` is the file's path. Exporters should return one
    (a plain path is accepted too); the verification fields stay None/0 when nothing was checked."""

    path: str
    format: str
    size_bytes: int
    max_abs_diff: Optional[float] = None
    argmax_agreement: Optional[float] = None
    samples_checked: int = 0

    def __fspath__(self):
        return self.path


def export(model, filepath, format, **options):
    """Convert ``model`` to ``format`` (see ``kerasdist plugins --kind export``) and write ``filepath``.

    Options are checked against the exporter's before anything runs."""
    from .manager import get_system

    entry = get_system().registry.get(format, kinds=("export",))
    entry.check_options(options)
    reason = entry.unavailable_reason()
    if reason:
        raise PluginUnavailableError(f"Export format {entry.name!r} cannot run here: {reason}.")
    return entry.factory(model, filepath, **{**entry.defaults, **options})
