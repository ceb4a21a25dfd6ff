"""TensorFlow's coordination service for multi-worker training (part of kerasdist._keras_internals)."""

def tf_context_initialized():
    """True once TensorFlow ran an op: collective ops can no longer be configured."""
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def configure_coordination(cluster_spec, register_timeout_s):
    """Set up TF's coordination service as MultiWorkerMirroredStrategy would, but with a
    registration timeout (the strategy's own set-up waits forever for absent workers)."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    if context.context().coordination_service is not None:
        return
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        cluster_register_timeout_in_ms=int(register_timeout_s * 1000),
        coordinated_jobs=jobs)
