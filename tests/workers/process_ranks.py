"""This process's rank and the number of processes, as the test workers launched by `kerasdist launch` see them:
JAX's process index and count, TensorFlow's TF_CONFIG task, or torch's RANK / WORLD_SIZE."""

import os

import keras


def process_count():
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_count()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank():
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_index()
    if keras.backend.backend() == "tensorflow":
        import kerasdist

        cluster = kerasdist.detect_cluster()
        return 0 if cluster.is_local else cluster.task_index
    return int(os.environ.get("RANK", "0"))
