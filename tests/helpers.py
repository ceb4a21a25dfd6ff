"""Helpers for tests that start real processes: loopback only, always a timeout, nothing left behind."""

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
# Child processes keep kerasdist's fit backups here, not in the user's ~/.cache/kerasdist/backups: one folder a test
# process (this module is imported as "helpers" and as "tests.helpers": one folder for both), removed when the
# session finishes (tests/conftest.py) or, outside pytest, when the process exits
BACKUP_ROOT = (getattr(sys.modules.get("tests.helpers"), "BACKUP_ROOT", None)
               or getattr(sys.modules.get("helpers"), "BACKUP_ROOT", None))
if BACKUP_ROOT is None:
    BACKUP_ROOT = tempfile.mkdtemp(prefix="kerasdist-test-backups-")
    atexit.register(shutil.rmtree, BACKUP_ROOT, True)


_ports_given = set()


def free_port():
    """A free TCP port on 127.0.0.1, never one this test process was already given (two calls in a
    row could otherwise get the same port back from the kernel)."""
    while True:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_given:
            _ports_given.add(port)
            return port


def child_env(**extra):
    """The environment for a child Python process: no inherited cluster or replica settings, fit's backups in
    this test process's :data:`BACKUP_ROOT` (KERASDIST_BACKUP_DIR), and multiworker's ``auto`` keeps the TCP ring
    unmeasured (no timing probe, so a test's transport does not depend on the machine's load) unless ``extra``
    sets KERASDIST_TRANSPORT_PROBE or KERASDIST_BACKUP_DIR."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KERASDIST_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_")) and k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["KERASDIST_TRANSPORT_PROBE"] = "off"
    env["KERASDIST_BACKUP_DIR"] = BACKUP_ROOT
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def weights(directory, task):
    """The weights worker ``task`` saved as ``weights-<task>.npz`` in ``directory`` (tests/workers/mw_train.py)."""
    import numpy as np

    with np.load(os.path.join(directory, f"weights-{task}.npz")) as data:
        return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def max_diff(a, b):
    """The largest absolute difference between two lists of arrays."""
    import numpy as np

    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def run(cmd, timeout, env=None, cwd=ROOT, check=True):
    """Run ``cmd`` in its own process group; kill the whole group on timeout. Returns CompletedProcess."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout}s; output:\n{out[-4000:]}")
    finally:
        kill_group(proc)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}; output:\n{out[-6000:]}")
    return result


def start(cmd, **env):
    """Start ``cmd`` in its own process group with ``child_env(**env)``, output captured."""
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(procs, timeout):
    """Wait for every process; kill all groups on timeout. Returns [(returncode, output)]."""
    import time

    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append((proc.returncode, out))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"processes did not finish within {timeout}s")
    finally:
        for proc in procs:
            kill_group(proc)
    return results


def torch_env(**extra):
    """Variables of a torch child process (the pytest process itself runs TensorFlow's backend)."""
    return dict(KERAS_BACKEND="torch", OMP_NUM_THREADS=1, TF_CPP_MIN_LOG_LEVEL=3, **extra)


def torchrun_two(argv, timeout=240):
    """``python argv`` in 2 processes with torchrun's variables (rendezvous on a free loopback port);
    ``finish``'s ``[(returncode, output)]``."""
    port = free_port()
    procs = [start([PYTHON, *argv], **torch_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2,
                                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    return finish(procs, timeout=timeout)


def processes_with(token):
    """Pids of this machine's processes whose command line contains ``token``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def kill_group(proc):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def python(*args):
    return [PYTHON, *args]


def write_plugin_distribution(directory, name, module_source, entry_points):
    """Write an importable plugin module plus its .dist-info (entry points) into ``directory``.

    Put ``directory`` on PYTHONPATH and importlib.metadata finds it like a pip-installed package.
    """
    os.makedirs(directory, exist_ok=True)
    module = name.replace("-", "_")
    with open(os.path.join(directory, module + ".py"), "w") as f:
        f.write(module_source)
    info = os.path.join(directory, f"{module}-1.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[kerasdist]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return directory
