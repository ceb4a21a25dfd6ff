"""The built wheel: its contents, a fresh install, and a user's own TensorFlow left alone."""

import glob
import json
import os
import shutil
import subprocess
import zipfile

import pytest

from tests.helpers import ROOT, child_env, python, run

PIP = ["-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built from a copy of the tree (building in place would leave build/ and *.egg-info,
    whose stale metadata then shadows the installed package's for code run from the repository)."""
    work = tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    for name in tracked:
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(work, "src", name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(work, "src", name))
    run(python(*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(work / "src")),
        timeout=240)
    (path,) = glob.glob(str(work / "dist" / "kerasdist-*.whl"))
    return path


def _fresh_venv(path):
    run(python("-m", "venv", "--without-pip", str(path)), timeout=120)
    return str(path / "bin" / "python")


@pytest.mark.timeout(300)
def test_wheel_has_no_generic_top_level_names(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"kerasdist", "kerasdist_plugins"}
    assert "kerasdist_plugins/mirrored.py" in names and not any(n.startswith("plugins/") for n in names)
    assert "kerasdist_plugins/multiworker/ring.py" in names and "kerasdist_plugins/ps/__main__.py" in names
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "[kerasdist]" in entry_points and "mirrored = kerasdist_plugins.mirrored" in entry_points
    assert "[kerasdist.cluster_hints]" in entry_points and "TF_CONFIG = kerasdist_plugins.cluster_env" in entry_points
    assert "kerasdist = kerasdist.cli:main" in entry_points


@pytest.mark.timeout(300)
def test_wheel_installs_into_a_fresh_venv_and_lists_the_builtins(wheel, tmp_path):
    venv_python = _fresh_venv(tmp_path / "venv")
    # pluggy is the one dependency `kerasdist plugins` needs: listing imports neither Keras nor TensorFlow.
    run(python(*PIP, "--python", venv_python, "install", "--no-deps", wheel, "pluggy"), timeout=240)
    out = run([str(tmp_path / "venv" / "bin" / "kerasdist"), "plugins", "--json"], timeout=60,
              cwd=str(tmp_path), env=child_env()).stdout
    rows = {r["name"]: r for r in json.loads(out[out.index("["):])}
    builtins = {"mirrored", "multiworker", "central_storage", "tpu", "horovod", "ps", "prune", "litert", "onnx"}
    assert builtins <= set(rows) and all(rows[name]["package"] == "kerasdist" for name in builtins)
    assert "not installed" in rows["mirrored"]["reason"] and "kerasdist[cpu]" in rows["mirrored"]["reason"]


def _stand_in_distribution(venv, name, version):
    """Make pip see ``name`` as installed in ``venv`` (as a user's CUDA TensorFlow would be)."""
    (site,) = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
    info = os.path.join(site, f"{name}-{version}.dist-info")
    os.makedirs(info)
    for filename, text in (("METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"),
                           ("INSTALLER", "pip\n"), ("RECORD", "")):
        with open(os.path.join(info, filename), "w") as f:
            f.write(text)


@pytest.mark.timeout(400)
def test_installing_the_wheel_keeps_an_installed_tensorflow(wheel, tmp_path):
    venv = tmp_path / "venv"
    venv_python = _fresh_venv(venv)
    _stand_in_distribution(venv, "tensorflow", "2.21.0")
    report = tmp_path / "report.json"
    run(python(*PIP, "--python", venv_python, "install", "--dry-run", "--report",
               str(report), wheel), timeout=300, env=child_env())
    to_install = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "kerasdist" in to_install and "keras" in to_install
    assert not {"tensorflow-cpu", "tensorflow", "tensorflow-intel"} & to_install, sorted(to_install)


def test_the_set_up_keeps_scikit_learn_beside_the_venv_with_its_digits():
    """Keras imports scikit-learn at every `import keras` when it is installed (1.5-2.5 s of each of the suite's
    process starts): the set-up puts it beside the venv (requirements/test-data.in), where only its data is read."""
    import importlib.util
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    import qat_digits

    assert importlib.util.find_spec("sklearn") is None, "scikit-learn is in the venv: see requirements/test-data.in"
    x, y, x_test, y_test = qat_digits.digits()
    assert (x.shape, x_test.shape, y.shape) == ((1400, 8, 8, 1), (397, 8, 8, 1), (1400,))
    assert 0.0 <= x.min() and x.max() == 1.0 and sorted(set(y.tolist())) == list(range(10))
