"""A real Slurm (22.05, Debian's slurmctld, slurmd and munge) on this one node, started and stopped by each test
inside a private network and pid namespace (tests/workers/slurm_one_node.sh: loopback only, every process ends
with the test). What docs/slurm.md promises, as its users run it: ``srun --ntasks 2 python train.py`` trains as one
process; ``sbatch`` with a script that runs ``python`` without ``srun`` trains once, at once, saying so; ``srun
--ntasks 2 kerasdist launch`` is refused in every task with the fix. The placement rules for several nodes are
checked against Slurm's documented layouts in tests/test_cluster_env.py (one node here)."""

import os
import shutil
import subprocess
import textwrap

import numpy as np
import pytest

from helpers import PYTHON, ROOT, child_env, run

pytestmark = [pytest.mark.slow]

ONE_NODE = os.path.join(ROOT, "tests", "workers", "slurm_one_node.sh")
TRAIN = os.path.join(ROOT, "tests", "workers", "mw_train.py")
KERASDIST = os.path.join(os.path.dirname(PYTHON), "kerasdist")
PACKAGES = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge iproute2"


def _missing():
    """Why a one-node Slurm cannot start here, and whether that is a set-up fault (a failure where ``CI`` is set:
    the system step installs the packages as root) or this machine's limit (a skip)."""
    if os.geteuid() != 0:
        return "the one-node Slurm runs its daemons as root in a private network namespace: run as root", False
    tools = [t for t in ("slurmctld", "slurmd", "srun", "sbatch", "munged", "unshare", "ip") if not shutil.which(t)]
    if tools:
        return f"needs {', '.join(tools)}: {PACKAGES} (make test's system step installs them as root)", True
    if subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        return "this machine does not allow a private network and pid namespace (unshare --net --pid)", False
    return None, False


@pytest.fixture
def slurm(tmp_path):
    """Runs ``command`` (a shell line) inside a fresh one-node Slurm; returns its output."""
    reason, set_up_fault = _missing()
    if reason:
        (pytest.fail if set_up_fault and os.environ.get("CI") else pytest.skip)(reason)

    def inside(command, timeout=240, check=True):
        state = tmp_path / "slurm"
        state.mkdir(mode=0o700, exist_ok=True)
        return run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", ONE_NODE, str(state),
                    "bash", "-c", command], timeout=timeout, env=child_env(), check=check)

    return inside


def _weights(path):
    with np.load(path) as saved:
        return [saved[k] for k in sorted(saved.files, key=lambda k: int(k.split("_")[1]))]


def test_srun_two_tasks_train_as_one_process(slurm, tmp_path):
    out, one = tmp_path / "srun", tmp_path / "one"
    result = slurm(f"srun --ntasks 2 {PYTHON} {TRAIN} --out {out}")
    assert "REPLICAS 1" in result.stdout and "FINAL" in result.stdout, result.stdout[-3000:]
    run([PYTHON, TRAIN, "--out", str(one), "--distribute", "none"], timeout=180)
    reference = _weights(one / "weights-0.npz")
    for task in (0, 1):
        got = _weights(out / f"weights-{task}.npz")
        assert max(float(np.abs(a - b).max()) for a, b in zip(got, reference)) <= 1e-5, task


def test_a_batch_script_without_srun_trains_once_at_once(slurm, tmp_path):
    script, log = tmp_path / "job.sh", tmp_path / "job.out"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --ntasks=2
        #SBATCH --output={log}
        {PYTHON} -c "import kerasdist; c = kerasdist.detect_cluster(); print('LOCAL', c.is_local)"
        """))
    slurm(f"sbatch --wait {script}", timeout=120)
    text = log.read_text()
    assert "Slurm batch script outside srun" in text and "training as one process" in text, text[-3000:]
    assert "LOCAL True" in text, text[-3000:]


def test_kerasdist_launch_in_a_two_task_step_is_refused_in_every_task(slurm, tmp_path):
    result = slurm(f"srun --ntasks 2 {KERASDIST} launch -n 2 {TRAIN} --out {tmp_path / 'never'}", timeout=120,
                   check=False)
    assert result.returncode != 0
    assert result.stdout.count("this is one of the 2 tasks of an srun step") == 2, result.stdout[-3000:]
    assert "srun --ntasks 1 kerasdist launch" in result.stdout
    assert not (tmp_path / "never").exists()


def test_torch_tasks_of_an_srun_step_form_one_group_without_tensorflow(slurm, tmp_path):
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent("""\
        import sys
        import kerasdist
        import keras
        import torch.distributed as dist
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", distribute="data_parallel")
        print("RANK", dist.get_rank(), "OF", dist.get_world_size(), "TF", "tensorflow" in sys.modules, flush=True)
        """))
    result = slurm(f"KERAS_BACKEND=torch OMP_NUM_THREADS=1 srun --ntasks 2 {PYTHON} {script}", timeout=180)
    ranks = sorted(line for line in result.stdout.splitlines() if line.startswith("RANK"))
    assert ranks == ["RANK 0 OF 2 TF False", "RANK 1 OF 2 TF False"], result.stdout[-3000:]
