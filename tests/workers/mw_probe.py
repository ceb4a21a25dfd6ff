"""tests/workers/mw_train.py with the transport probe's result printed ("PROBE <json>", every worker).

PROBE_TEST_FAVOUR="<rank 0>,<rank 1>" ("tcp" or "tensorflow" each) makes each worker's own probe
favour that transport (its real medians, the smaller one given to it), so the workers' own
measurements disagree: only rank 0's decision may be used.
"""

import kerasdist  # noqa: I001  first: joins the cluster before any TensorFlow op

import dataclasses
import json
import logging
import os
import runpy
import sys

from kerasdist_plugins.multiworker import probe


def favour(transport, measure):
    def rigged(ring, strategy, size):
        ring_s, tensorflow_s, rounds = measure(ring, strategy, size)
        low, high = sorted((ring_s, tensorflow_s))
        return (low, high, rounds) if transport == "tcp" else (high, low, rounds)

    return rigged


def main():
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s", stream=sys.stdout)
    if os.environ.get("PROBE_TEST_FAVOUR"):
        transport = os.environ["PROBE_TEST_FAVOUR"].split(",")[kerasdist.detect_cluster().task_index]
        probe._medians = favour(transport, probe._medians)
    sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mw_train.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise
    result = probe.last_probe()
    print("PROBE " + json.dumps(result and dataclasses.asdict(result)), flush=True)


if __name__ == "__main__":
    main()
