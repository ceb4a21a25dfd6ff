"""Which device holds which part of each variable: the mesh, the user's layout or the default rule, checks."""

import math
import re
import warnings

from kerasdist import KerasdistError

#: The default rule shards only variables with at least this many elements (smaller ones are replicated).
DEFAULT_MIN_SHARD_SIZE = 1024
#: Variable names the default rule shards, along their last dimension (output channels / features).
SHARDED_NAMES = ("kernel", "embeddings", "depthwise_kernel", "pointwise_kernel")


def mesh_shape(spec, device_count):
    """``{axis: size}`` with the batch axis first; ``mesh=None`` puts every device on "model"."""
    mesh = dict(spec.mesh) if spec.mesh else {spec.batch_axis: 1, "model": device_count}
    mesh.setdefault(spec.batch_axis, 1)
    size = math.prod(mesh.values())
    if size != device_count:
        raise KerasdistError(
            f"hybrid: mesh={dict(spec.mesh or mesh)} has {size} devices but there are {device_count} "
            f"({', '.join(f'{k}={v}' for k, v in mesh.items())}); give axis sizes whose product is {device_count}, "
            f"e.g. {{'{spec.batch_axis}': {_split(device_count)[0]}, 'model': {_split(device_count)[1]}}}.")
    return {spec.batch_axis: mesh.pop(spec.batch_axis), **mesh}


def _split(count):
    batch = 2 if count % 2 == 0 and count > 2 else 1
    return batch, count // batch


def check_layout_axes(layout, mesh, batch_axis):
    """Every axis a layout rule names must be a mesh axis other than the batch axis."""
    for pattern, axes in (layout or {}).items():
        for axis in axes:
            if axis is not None and axis not in mesh:
                raise KerasdistError(f"hybrid: layout rule {pattern!r}: {tuple(axes)} names the axis {axis!r}, which "
                                     f"the mesh {mesh} lacks; use one of {list(mesh)} or None (replicated).")


def choose_axes(variables, spec, mesh):
    """``{path: (axis or None, ...)}`` for every variable: the first matching layout rule
    (``re.search`` on the variable's path), else the default rule when no layout is given."""
    model_axes = [axis for axis in mesh if axis != spec.batch_axis]
    chosen, used = {}, set()
    for variable in variables:
        path, shape = variable.path, tuple(variable.shape)
        if spec.layout:
            rule = next((p for p in spec.layout if re.search(p, path)), None)
            axes = tuple(spec.layout[rule]) if rule is not None else (None,) * len(shape)
            if rule is not None:
                used.add(rule)
                if len(axes) != len(shape):
                    raise KerasdistError(f"hybrid: layout rule {rule!r} gives {axes} ({len(axes)} dimensions) for "
                                         f"{path} of shape {shape} ({len(shape)} dimensions).")
        else:
            axes = default_axes(path, shape, model_axes[0] if model_axes else None, mesh, spec.min_shard_size)
        for dim, axis in zip(shape, axes):
            if axis is not None and dim % mesh[axis] != 0:
                raise KerasdistError(f"hybrid: cannot shard {path} of shape {shape} along axis {axis!r}: its "
                                     f"dimension {dim} is not divisible by the axis size {mesh[axis]}; change the "
                                     "layout rule or the mesh.")
        chosen[path] = axes
    unused = [rule for rule in (spec.layout or {}) if rule not in used]
    if unused:
        paths = ", ".join(v.path for v in variables)
        warnings.warn(f"hybrid: layout rule(s) {unused} match no variable (matched with re.search against the "
                      f"paths); the variables are: {paths}", stacklevel=3)
    return chosen


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
