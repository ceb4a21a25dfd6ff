"""Which device holds which part of each variable: the mesh, the user's layout or the default rule, checks."""

import math
import re
import warnings

from kerasdist import KerasdistError

#: The default rule shards only variables with at least this many elements (smaller ones are replicated).
DEFAULT_MIN_SHARD_SIZE = 1024
#: Variable names the default rule shards, along their last dimension (output channels / features).
SHARDED_NAMES = ("kernel", "embeddings", "depthwise_kernel", "pointwise_kernel")


#: A layout rule whose pattern ends so (``"d2/output"``) lays out a layer's output, as in Keras's LayoutMap.
OUTPUT_RULE = re.compile(r"/output\$?$")


def batch_axis_of(mesh, batch_axis=None):
    """The mesh axis the batch is split along: ``batch_axis`` when given, else the axis named "batch", else
    the first axis of a mesh of two or more (as Keras's ``ModelParallel(batch_dim_name=None)``); a mesh of
    one other axis (``{"model": 8}``) is pure model parallelism: the batch goes on an added "batch" axis of 1."""
    if batch_axis is not None:
        return batch_axis
    if not mesh or "batch" in mesh or len(mesh) == 1:
        return "batch"
    return next(iter(mesh))


def mesh_shape(spec, device_count):
    """``({axis: size}, batch axis)``: the user's axes, the batch axis first (outermost, so that with several
    processes each batch slice is held by whole processes); ``mesh=None`` puts every device on "model"."""
    batch_axis = batch_axis_of(spec.mesh, spec.batch_axis)
    mesh = dict(spec.mesh) if spec.mesh else {"model": device_count}
    mesh.setdefault(batch_axis, 1)
    size = math.prod(mesh.values())
    if size != device_count:
        raise KerasdistError(
            f"hybrid: mesh={dict(spec.mesh or mesh)} has {size} devices but there are {device_count} "
            f"({', '.join(f'{k}={v}' for k, v in mesh.items())}); give axis sizes whose product is {device_count}, "
            f"e.g. {{'{batch_axis}': {_split(device_count)[0]}, 'model': {_split(device_count)[1]}}}.")
    return {batch_axis: mesh.pop(batch_axis), **mesh}, batch_axis


def _split(count):
    batch = 2 if count % 2 == 0 and count > 2 else 1
    return batch, count // batch


def check_layout_axes(layout, mesh):
    """Every axis a layout rule names must be a mesh axis."""
    for pattern, axes in (layout or {}).items():
        for axis in axes:
            if axis is not None and axis not in mesh:
                raise KerasdistError(f"hybrid: layout rule {pattern!r}: {tuple(axes)} names the axis {axis!r}, which "
                                     f"the mesh {mesh} lacks; use one of {list(mesh)} or None (replicated).")


def is_output_rule(pattern):
    return bool(OUTPUT_RULE.search(pattern))


def layer_outputs(model, layers):
    """``{<layer path>/output: output shape or None}`` of the model and each built layer: the paths Keras
    lays outputs out by; the shape when the layer has one symbolic output (functional models)."""
    found = {}
    for layer in [model, *layers]:
        if getattr(layer, "path", None):
            try:
                shape = tuple(layer.output.shape)
            except (AttributeError, ValueError, TypeError):  # subclassed, shared, or several outputs
                shape = None
            found[f"{layer.path}/output"] = shape
    return found


def choose_axes(variables, spec, mesh, batch_axis, outputs=None):
    """``{path: (axis or None, ...)}`` for every variable: the first matching variable rule (``re.search``
    on the variable's path), else the default rule when no layout is given. Checks the output rules against
    ``outputs`` (``layer_outputs``); warns about each rule that matches nothing."""
    model_axes = [axis for axis in mesh if axis != batch_axis]
    rules = {p: axes for p, axes in (spec.layout or {}).items() if not is_output_rule(p)}
    chosen, used = {}, _check_output_rules(spec.layout, mesh, outputs or {}, spec.name)
    for variable in variables:
        path, shape = variable.path, tuple(variable.shape)
        if spec.layout:
            rule = next((p for p in rules if re.search(p, path)), None)
            axes = tuple(rules[rule]) if rule is not None else (None,) * len(shape)
            if rule is not None:
                used.add(rule)
        else:
            axes = default_axes(path, shape, model_axes[0] if model_axes else None, mesh, spec.min_shard_size)
        _check_fits(rule if spec.layout else None, axes, path, shape, mesh, spec.name)
        chosen[path] = axes
    _warn_unused([rule for rule in (spec.layout or {}) if rule not in used], variables, outputs or {})
    return chosen


