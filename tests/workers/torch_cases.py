"""Runs several training scenarios in turn in one process (one torch + Keras start-up, one rendezvous for all).

    python torch_cases.py SCRIPT OUT_DIR 'JSON list of {"name": NAME, "argv": [...]}'

SCRIPT is a worker whose ``main(argv)`` runs one scenario (tests/workers/torch_train.py, equivalence_script.py,
torch_fsdp_train.py). A scenario that raises is recorded, not fatal: OUT_DIR/NAME.error-rank{r}.txt holds
``ExceptionType: message`` and the next scenario runs (each test checks its own scenario). Exits 1 if any raised.
"""

import importlib.util
import json
import os
import sys
import traceback


def load(script):
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(script))[0], script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(script, out_dir, cases):
    module = load(script)
    rank = os.environ.get("RANK", "0")
    os.makedirs(out_dir, exist_ok=True)
    failed = 0
    for case in json.loads(cases):
        print(f"[case {case['name']}] rank {rank}: start", flush=True)
        try:
            module.main(case["argv"])
        except Exception as exc:  # noqa: BLE001  recorded for the case's own test
            failed += 1
            traceback.print_exc()
            with open(os.path.join(out_dir, f"{case['name']}.error-rank{rank}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
        print(f"[case {case['name']}] rank {rank}: end", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
