"""A custom ``train_step`` (keras.io "Customizing what happens in fit() with PyTorch") and every ``test_step``
on several ranks: the metrics and the step's own logs of the global batch, the same in every rank.

After the step, ONE all-reduce carries each metric state's change in this step and the step's logs that no
metric backs. A metric updated with one scalar per step (``tracker.update_state(loss)``: a mean of batch
losses) adds its ranks' changes weighted by their rows (``sum_r n_r / N * change_r``: the global batch's
loss, counted once); every other update (per row: ``update_state(y, y_pred)``, Keras's own loss tracker
weighted by the batch size) adds the changes. Every rank then holds the summed states, and the returned logs
are recomputed: a value that is a metric's result on every rank (``{m.name: m.result() for m in self.metrics}``,
or ``get_metrics_result()``'s) is that metric's new result; any other scalar float value is averaged over the ranks
weighted by their rows (the global batch's value of a mean over rows); a non-scalar float log (per-row values)
is refused with a KerasdistError. The message's layout depends only on the logs' names and shapes, the same on
every rank.

A rank whose share of the batch is empty runs the same step on the placeholder row (as ``(x, y)``: the same
collectives in every rank) with weight 0; its model state (BatchNormalization's moving statistics) is put back,
except a synchronized BatchNormalization's, which moved with the other ranks' statistics (its row weighs 0).
"""

import keras

from kerasdist.plugin_tools import (start_first_step_check, unique_variables, unsummed_after_first_step,
                                    unsummed_updates_error)

from .training import is_placeholder, largest, local_rows


def summed_step(model, state, step, data, training):
    """Run ``step(data)`` (the model's own ``train_step`` or ``test_step``) and reduce what it changed."""
    import torch

    placeholder = is_placeholder(data)
    state.placeholder, state.rows = placeholder, 0 if placeholder else _rows(data)
    if training and state.unit is None:
        state.unit = largest(state.rows)
    state.metrics_global = True  # get_metrics_result in the step: this rank's values (reduced below)
    state.loss_scaled = False
    metrics = unique_variables(model.metrics)  # each metric once
    for metric in metrics:
        _watch(metric, state)
    variables = unique_variables(v for m in metrics for v in m.variables)
    before = [v.value.detach().clone() for v in variables]
    kept = _model_state(model, state) if placeholder else []
    state.batch_level = set()
    checked = training and start_first_step_check(model)
    logs = step(_without_mark(data) if placeholder else data)
    unsummed = unsummed_after_first_step(model) if checked else None
    with torch.no_grad():
        for variable, value in kept:
            variable.value.copy_(value)
    return _reduced(model, state, metrics, variables, before, logs, unsummed)


def _reduced(model, state, metrics, variables, before, logs, unsummed=None):
    """ONE all-reduce whose layout is the same on every rank: each metric variable's change, then for each log
    named like a metric a flag "this rank's value is that metric's result" (a log is backed only when every rank
    says so), then each scalar float log's leaves times the rows, at the first train step a flag "a trainable
    variable changed without a wrapped apply" (``unsummed``: their names), then the rows."""
    import torch
    import torch.distributed as dist

    rows = float(state.rows)
    batch_level = {id(v) for m in metrics if id(m) in state.batch_level for v in m.variables}
    local_results = _results(model, metrics)
    logs_dict = logs if isinstance(logs, dict) else {}
    named = [k for k in logs_dict if k in local_results]
    scalars = [k for k, v in logs_dict.items() if _scalar_floats(v)]
    scalar_leaves = [keras.tree.flatten(logs_dict[k]) for k in scalars]
    device = next((b.device for b in before), "cpu")
    parts = []
    for variable, value in zip(variables, before):
        change = (variable.value.detach() - value).reshape(-1).double()
        parts.append(_times(change, rows if id(variable) in batch_level else float(rows > 0)))
    parts.append(torch.tensor([float(_same(logs_dict[k], local_results[k])) for k in named],
                              dtype=torch.float64, device=device))
    parts += [_times(torch.as_tensor(leaf, device=device).detach().reshape(-1).double(), rows)
              for leaves in scalar_leaves for leaf in leaves]
    if unsummed is not None:
        parts.append(torch.tensor([float(bool(unsummed))], dtype=torch.float64, device=device))
    parts.append(torch.tensor([rows], dtype=torch.float64, device=device))
    flat = torch.cat(parts)
    dist.all_reduce(flat)
    if unsummed is not None and float(flat[-2]) > 0:  # every rank raises
        raise unsummed_updates_error(unsummed, "data_parallel")
    total_rows = float(flat[-1]) or 1.0
    at = 0
    with torch.no_grad():
        for variable, value in zip(variables, before):
            size = value.numel()
            change = flat[at:at + size].reshape(value.shape)
            if id(variable) in batch_level:
                change = change / total_rows
            variable.value.copy_((value.double() + change).to(value.dtype))
            at += size
    if not isinstance(logs, dict):
        return logs
    ranks = dist.get_world_size()
    backed = {k for k, flag in zip(named, flat[at:at + len(named)].tolist()) if flag == ranks}
    at += len(named)
    _refuse_per_row_logs(logs, backed, scalars)
    results = _results(model, metrics)
    reduced = dict(logs)
    for key in backed:
        reduced[key] = results[key]
    for key, leaves in zip(scalars, scalar_leaves):
        averaged = flat[at:at + len(leaves)] / total_rows
        at += len(leaves)
        if key not in backed:
            reduced[key] = keras.tree.pack_sequence_as(logs[key], [a.reshape(()).float() for a in averaged])
    return reduced


