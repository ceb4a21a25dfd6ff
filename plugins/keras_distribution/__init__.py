"""distribute="data_parallel" on TensorFlow and JAX; "hybrid" / "model_parallel" (JAX): keras.distribution.

On JAX, Keras's own ``keras.distribution`` (DeviceMesh, LayoutMap, DataParallel, ModelParallel) needs
``set_distribution`` before the model is built. kerasdist moves a model built anywhere instead: at compile
each variable gets the layout the spec gives (replicated for data parallelism, sharded by the layout or
the default rule for hybrid parallelism) and its value is placed there; ``fit``/``evaluate``/``predict``
then run inside the distribution's scope, which splits each batch along the batch axis (and, for
"data_parallel", makes replicated the variables of a model not built at compile, as Keras builds it). Variables that
already have a layout (a model built under the user's own distribution) keep it. A ``keras.distribution``
``DataParallel``/``ModelParallel`` object passed as ``distribute=`` is turned into the equivalent spec
(``spec_of_distribution``) and takes the same path, its own mesh and batch axis kept.

On TensorFlow, "data_parallel" is ``tf.distribute.MirroredStrategy`` over the local devices.
"""

import copy
import dataclasses
import re
from typing import Optional, Sequence

import kerasdist
from kerasdist.plugin_tools import (all_layers, check_number, keras_backend, lay_out_variables,
                                    local_replica_devices, place_batches_by, variable_layout)

from . import processes
from .layout import (DEFAULT_MIN_SHARD_SIZE, batch_axis_of, check_layout_axes, choose_axes, format_layout,
                     layer_outputs, layout_rows, mesh_shape, output_layout_map)

__all__ = ["DataParallel", "Hybrid", "layout_table"]


@dataclasses.dataclass
class DataParallel(kerasdist.StrategySpec):
    """Every device holds every weight; each batch is split across the devices.

    :param devices: TensorFlow device names (default: the local GPUs, else logical CPUs) or JAX
        device ids such as ``"cpu:3"`` (default: every device of every process).
    :param sync_batch_norm: TensorFlow: BatchNormalization statistics over the whole global batch (one
        all-reduce per layer and step). JAX computes them over the global batch always.
    """

    devices: Optional[Sequence[str]] = None
    sync_batch_norm: bool = False

    def identity(self):
        """On TensorFlow the same strategy as ``mirrored`` over the same devices (they share it)."""
        if keras_backend() == "tensorflow":
            from kerasdist.plugin_tools import canonical_devices

            return (canonical_devices(self.devices or local_replica_devices()), "auto")
        return ("jax", tuple(self.devices or ()))

    def __post_init__(self):
        if self.devices is not None and (isinstance(self.devices, str) or not all(
                isinstance(d, str) for d in self.devices) or not self.devices):
            raise kerasdist.KerasdistError(f"data_parallel: devices={self.devices!r} is not valid; give a non-empty "
                                           "list of device names such as ['cpu:0', 'cpu:1'], or None for all.")