def _check_output_rules(layout, mesh, outputs, name):
    """The output rules that match a layer output; each checked against that output's shape when known."""
    used = set()
    for path, shape in outputs.items():
        rule = next((p for p in layout or {} if is_output_rule(p) and re.search(p, path)), None)
        if rule is not None:
            used.add(rule)
            if shape is not None:
                _check_fits(rule, tuple(layout[rule]), path, shape, mesh, name)
    return used


def _check_fits(rule, axes, path, shape, mesh, name):
    if rule is not None and len(axes) != len(shape):
        raise KerasdistError(f"{name}: layout rule {rule!r} gives {axes} ({len(axes)} dimensions) for "
                             f"{path} of shape {shape} ({len(shape)} dimensions).")
    for dim, axis in zip(shape, axes):
        if axis is not None and dim is not None and dim % mesh[axis] != 0:
            raise KerasdistError(f"{name}: cannot shard {path} of shape {shape} along axis {axis!r}: its "
                                 f"dimension {dim} is not divisible by the axis size {mesh[axis]}; change the "
                                 "layout rule or the mesh.")


def _warn_unused(unused, variables, outputs):
    if not unused:
        return
    paths = ", ".join(v.path for v in variables)
    warnings.warn(f"hybrid: layout rule(s) {unused} match no variable and no layer output (matched with re.search "
                  f"against the paths; a rule ending in '/output' lays out a layer's output); the variables are: "
                  f"{paths}; the layer outputs are: {', '.join(outputs) or '(none)'}", stacklevel=4)


def output_layout_map(layout, device_mesh):
    """A ``keras.distribution.LayoutMap`` for ``ModelParallel``: Keras asks it, in ``Layer.__call__``, for the
    layout of each layer output (``<layer path>/output``); it answers with the first output rule that
    matches (``re.search``), else None. Variables are laid out at compile, so it answers None for them."""
    import keras

    class OutputRules(keras.distribution.LayoutMap):
        def __init__(self):
            super().__init__(device_mesh)
            self.rules = [(p, keras.distribution.TensorLayout(list(axes), device_mesh))
                          for p, axes in (layout or {}).items() if is_output_rule(p)]

        def __getitem__(self, path):
            if not path.endswith("/output"):
                return None
            return next((tensor_layout for p, tensor_layout in self.rules if re.search(p, path)), None)

    return OutputRules()


def default_axes(path, shape, axis, mesh, min_size):
    """Shard the last dimension of a large kernel/embedding over ``axis`` when it divides; else replicate."""
    replicated = (None,) * len(shape)
    name = path.rsplit("/", 1)[-1]
    if axis is None or name not in SHARDED_NAMES or math.prod(shape) < min_size or not shape:
        return replicated
    if shape[-1] % mesh[axis] != 0:
        return replicated
    return replicated[:-1] + (axis,)


def layout_rows(variables, mesh):
    """``[(path, shape, spec, bytes per device)]`` of the variables as they are laid out now."""
    rows = []
    for variable in variables:
        value = variable.value
        shards = getattr(value, "addressable_shards", None)
        per_device = shards[0].data.nbytes if shards else value.nbytes
        spec = getattr(getattr(value, "sharding", None), "spec", None)
        rows.append((variable.path, tuple(variable.shape), tuple(spec) if spec is not None else None, per_device))
    return rows


def format_layout(rows):
    width = max([len(r[0]) for r in rows] + [8])
    lines = [f"{'variable':<{width}}  {'shape':<16}  {'spec':<20}  bytes/device"]
    for path, shape, spec, size in rows:
        lines.append(f"{path:<{width}}  {str(shape):<16}  {str(spec or 'replicated'):<20}  {size}")
    lines.append(f"{'total':<{width}}  {'':<16}  {'':<20}  {sum(r[3] for r in rows)}")
    return "\n".join(lines)
