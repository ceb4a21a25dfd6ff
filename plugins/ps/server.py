"""The ps and worker tasks: ``python -m kerasdist_plugins.ps`` serves one of them."""

import os
import sys

import kerasdist
from kerasdist import ClusterConfigError, KerasdistError

from .cluster import SERVING_JOBS


def serve(cluster=None, inter_op_threads=None):
    """Run this process's ps or worker task until it is killed (the cluster from TF_CONFIG by default)."""
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
    server.join()


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kerasdist_plugins.ps",
        description="Serve this process's ps or worker task of a parameter-server cluster (from TF_CONFIG).")
    parser.add_argument("--inter-op-threads", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        serve(inter_op_threads=args.inter_op_threads)
    except KerasdistError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
