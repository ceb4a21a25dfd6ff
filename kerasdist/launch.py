"""``kerasdist launch -n N script.py``: N local workers, each with a loopback TF_CONFIG.

Like ``torchrun --standalone``: free ports are picked on 127.0.0.1, each worker's
output is streamed with a ``[i]`` prefix, SIGINT/SIGTERM are forwarded, and when
a worker fails the others are stopped (SIGTERM, then SIGKILL after a grace
period) and the launcher exits non-zero. As torchrun sets OMP_NUM_THREADS=1, each
worker gets its share of the cores as thread settings (:func:`thread_settings`).
"""

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from .cluster import LaunchWorker, cluster_hint_variables
from .errors import ClusterConfigError, KerasdistError
from .plugin_tools import port_is_free

DEFAULT_GRACE_S = 5.0
MAX_GRACE_S = 25.0
_POLL_S = 0.1
#: Thread-count variables each worker gets (unless set): torch's intra-op pool, as torchrun.
THREAD_VARIABLES = ("OMP_NUM_THREADS",)


def pick_ports(count, host="127.0.0.1"):
    """``count`` distinct free TCP ports on ``host`` (held open together, so no repeats)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def check_ports_free(ports, host="127.0.0.1"):
    for port in ports:
        if not port_is_free(port):
            raise ClusterConfigError(
                f"kerasdist launch: port {port} on {host} is already in use; choose another --port-base "
                "or leave it out to pick free ports.")


def thread_settings(args, environ, cores=None):
    """``{variable: value}`` giving each of ``args.nproc`` local workers its share of the cores (at least 1), as
    torchrun gives OMP_NUM_THREADS=1 when it starts more than one; a variable the user set is left alone.

    OMP_NUM_THREADS sizes torch's intra-op pool (and OpenMP's anywhere). TensorFlow's TF_NUM_INTRAOP_THREADS and
    XLA's --xla_cpu_multi_thread_eigen=false were measured too and are not set: they made TF workers slower and
    JAX workers no faster (docs/benchmarks.md). ``--threads N`` gives N instead of the share, ``off`` nothing."""
    if args.threads == "off" or (args.threads == "auto" and args.nproc <= 1):
        return {}
    if args.threads == "auto":
        cores = cores or len(os.sched_getaffinity(0))
        count = max(1, cores // args.nproc)
    else:
        count = int(args.threads)
    return {name: str(count) for name in THREAD_VARIABLES if name not in environ}


def describe_thread_settings(settings, args):
    """The one line the launcher prints about them (torchrun prints a warning)."""
    given = " ".join(f"{name}={value}" for name, value in settings.items())
    return (f"each of the {args.nproc} workers gets {given} (its share of {len(os.sched_getaffinity(0))} cores); "
            "set it yourself, or pass --threads N or --threads off, to change it.")


def worker_environments(args, environ=None, system=None, threads=None):
    """One environment per worker: the caller's minus its cluster variables, plus the thread settings
    (``threads``, else :func:`thread_settings`) and what plugins add."""
    from .manager import get_system

    system = system or get_system()
    environ = dict(os.environ if environ is None else environ)
    environ.update(thread_settings(args, environ) if threads is None else threads)
    ports = list(range(args.port_base, args.port_base + args.nproc)) if args.port_base else None
    if ports:
        check_ports_free(ports, args.host)
    addresses = tuple(f"{args.host}:{port}" for port in (ports or pick_ports(args.nproc, args.host)))
    for name in cluster_hint_variables():
        environ.pop(name, None)  # the workers form their own cluster, whatever launched the launcher
    environs = []
    for index in range(args.nproc):
        env = dict(environ, PYTHONUNBUFFERED="1")
        worker = LaunchWorker(index, args.nproc, args.host, addresses)
        system.hook.kerasdist_launch_environment(args=args, worker=worker, environ=env)
        environs.append(env)
    return environs


def check_arguments(args):
    if args.nproc < 1:
        raise KerasdistError(f"kerasdist launch: -n {args.nproc} is not valid; give the number of worker "
                             "processes to start, 1 or more (e.g. -n 2).")
    if not args.script:
        raise KerasdistError("kerasdist launch: no script given; usage: kerasdist launch -n 2 [--] train.py [args]")
    if not args.module and not os.path.isfile(args.script[0]):
        raise KerasdistError(f"kerasdist launch: script {args.script[0]!r} does not exist (looked in "
                             f"{os.getcwd()}); give the path of a Python file, or -m for a module.")
    if args.port_base and not 1 <= args.port_base <= 65536 - args.nproc:
        raise KerasdistError(f"kerasdist launch: --port-base {args.port_base} with -n {args.nproc} is not valid: the "
                             f"ports {args.port_base}..{args.port_base + args.nproc - 1} must lie in 1..65535; "
                             f"give at most {65536 - args.nproc}, or leave it out to pick free ports.")
    try:
        socket.getaddrinfo(args.host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise KerasdistError(f"kerasdist launch: --host {args.host!r} does not resolve ({exc}); give this "
                             "machine's address the workers use, e.g. 127.0.0.1 (the default).") from None
    if args.threads not in ("auto", "off") and not (args.threads.isdigit() and int(args.threads) >= 1):
        raise KerasdistError(f"kerasdist launch: --threads {args.threads!r} is not valid; give a number of "
                             "threads per worker (1 or more), 'auto' (cores // workers, the default) or 'off'.")
    if not 0 <= args.grace <= MAX_GRACE_S:
        raise KerasdistError(f"kerasdist launch: --grace {args.grace} must be between 0 and {MAX_GRACE_S:g} s "
                             "(the others are stopped within 30 s of a failure).")


class Launcher:
    """Starts the workers, streams their output, and stops all of them if one fails."""

    def __init__(self, command, environs, grace=DEFAULT_GRACE_S, out=None):
        self.command, self.environs, self.grace = command, environs, grace
        self.out = out or sys.stdout
        self.procs, self._threads = [], []
        self._lock = threading.Lock()
        self._signal, self._signalled_at = None, None

    def say(self, message):
        with self._lock:
            sys.stderr.write(f"kerasdist launch: {message}\n")
            sys.stderr.flush()

    def start(self):
        for index, env in enumerate(self.environs):
            proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
            self.procs.append(proc)
            thread = threading.Thread(target=self._stream, args=(index, proc), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _stream(self, index, proc):
        prefix = f"[{index}] ".encode()
        stream = getattr(self.out, "buffer", None)
        for line in iter(proc.stdout.readline, b""):
            with self._lock:
                if stream is not None:
                    stream.write(prefix + line)
                    stream.flush()
                else:
                    self.out.write((prefix + line).decode(errors="replace"))
                    self.out.flush()
        proc.stdout.close()

    def _on_signal(self, signum, frame):
        self._signal = signum
        self._signalled_at = time.monotonic()
        for proc in self.procs:
            _signal_group(proc, signum)

    def run(self):
        """Run to completion; the exit status of the launch (0 when every worker succeeded)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            return self._supervise()
        finally:
            self.stop()
            for thread in self._threads:
                thread.join(timeout=5)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _supervise(self):
        while True:
            codes = [proc.poll() for proc in self.procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                if self._signal is None:
                    self.say(f"worker {index} exited with {_describe(code)}; stopping the other workers.")
                self.stop()
                return code if code > 0 else 128 - code
            if self._signal is not None and all(c is not None for c in codes):
                return 128 + self._signal
            if self._signal is not None and time.monotonic() - self._signalled_at > self.grace:
                self.say(f"workers still running {self.grace:g} s after {signal.Signals(self._signal).name}; "
                         "killing them.")
                self.stop()  # a worker blocked in native code ignores the signal: SIGKILL after the grace
                return 128 + self._signal
            if all(c == 0 for c in codes):
                return 0
            time.sleep(_POLL_S)

    def stop(self):
        """SIGTERM every running worker's process group, SIGKILL whatever is left after the grace period."""
        running = [p for p in self.procs if p.poll() is None]
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in running):
            time.sleep(_POLL_S)
        for proc in self.procs:
            _signal_group(proc, signal.SIGKILL)  # also reaps any grandchildren left in the group
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _describe(code):
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _signal_group(proc, signum):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def _child_setup():
    """In each worker: its own process group, and death if the launcher dies (Linux). A process group, not a new
    session (``setsid``): Linux's scheduler autogroups by session, and a session per worker cost torch workers 3-5%
    a step against torchrun's (bench/launch_threads.py; docs/benchmarks.md)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def add_arguments(parser):
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of worker processes")
    parser.add_argument("--host", default="127.0.0.1", help="address the workers use (default 127.0.0.1)")
    parser.add_argument("--port-base", type=int, default=0,
                        help="use ports PORT_BASE..PORT_BASE+N-1 (default: pick free ports)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                        help=f"seconds between SIGTERM and SIGKILL when stopping workers (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("--threads", default="auto",
                        help="threads per worker: OMP_NUM_THREADS, unless set (default auto: cores // workers, at "
                             "least 1, as torchrun's OMP_NUM_THREADS=1; 'off': none)")
    parser.add_argument("-m", dest="module", action="store_true", help="run the script argument as a module")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args...] (after an optional --)")
    from .manager import get_system

    implementations = get_system().hook.kerasdist_add_launch_arguments.get_hookimpls()
    for impl in sorted(implementations, key=lambda impl: impl.plugin_name):
        group = parser.add_argument_group(f"options of the {impl.plugin_name} plugin")
        impl.function(**{arg: group for arg in impl.argnames})


def launch(args):
    """The ``kerasdist launch`` command."""
    if args.script and args.script[0] == "--":
        args.script = args.script[1:]
    check_arguments(args)
    command = [sys.executable, "-m", *args.script] if args.module else [sys.executable, *args.script]
    threads = thread_settings(args, os.environ)
    environs = worker_environments(args, threads=threads)
    if threads:
        sys.stderr.write(f"kerasdist launch: {describe_thread_settings(threads, args)}\n")
    scratch = tempfile.mkdtemp(prefix="kerasdist-launch-")
    for env in environs:
        env.setdefault("KERASDIST_SCRATCH_DIR", scratch)
    try:
        return Launcher(command, environs, grace=args.grace).run()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
