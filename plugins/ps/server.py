"""The ps and worker tasks: ``python -m kerasdist_plugins.ps`` serves one of them."""

import os
import sys
import time

import kerasdist
from kerasdist import ClusterConfigError, KerasdistError
from kerasdist.plugin_tools import check_number, number_from_env, split_address, unreachable

from .cluster import SERVING_JOBS

EXIT_GRACE_VAR = "KERASDIST_PS_EXIT_GRACE"
DEFAULT_EXIT_GRACE = 60.0


def serve(cluster=None, inter_op_threads=None, coordinator=None, exit_grace=DEFAULT_EXIT_GRACE):
    """Run this process's ps or worker task (the cluster from TF_CONFIG by default).

    Returns once the coordinator (``coordinator`` "host:port", by default the cluster's "chief"), after
    having been seen, has been gone for ``exit_grace`` seconds: finished or killed. Without a
    coordinator to watch, or with ``exit_grace=None``, serves until killed."""
    import tensorflow as tf

    cluster = cluster or kerasdist.detect_cluster()
    if cluster.is_local or cluster.task_type not in SERVING_JOBS or not cluster.has_parameter_servers:
        raise ClusterConfigError(
            f"ps serve: this process is not a ps or worker task of a parameter-server cluster (task "
            f"{cluster.task_type}:{cluster.task_index}, jobs {sorted(cluster.cluster) or 'none'}, source "
            f"{cluster.source}). Set TF_CONFIG, e.g. {{\"cluster\": {{\"worker\": [\"h1:2222\"], \"ps\": "
            "[\"h2:2222\"], \"chief\": [\"h0:2222\"]}, \"task\": {\"type\": \"ps\", \"index\": 0}}.")
    jobs = {job: list(cluster.cluster[job]) for job in SERVING_JOBS}
    config = tf.compat.v1.ConfigProto()
    # A worker blocks an inter-op thread while a step waits for variables: never run with just one.
    config.inter_op_parallelism_threads = max(2, inter_op_threads or os.cpu_count() or 2)
    server = tf.distribute.Server(tf.train.ClusterSpec(jobs), job_name=cluster.task_type,
                                  task_index=cluster.task_index, protocol=cluster.rpc_layer or "grpc",
                                  config=config, start=True)
    print(f"kerasdist ps: serving {cluster.task_type} {cluster.task_index} at "
          f"{jobs[cluster.task_type][cluster.task_index]}", flush=True)
    coordinator = coordinator or next(iter(cluster.cluster.get("chief", ())), None)
    if coordinator is None or exit_grace is None:
        print("kerasdist ps: no coordinator to watch (give --coordinator HOST:PORT): serving until killed",
              flush=True)
        server.join()
        return
    wait_until_gone(coordinator, exit_grace)
    print(f"kerasdist ps: the coordinator at {coordinator} has been gone for {exit_grace:g} s (finished or "
          "stopped): exiting", flush=True)


def wait_until_gone(address, grace, poll=1.0):
    """Return once ``address`` has refused connections for ``grace`` seconds, after accepting one."""
    seen, gone_since = False, None
    poll = min(poll, max(0.1, grace / 4))
    while True:
        down = unreachable([address], timeout=poll)
        now = time.monotonic()
        if not down:
            if not seen:
                print(f"kerasdist ps: the coordinator at {address} is up; exiting {grace:g} s after it is gone",
                      flush=True)
            seen, gone_since = True, None
        elif seen:
            gone_since = gone_since if gone_since is not None else now
            if now - gone_since >= grace:
                return
        time.sleep(poll)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kerasdist_plugins.ps",
        description="Serve this process's ps or worker task of a parameter-server cluster (from TF_CONFIG).")
    parser.add_argument("--inter-op-threads", type=int, default=None)
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="the coordinator to watch (default: the 'chief' task of TF_CONFIG)")
    parser.add_argument("--exit-grace", default=None, metavar="SECONDS",
                        help=f"exit this long after the coordinator is gone; 'never' serves until killed "
                             f"({EXIT_GRACE_VAR}, default {DEFAULT_EXIT_GRACE:g})")
    args = parser.parse_args(argv)
    try:
        grace = exit_grace_of(args.exit_grace, os.environ)
        if args.coordinator is not None:
            split_address(args.coordinator, "python -m kerasdist_plugins.ps --coordinator")
        serve(inter_op_threads=args.inter_op_threads, coordinator=args.coordinator, exit_grace=grace)
    except KerasdistError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os._exit(0)  # TensorFlow's server threads never end by themselves


def exit_grace_of(value, environ):
    """Seconds from ``--exit-grace`` or KERASDIST_PS_EXIT_GRACE (checked), None for 'never'."""
    if value is None:
        if str(environ.get(EXIT_GRACE_VAR, "")).strip().lower() == "never":
            return None
        return number_from_env(environ, EXIT_GRACE_VAR, float, DEFAULT_EXIT_GRACE, minimum=0)
    if str(value).strip().lower() == "never":
        return None
    try:
        number = float(value)
    except ValueError:
        number = value
    return check_number(number, "--exit-grace", "python -m kerasdist_plugins.ps", minimum=0)
