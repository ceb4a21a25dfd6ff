"""Private Keras/TF internals for the parameter-server strategy (part of kerasdist._keras_internals)."""

# -- parameter-server strategy (kerasdist_plugins.ps) --------------------------------------------

#: The job name a ParameterServerStrategy coordinator takes in the cluster when built by
#: :func:`parameter_server_strategy`: the local job's own name, so local state survives connecting.
PS_COORDINATOR_JOB = "localhost"


def parameter_server_strategy(cluster_resolver):
    """A ``tf.distribute.experimental.ParameterServerStrategy`` whose coordinator keeps this process's state.

    The stock strategy joins the cluster as job "chief" (``ParameterServerStrategyV2._connect_to_cluster``,
    private, name hard-coded). Renaming the local job invalidates every tensor and variable created
    before: reading a model built before ``compile(distribute="ps")`` then fails with "Client for target
    /job:localhost/replica:0/task:0 not found". Joining as "localhost" (what the local job is already
    called) keeps them. ``cluster_resolver``'s cluster must not list a "chief" job.
    """
    from tensorflow.python.distribute import parameter_server_strategy_v2

    class _KeepLocalStateParameterServerStrategy(parameter_server_strategy_v2.ParameterServerStrategyV2):
        def _connect_to_cluster(self, coordinator_name):
            return super()._connect_to_cluster(coordinator_name=PS_COORDINATOR_JOB)

    return _KeepLocalStateParameterServerStrategy(cluster_resolver)


def symbolic_build(model, data_batch):
    """Create every variable ``fit`` needs (layers, compiled loss and metrics, optimizer slots) now, in
    the current scope, from a batch's structure (tensors or ``tf.TensorSpec``): what Keras's own ``fit``
    does first (``Trainer._symbolic_build``). Under a ParameterServerStrategy this places them on the
    parameter servers; built lazily inside a step running on a worker, optimizer slots would land on the
    coordinator instead."""
    model._symbolic_build(data_batch=data_batch)
