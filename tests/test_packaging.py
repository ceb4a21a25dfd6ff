"""The wheel installs only kerasdist's own import names, and the built-in plugins as entry points."""

import glob
import zipfile

import pytest

from tests.helpers import ROOT, python, run


@pytest.mark.timeout(300)
def test_wheel_has_no_generic_top_level_names(tmp_path):
    run(python("-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), ROOT),
        timeout=240)
    (wheel,) = glob.glob(str(tmp_path / "kerasdist-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"kerasdist", "kerasdist_plugins"}
    assert "kerasdist_plugins/mirrored.py" in names and not any(n.startswith("plugins/") for n in names)
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "[kerasdist]" in entry_points and "mirrored = kerasdist_plugins.mirrored" in entry_points
    assert "kerasdist = kerasdist.cli:main" in entry_points