@dataclasses.dataclass
class Hybrid(kerasdist.StrategySpec):
    """Data and model parallelism at once (JAX): the batch split along the batch axis, weights sharded.

    :param mesh: ``{axis name: size}``, e.g. ``{"data": 2, "model": 4}``; the sizes multiply to the
        device count. None: every device on one "model" axis (pure model parallelism).
    :param layout: ``{path regex: (axis or None, ...)}`` per dimension, matched with ``re.search``: against
        variable paths (``"d1/kernel"``; unmatched variables are replicated), and, for a rule ending in
        ``/output`` (``"d2/output"``), against layer outputs, as in Keras's ``LayoutMap``.
        None: the default rule shards the last dimension of every kernel or embedding table with at
        least ``min_shard_size`` elements over the first non-batch axis, and replicates the rest.
    :param batch_axis: the mesh axis the batch is split along (Keras's ``batch_dim_name``). None: the axis
        named "batch" if there is one, else the mesh's first axis (``{"data": 2, "model": 4}``: "data"),
        and for a one-axis mesh such as ``{"model": 8}`` none (the batch is not split).
    :param show_layout: print each variable's shape, sharding and bytes per device at compile.
    """

    mesh: Optional[dict] = None
    layout: Optional[dict] = None
    batch_axis: Optional[str] = None
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE
    show_layout: bool = False

    def __post_init__(self):
        if self.batch_axis is not None and (not isinstance(self.batch_axis, str) or not self.batch_axis):
            raise kerasdist.KerasdistError(f"hybrid: batch_axis={self.batch_axis!r} is not valid; give a mesh axis "
                                           "name such as 'data', or None.")
        if self.layout is not None and (not isinstance(self.layout, dict) or not all(
                isinstance(k, str) and isinstance(v, (tuple, list)) for k, v in self.layout.items())):
            raise kerasdist.KerasdistError(f"hybrid: layout={self.layout!r} is not valid; give {{path regex: (axis or "
                                           "None, ...)}}, e.g. {'dense.*/kernel': (None, 'model')}.")
        if self.mesh is not None:
            if not isinstance(self.mesh, dict) or not self.mesh or not all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                    for k, v in self.mesh.items()):
                raise kerasdist.KerasdistError(f"hybrid: mesh={self.mesh!r} is not valid; give {{axis name: size >= 1}}, "
                                               "e.g. {'data': 2, 'model': 4}.")
            if self.batch_axis is not None and self.batch_axis not in self.mesh:
                raise kerasdist.KerasdistError(
                    f"hybrid: batch_axis={self.batch_axis!r} is not an axis of mesh={self.mesh!r}; use one of "
                    f"{list(self.mesh)}, or batch_axis=None (the axis named 'batch', else the first axis).")
            check_layout_axes(self.layout, {batch_axis_of(self.mesh, self.batch_axis): 1, **self.mesh})
        check_number(self.min_shard_size, "min_shard_size", "hybrid", minimum=0, integer=True)

    def identity(self):
        return repr((self.mesh, self.layout, self.batch_axis, self.min_shard_size))


@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("data_parallel", DataParallel, aliases=("data-parallel", "dataparallel"), backends=("tensorflow", "jax"),
             description="Replicated weights, the batch split across devices: tf.distribute.MirroredStrategy on "
                         "TensorFlow, keras.distribution.DataParallel on JAX.")
    register("hybrid", Hybrid, aliases=("model_parallel", "model-parallel", "modelparallel"), backends=("jax",),
             description="Data + model parallelism on a device mesh (keras.distribution.ModelParallel): the batch "
                         "split along one axis, large weights sharded along another.")


@kerasdist.hookimpl(tryfirst=True)
def kerasdist_auto_strategy(cluster):
    return "data_parallel" if keras_backend() == "jax" else None


@kerasdist.hookimpl
def kerasdist_process_start(cluster):
    """On JAX, a process of a TF_CONFIG/Slurm cluster (``kerasdist launch -n N``) joins one JAX cluster."""
    if keras_backend() == "jax" and processes.is_process_cluster(cluster):
        processes.join(cluster)


@kerasdist.hookimpl
def kerasdist_listeners(cluster):
    if keras_backend() != "jax" or not processes.is_process_cluster(cluster):
        return None
    tasks = list(cluster.cluster.get("chief", ())) + list(cluster.cluster.get("worker", ()))
    if cluster.task_index != 0 or (cluster.task_type == "worker" and cluster.cluster.get("chief")):
        return []
    return [{"what": "JAX's distributed coordination service (jax.distributed), process 0 only",
             "address": "*:" + tasks[0].rsplit(":", 1)[1], "interfaces": "all"}]


@kerasdist.hookimpl
def kerasdist_create_strategy(spec):
    if not isinstance(spec, (DataParallel, Hybrid)):
        return None
    if keras_backend() != "jax":
        import tensorflow as tf

        return tf.distribute.MirroredStrategy(list(spec.devices or local_replica_devices()))
    import keras

    devices = _jax_devices(spec)
    if isinstance(spec, DataParallel):
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        mesh, batch_axis = mesh_shape(spec, len(devices))
        device_mesh = keras.distribution.DeviceMesh(shape=tuple(mesh.values()), axis_names=list(mesh), devices=devices)
        distribution = keras.distribution.ModelParallel(layout_map=output_layout_map(spec.layout, device_mesh),
                                                        batch_dim_name=batch_axis)
    return _feeding_global_batches(distribution)


