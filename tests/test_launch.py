"""``kerasdist launch``: argument checks, loopback TF_CONFIG, streaming, failure and signal handling."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kerasdist import KerasdistError, cli, launch
from kerasdist_plugins import cluster_env
from tests.helpers import ROOT, child_env, kill_group, run

KERASDIST = os.path.join(os.path.dirname(sys.executable), "kerasdist")
CHILD = os.path.join(ROOT, "tests", "workers", "launch_child.py")


def parse(*argv):
    return cli.build_parser().parse_args(["launch", *argv])


def test_zero_workers_is_refused(capsys):
    assert cli.main(["launch", "-n", "0", CHILD]) == 2
    assert "-n 0 is not valid" in capsys.readouterr().err


def test_missing_script_is_refused(capsys):
    assert cli.main(["launch", "-n", "2", "--", "no_such_script.py"]) == 2
    assert "script 'no_such_script.py' does not exist" in capsys.readouterr().err


def test_port_in_use_is_refused(capsys):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["launch", "-n", "1", "--port-base", str(port), CHILD, "ok", "."]) == 2
    assert f"port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_script_arguments_after_double_dash_are_kept():
    args = parse("-n", "2", "--", CHILD, "--epochs", "3")
    assert args.nproc == 2 and args.script == ["--", CHILD, "--epochs", "3"]


def test_each_worker_gets_a_loopback_tf_config_that_resolves():
    args = parse("-n", "3", "--communication", "ring", "--join-timeout", "9", CHILD)
    envs = launch.worker_environments(args, environ={"SLURM_PROCID": "4", "PATH": "/bin"})
    infos = [cluster_env.kerasdist_detect_cluster(env) for env in envs]
    assert [i.task_index for i in infos] == [0, 1, 2]
    addresses = infos[0].cluster["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert all(env["KERASDIST_COMMUNICATION"] == "ring" and env["KERASDIST_JOIN_TIMEOUT"] == "9.0" for env in envs)
    assert all("SLURM_PROCID" not in env for env in envs)


def test_grace_above_the_limit_is_refused():
    with pytest.raises(KerasdistError, match="--grace 60"):
        launch.check_arguments(argparse.Namespace(nproc=2, script=[CHILD], module=False, grace=60, port_base=0,
                                                  host="127.0.0.1", threads="auto"))


@pytest.mark.parametrize("argv,environ,cores,expected", [
    (["-n", "2"], {}, 2, "1"),
    (["-n", "2"], {}, 16, "8"),
    (["-n", "3"], {}, 2, "1"),
    (["-n", "2"], {"OMP_NUM_THREADS": "2"}, 2, "2"),
    (["-n", "2", "--threads", "3"], {}, 2, "3"),
    (["-n", "2", "--threads", "3"], {"OMP_NUM_THREADS": "4"}, 2, "4"),
    (["-n", "2", "--threads", "off"], {}, 2, None),
    (["-n", "1"], {}, 2, None),
], ids=["2-cores", "16-cores", "more-workers-than-cores", "user-set-kept", "threads-3", "user-set-beats-threads",
        "off", "one-worker"])
def test_each_worker_gets_its_share_of_the_cores_unless_set(argv, environ, cores, expected):
    args = parse(*argv, CHILD)
    settings = launch.thread_settings(args, environ, cores=cores)
    envs = launch.worker_environments(args, environ=dict(environ, PATH="/bin"), threads=settings)
    assert [env.get("OMP_NUM_THREADS") for env in envs] == [expected] * len(envs)


@pytest.mark.parametrize("value", ["0", "many", "-1"])
def test_bad_threads_is_refused(value, capsys):
    assert cli.main(["launch", "-n", "2", "--threads", value, CHILD]) == 2
    assert f"--threads {value!r} is not valid" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_output_is_prefixed_and_success_is_zero():
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    result = run([KERASDIST, "launch", "-n", "2", CHILD, "ok", "."], timeout=50, env=env)
    assert "[0] hello from worker 0 of 2" in result.stdout and "[1] hello from worker 1 of 2" in result.stdout
    # torchrun's OMP_NUM_THREADS=1, as each worker's share of the cores, said once
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert result.stdout.count(f"; OMP_NUM_THREADS={share}") == 2
    assert result.stdout.count(f"kerasdist launch: each of the 2 workers gets OMP_NUM_THREADS={share} ") == 1


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_crashing_worker_stops_the_others_within_30s_and_leaves_no_process(tmp_path):
    started = time.monotonic()
    result = run([KERASDIST, "launch", "-n", "3", "--grace", "2", CHILD, "crash", str(tmp_path)], timeout=80,
                 check=False)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stdout
    assert "worker 1 exited with exit code 3; stopping the other workers" in result.stdout
    assert elapsed < 30, f"launcher took {elapsed:.1f} s"
    pids = [int(p) for name in os.listdir(tmp_path) for p in open(tmp_path / name).read().split()]
    assert len(pids) == 4  # workers 0 and 2 (ignoring SIGTERM) and their grandchildren
    assert not [p for p in pids if _alive(p)], "orphan processes left behind"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigterm_is_forwarded_to_every_worker(tmp_path):
    proc = subprocess.Popen([KERASDIST, "launch", "-n", "2", CHILD, "term", str(tmp_path)], env=child_env(),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(tmp_path) if n.startswith("ready")]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        kill_group(proc)
    assert code == 143
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("term")) == ["term-0", "term-1"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_workers_that_ignore_sigterm_are_killed_after_the_grace(tmp_path):
    proc = subprocess.Popen([KERASDIST, "launch", "-n", "2", "--grace", "2", CHILD, "stubborn", str(tmp_path)],
                            env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(tmp_path) if n.startswith("ready")]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
            time.sleep(0.2)
        pids = [int((tmp_path / f"ready-{i}").read_text()) for i in range(2)]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        waited = time.monotonic() - start
        out = proc.stdout.read().decode()
    finally:
        kill_group(proc)
    assert code == 143 and 2 <= waited < 12, (code, waited)
    assert "killing them" in out and not any(_alive(pid) for pid in pids)


def test_launch_help_and_env_say_what_listens_where(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    assert "listen on EVERY interface" in capsys.readouterr().out.replace("\n", " ")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
                                                "task": {"type": "worker", "index": 1}}))
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "  *:2223  (all interfaces)  multiworker: TensorFlow's gRPC server" in out
    assert "  127.0.0.1:<free port>  (the address's interfaces)  multiworker: kerasdist's TCP ring" in out