def _refuse_per_row_logs(logs, backed, scalars):
    """A float log that is neither a metric's result on every rank nor scalar (a per-row tensor: each rank holds
    other rows, as many as its share) cannot be made the global batch's: one clear error, the same on every rank."""
    from kerasdist import KerasdistError

    bad = [k for k, v in logs.items() if k not in backed and k not in scalars and _any_float_tensor(v)]
    if bad:
        raise KerasdistError(
            f"distribute='data_parallel' (torch): the custom step returned the non-scalar float log(s) {bad}; "
            "each rank holds only its share of the batch's rows, so they cannot be the global batch's. Return "
            "scalars (a mean: keras.ops.mean(...)) or a metric's result (update a keras.metrics.Metric with them).")


def _times(values, factor):
    """``values * factor``; a factor 0 (an empty share) gives exact zeros, never inf * 0 = NaN."""
    import torch

    return values * factor if factor else torch.zeros_like(values)


def _results(model, metrics):
    """Each log name a metric's value can have: the model's ``get_metrics_result()`` names and each metric's
    own name (``{m.name: m.result()}``: a compiled metrics' container gives a dict)."""
    results = {m.name: m.result() for m in metrics}
    results.update(model.get_metrics_result())
    return results


def _same(value, result):
    import torch

    values, results = keras.tree.flatten(value), keras.tree.flatten(result)
    return len(values) == len(results) and all(
        torch.equal(torch.as_tensor(a).detach().cpu(), torch.as_tensor(b).detach().cpu())
        for a, b in zip(values, results))


def _scalar_floats(value):
    """Whether every leaf of ``value`` is a Python float or a float tensor of shape ()."""
    import torch

    leaves = keras.tree.flatten(value)
    return bool(leaves) and all(isinstance(leaf, float) or (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
                                                            and leaf.dim() == 0) for leaf in leaves)


def _any_float_tensor(value):
    import torch

    return any(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in keras.tree.flatten(value))


def _watch(metric, state):
    """Mark ``metric`` in ``state.batch_level`` when it is updated with one scalar and no sample weight."""
    if "_kerasdist_watched" in metric.__dict__:
        return
    update = metric.update_state

    def update_state(*args, **kwargs):
        values = args[0] if args else kwargs.get("values")
        if len(args) <= 1 and kwargs.get("sample_weight") is None and set(kwargs) <= {"values", "sample_weight"} \
                and len(getattr(values, "shape", ())) == 0:
            state.batch_level.add(id(metric))
        return update(*args, **kwargs)

    object.__setattr__(metric, "_kerasdist_watched", True)
    object.__setattr__(metric, "update_state", update_state)


def _rows(data):
    try:
        return local_rows(data)
    except ValueError:  # a custom step's own structure (more than x, y, sample_weight)
        first = next((t for t in keras.tree.flatten(data) if t is not None), None)
        return int(first.shape[0]) if first is not None and len(first.shape) else 1


def _without_mark(data):
    """The placeholder batch as a custom step expects it: ``(x, y)`` or ``x`` (its marking weight dropped)."""
    x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    return x if y is None else (x, y)


def _model_state(model, state):
    """The model's float non-trainable variables and their values (what an empty share must not change), but
    the moving statistics of synchronized BatchNormalization (every rank's update is the global batch's)."""
    return [(v, v.value.detach().clone()) for v in model.non_trainable_variables
            if keras.backend.is_float_dtype(v.dtype) and id(v) not in state.global_statistics]
