"""tests/workers/mw_train.py, counting the row-count all-reduces traced over kerasdist's TCP ring.

    kerasdist launch -n 2 --communication tcp tests/workers/mw_row_counts.py <mw_train.py arguments>

Prints "ROW_COUNTS_OVER_RING <n>" (n: how many times a train step was traced with the per-step row count
summed by ``TcpRing.sum_count``) after mw_train.py's own output.
"""

import kerasdist  # noqa: F401, I001  first: joins the cluster before any TensorFlow op

import os
import runpy
import sys

from kerasdist_plugins.multiworker import ring

traced = []
ring_sum_count = ring.TcpRing.sum_count


def counting_sum_count(self, count):
    traced.append(count)
    return ring_sum_count(self, count)


ring.TcpRing.sum_count = counting_sum_count
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mw_train.py")
sys.argv = [script, *sys.argv[1:]]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    print(f"ROW_COUNTS_OVER_RING {len(traced)}", flush=True)
