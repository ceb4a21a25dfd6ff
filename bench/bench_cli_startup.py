"""Wall time of `kerasdist plugins` (median of N runs) and whether listing plugins imports Keras/TensorFlow.

    python bench/bench_cli_startup.py [VENV ...]     # default: the running interpreter's venv

Pass several venvs (e.g. one with an older checkout installed) to compare them interleaved, round by round.
"""

import os
import statistics
import subprocess
import sys
import time

ROUNDS = 5
CHECK = ("import sys, kerasdist; kerasdist.list_plugins(); "
         "print(sorted(m for m in ('keras', 'tensorflow') if m in sys.modules))")


def main(venvs):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    times = {venv: [] for venv in venvs}
    for _ in range(ROUNDS):
        for venv in venvs:
            start = time.perf_counter()
            subprocess.run([os.path.join(venv, "bin", "kerasdist"), "plugins"], capture_output=True, cwd="/",
                           env=env, check=True)
            times[venv].append(time.perf_counter() - start)
    for venv in venvs:
        imported = subprocess.run([os.path.join(venv, "bin", "python"), "-c", CHECK], capture_output=True,
                                  text=True, cwd="/", env=env).stdout.strip()
        runs = ", ".join(f"{t:.2f}" for t in times[venv])
        print(f"{venv}: `kerasdist plugins` median {statistics.median(times[venv]):.2f} s ({runs}); "
              f"modules imported by listing: {imported}")
    print(f"load average during the run: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or [os.path.dirname(os.path.dirname(sys.executable))])
