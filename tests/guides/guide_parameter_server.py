"""Guide: "Parameter server training with ParameterServerStrategy" (TensorFlow tutorial), its cluster set-up
and "Training with Model.fit" sections
https://www.tensorflow.org/tutorials/distribute/parameter_server_training
Source: tensorflow/docs site/en/tutorials/distribute/parameter_server_training.ipynb (Apache-2.0).
Like the tutorial, the whole cluster (3 workers, 2 parameter servers) runs in this one process.

Every line changed from the tutorial for kerasdist (the user's diff):
  + import kerasdist                                           (added after `import tensorflow as tf`)
  - variable_partitioner = (... MinSizePartitioner(...))       (removed: kerasdist's ps does not partition
                                                                variables, docs/ps.md "Limits")
  - strategy = tf.distribute.experimental.ParameterServerStrategy(cluster_resolver, variable_partitioner=...)
  - with strategy.scope():                                     (removed; its lines dedented)
  + distribute=kerasdist.ps(cluster_resolver=cluster_resolver) (added to model.compile)
Changed because stock Keras 3 needs it (Keras 3 has no DatasetCreator; kerasdist's fit takes the function):
  ~ dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn) -> dc = dataset_fn
  ~ y = tf.random.uniform((10,)) -> tf.random.uniform((10, 1)) (Keras 3's "mse" refuses labels of shape
    (64,) against outputs of shape (64, 10): "Incompatible shapes"; checked with plain Keras 3.15)
  ~ ModelCheckpoint(filepath=ckpt_filepath) with ckpt_filepath = .../'ckpt' -> .../'ckpt.keras' (Keras 3
    needs the suffix)
Changed because portpicker is not installed here: portpicker.pick_unused_port() -> pick_unused_port(),
  a 4-line stand-in (bind port 0 on localhost) defined below.
Changed for this test: working_dir '/tmp/my_working_dir' -> os.environ.get("GUIDE_WORKDIR", '/tmp/my_working_dir').
Shrunk for CI: nothing (5 epochs of 20 steps).
"""

import multiprocessing
import os
import random
import socket

import tensorflow as tf
import kerasdist


def pick_unused_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def create_in_process_cluster(num_workers, num_ps):
    """Creates and starts local servers and returns the cluster_resolver."""
    worker_ports = [pick_unused_port() for _ in range(num_workers)]
    ps_ports = [pick_unused_port() for _ in range(num_ps)]

    cluster_dict = {}
    cluster_dict["worker"] = ["localhost:%s" % port for port in worker_ports]
    if num_ps > 0:
        cluster_dict["ps"] = ["localhost:%s" % port for port in ps_ports]

    cluster_spec = tf.train.ClusterSpec(cluster_dict)

    # Workers need some inter_ops threads to work properly.
    worker_config = tf.compat.v1.ConfigProto()
    if multiprocessing.cpu_count() < num_workers + 1:
        worker_config.inter_op_parallelism_threads = num_workers + 1

    for i in range(num_workers):
        tf.distribute.Server(
            cluster_spec,
            job_name="worker",
            task_index=i,
            config=worker_config,
            protocol="grpc")

    for i in range(num_ps):
        tf.distribute.Server(
            cluster_spec,
            job_name="ps",
            task_index=i,
            protocol="grpc")

    cluster_resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster_spec, rpc_layer="grpc")
    return cluster_resolver


# Set the environment variable to allow reporting worker and ps failure to the
# coordinator. This is a workaround and won't be necessary in the future.
os.environ["GRPC_FAIL_FAST"] = "use_caller"

NUM_WORKERS = 3
NUM_PS = 2
cluster_resolver = create_in_process_cluster(NUM_WORKERS, NUM_PS)


def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)

    x = tf.random.uniform((10, 10))
    y = tf.random.uniform((10, 1))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.shard(
        input_context.num_input_pipelines,
        input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)

    return dataset


dc = dataset_fn

model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])

model.compile(tf.keras.optimizers.SGD(), loss='mse', steps_per_execution=10,
              distribute=kerasdist.ps(cluster_resolver=cluster_resolver))

working_dir = os.environ.get("GUIDE_WORKDIR", '/tmp/my_working_dir')
log_dir = os.path.join(working_dir, 'log')
ckpt_filepath = os.path.join(working_dir, 'ckpt.keras')
backup_dir = os.path.join(working_dir, 'backup')

callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir=log_dir),
    tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
]

model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks)
