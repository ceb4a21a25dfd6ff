"""A TensorFlow gRPC server for one ps or worker task: ``ps_server.py JOB INDEX CLUSTER_JSON``.

CLUSTER_JSON is ``{"worker": ["127.0.0.1:p1", ...], "ps": ["127.0.0.1:p2", ...]}``. The server runs
until it is killed (the tests kill its process group). Prints "ready JOB INDEX" once serving.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    job, index, cluster = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    # Few threads (the test machine has 2 shared cores), but never a single inter-op thread: a worker
    # running a function blocks one inter-op thread while it waits for variables from the ps.
    config.inter_op_parallelism_threads = 4
    config.intra_op_parallelism_threads = 1
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                                  protocol="grpc", config=config, start=True)
    print(f"ready {job} {index}", flush=True)
    server.join()


if __name__ == "__main__":
    main()