def _feeding_global_batches(distribution):
    """``distribution``, fed as kerasdist feeds it: every process reads the global batch and each device is
    given its rows (an uneven last batch whole, on every device)."""
    distribution.auto_shard_dataset = False
    place_batches_by(distribution, processes.place_global_batch)
    return distribution


#: ``id(a user's distribution) -> (it, its copy fed global batches)``: the user's object is left as it is.
_USERS_DISTRIBUTIONS = {}


def _run_scope(distribution, spec):
    """The distribution ``fit``/``evaluate``/``predict`` run under: kerasdist's own, or for a user's object
    passed as ``distribute=`` a copy of it (same mesh, layouts and batch axis) fed as kerasdist's are, so that
    it trains as the spec it stands for, uneven last batches and several processes included."""
    if isinstance(spec, (DataParallel, Hybrid)):
        return distribution
    entry = _USERS_DISTRIBUTIONS.get(id(distribution))
    if entry is None or entry[0] is not distribution:
        entry = _USERS_DISTRIBUTIONS[id(distribution)] = (distribution,
                                                          _feeding_global_batches(copy.copy(distribution)))
    return entry[1]


def _jax_devices(spec):
    import keras

    available = keras.distribution.list_devices()
    wanted = getattr(spec, "devices", None)
    if wanted is None:
        return available
    missing = [d for d in wanted if d not in available]
    if missing:
        raise kerasdist.KerasdistError(f"data_parallel: device(s) {missing} do not exist here; available: {available}. "
                                       "Set XLA_FLAGS=--xla_force_host_platform_device_count=N for N CPU devices.")
    return list(wanted)


@kerasdist.hookimpl
def kerasdist_prepare_model(model, strategy, spec):
    spec = own_spec(spec, strategy, model)
    if spec is None:
        return
    if not model.built:
        if isinstance(spec, Hybrid):
            raise kerasdist.KerasdistError(
                f"{spec.name}: the model is not built, so its variables cannot be sharded (the layout needs their "
                "shapes); give it an Input (keras.Input(shape)) or call model.build(input_shape) before compile.")
        return  # replicated whatever the shapes: built later inside the distribution's scope (kerasdist_run_call)
    import keras

    variables = list(model.variables)
    if isinstance(spec, Hybrid):
        mesh = dict(zip(strategy.device_mesh.axis_names, strategy.device_mesh.shape))
        check_layout_axes(spec.layout, mesh)
        axes = choose_axes([v for v in variables if variable_layout(v) is None], spec, mesh, strategy.batch_dim_name,
                           layer_outputs(model, all_layers(model)))
    else:
        axes = {}

    def layout_of(variable):
        spec_axes = axes.get(variable.path, (None,) * len(variable.shape))
        return keras.distribution.TensorLayout(list(spec_axes), strategy.device_mesh)

    lay_out_variables(variables, layout_of)
    if isinstance(spec, Hybrid) and spec.show_layout:
        print(layout_table(model), flush=True)


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    if isinstance(spec, DataParallel) and keras_backend() == "tensorflow":  # a MirroredStrategy: as "mirrored"
        from kerasdist.plugin_tools import mirrored_replicas_as_one_device

        mirrored_replicas_as_one_device(compile_kwargs, model, strategy, "data_parallel", spec.sync_batch_norm)
    elif own_spec(spec, strategy, model) is not None:  # metric objects made before compile hold their variables
        import keras

        metrics = [m for key in ("metrics", "weighted_metrics")
                   for m in keras.tree.flatten(compile_kwargs.get(key)) if isinstance(m, keras.metrics.Metric)]
        _replicate([v for m in metrics for v in m.variables], strategy)


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, strategy, spec):
    if isinstance(spec, DataParallel) and keras_backend() == "tensorflow":  # a MirroredStrategy, as "mirrored"
        from kerasdist.plugin_tools import read_py_datasets_in_one_processs_order

        read_py_datasets_in_one_processs_order(method, call_kwargs, "data_parallel")
    spec = own_spec(spec, strategy, model)
    if spec is None:
        return
    batch_axis = strategy.batch_dim_name
    size = dict(zip(strategy.device_mesh.axis_names, strategy.device_mesh.shape))[batch_axis]
    batch = call_kwargs.get("batch_size")
    if batch is not None and batch % size != 0:
        raise kerasdist.KerasdistError(
            f"{spec.name}: batch_size={batch} cannot be split along the batch axis {batch_axis!r} of size {size}; "
            f"give a multiple of {size} (batch_size is the global batch).")
    if processes.process_count()[0] > 1:
        if method == "predict":
            raise kerasdist.KerasdistError(
                f"{spec.name}: predict over several JAX processes is not supported; predict in one process "
                "(e.g. load the saved model there), or under kerasdist.is_chief() after training.")
        if method in ("fit", "evaluate"):
            processes.check_agreement(method, model, call_kwargs, spec.name)  # first: before any collective
        processes.share_random_state()  # a NumPy shuffle draws process 0's permutation in every process
        processes.quiet_other_processes(method, call_kwargs)


