"""A worker for launcher tests (no TensorFlow): python launch_child.py MODE OUT_DIR.

ok:    print a line naming the task and its thread settings, exit 0.
crash: worker 1 exits 3 at once; the others ignore SIGTERM and start a grandchild, then sleep.
term:  record SIGTERM in OUT_DIR/term-<index> and exit 143.
stubborn: ignore SIGTERM and sleep (the launcher must SIGKILL after its grace).
"""

import json
import os
import signal
import subprocess
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]


def record(name, text):
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


if mode == "ok":
    print(f"hello from worker {index} of {len(workers)}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
          flush=True)
    sys.exit(0)
if mode == "crash":
    if index == 1:
        time.sleep(0.5)
        print("worker 1 fails", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "600"])
    record(f"pids-{index}", f"{os.getpid()} {grandchild.pid}")
    time.sleep(600)
if mode == "stubborn":  # ignores SIGTERM, as a worker blocked in native code does
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record(f"ready-{index}", str(os.getpid()))
    time.sleep(600)
if mode == "term":
    def on_term(signum, frame):
        record(f"term-{index}", "SIGTERM")
        sys.exit(143)
    signal.signal(signal.SIGTERM, on_term)
    record(f"ready-{index}", str(os.getpid()))
    time.sleep(600)
