"""Check that a venv holds exactly what the lock files pin (what `pip freeze` lists).

    python .ci/check_lock.py requirements/lock.txt requirements/no-deps.txt
    python .ci/check_lock.py --platform-only 3.11    # before installing: is the lock for this Python?

Run with the venv's own Python. kerasdist itself (editable) and horovod (built here from its sdist,
see .ci/build_horovod.sh) are the only distributions allowed beside the lock.
"""

import platform
import re
import sys
from importlib import metadata

LOCAL_BUILDS = {"kerasdist", "horovod"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(paths):
    pins = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                match = PIN.match(line.strip())
                if match:
                    pins[canonical(match.group(1))] = match.group(2)
    return pins


def installed():
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}


def check_platform(python_version):
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    machine = platform.machine()
    if here != python_version or sys.platform != "linux" or machine != "x86_64":
        sys.exit(f"check_lock: the lock is for CPython {python_version} on Linux x86_64; this venv is "
                 f"Python {here} on {sys.platform} {machine}. Make it with that Python "
                 f"(make PYTHON=python{python_version} ...), or install from the ranges instead: "
                 f"pip install -e '.[cpu,jax,test]' (a set nobody here tested).")


def main(argv):
    if argv[:1] == ["--platform-only"]:
        check_platform(argv[1])
        return 0
    pins, have = pinned(argv), installed()
    problems = []
    for name, version in sorted(pins.items()):
        if name not in have:
            problems.append(f"missing  {name}=={version}")
        elif have[name] != version:
            problems.append(f"differs  {name}: lock {version}, installed {have[name]}")
    for name in sorted(set(have) - set(pins) - LOCAL_BUILDS):
        problems.append(f"extra    {name}=={have[name]} (not in the lock)")
    if problems:
        print("check_lock: the venv is not the locked set:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    local = ", ".join(f"{n}=={have[n]}" for n in sorted(LOCAL_BUILDS & set(have)))
    print(f"check_lock: {len(pins)} locked packages installed exactly; built here: {local}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