@kerasdist.hookimpl
def kerasdist_run_call(method, call, call_kwargs, model, strategy, spec):
    if own_spec(spec, strategy, model) is None:
        return None
    _replicate(list(model.variables) + _optimizer_variables(model) + list(model.metrics_variables), strategy)
    with _run_scope(strategy, spec).scope(), processes.chief_writes(method, call_kwargs):
        return call(**call_kwargs)


def _replicate(variables, strategy):
    """Replicate on the mesh each of ``variables`` not laid out yet (made outside the distribution: optimizer
    slots built later, metrics and trackers made in ``__init__`` or passed to compile)."""
    import keras

    lay_out_variables(variables, lambda v: keras.distribution.TensorLayout([None] * len(v.shape), strategy.device_mesh))


def own_spec(spec, strategy, model):
    """On JAX, the DataParallel/Hybrid spec this plugin runs ``spec`` as: itself, or for a
    ``keras.distribution`` object passed as ``distribute=`` (the hooks' ``strategy``), its equivalent;
    None for a spec that is not this plugin's."""
    if keras_backend() != "jax":
        return None
    if isinstance(spec, (DataParallel, Hybrid)):
        return spec
    if getattr(spec, "strategy", None) is strategy and strategy is not None:  # passed as is
        return spec_of_distribution(strategy, model)
    return None


def spec_of_distribution(distribution, model):
    """The spec that lays ``model`` out as ``distribution`` (``keras.distribution.DataParallel`` or
    ``ModelParallel``) would have, had the model been built under it; None for any other object.

    A ModelParallel becomes ``Hybrid`` on its mesh and ``batch_dim_name``, with one exact rule per variable
    not laid out yet and per layer output, each as the distribution itself answers for that path
    (``get_variable_layout``, ``get_tensor_layout``: its LayoutMap, matched the way Keras matches it)."""
    import keras

    if isinstance(distribution, keras.distribution.ModelParallel):
        device_mesh = distribution.device_mesh
        layout = {_exactly(v.path): tuple(distribution.get_variable_layout(v).axes)
                  for v in model.variables if variable_layout(v) is None}
        for path in layer_outputs(model, all_layers(model)):
            output_layout = distribution.get_tensor_layout(path)
            if output_layout is not None:
                layout[_exactly(path)] = tuple(output_layout.axes)
        spec = Hybrid(mesh={axis: int(size) for axis, size in zip(device_mesh.axis_names, device_mesh.shape)},
                      layout=layout, batch_axis=distribution.batch_dim_name)
    elif isinstance(distribution, keras.distribution.DataParallel):
        spec = DataParallel()
    else:
        return None
    spec._kerasdist_name = f"keras.distribution.{type(distribution).__name__}"
    return spec


def _exactly(path):
    return f"^{re.escape(path)}$"


def layout_table(model):
    """A table of each variable of ``model``: shape, sharding spec and bytes held per device."""
    variables = list(model.variables) + _optimizer_variables(model)
    return format_layout(layout_rows(variables, None))


def _optimizer_variables(model):
    optimizer = getattr(model, "optimizer", None)
    return list(optimizer.variables) if optimizer is not None else []
