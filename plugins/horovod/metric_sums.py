"""Logs over every rank: each metric's state summed over the ranks before its result is read.

A rank's share of a batch may be smaller than another's (a last global batch whose rows do not divide by the
ranks; ranks given different row counts), so averaging the ranks' results would weigh each rank alike and log
something else than one process on the same data. Keras's metrics keep additive states (a ``Mean``'s total and
count, confusion counts): their sums over the ranks are the states of one process that saw every row, and their
results are that process's logs. A log no metric backs (a custom step's own scalar) is averaged, as before.
"""

import numbers

from kerasdist.plugin_tools import unique_variables


def combine_over_ranks(hvd, model, logs, prefix="", earlier=None, keep_states=False):
    """Make ``logs`` (a dict, changed in place) the same on every rank, in ONE all-reduce: ``model``'s metric
    states are summed over the ranks (in place; ``keep_states``: only read, as per batch, where the states go on),
    and a log ``prefix + name`` whose value here is this rank's result of metric ``name`` becomes the result of the
    summed state (where every rank says so); ``earlier``: ``{name: (this rank's result, the ranks' result)}`` of
    states summed before (fit's training metrics, summed before validation resets them), for the logs without
    ``prefix``. A log naming no metric (a custom step's ``"loss"`` from a tracker named ``total_loss``) is the
    first metric's whose result it equals on every rank. Any other float scalar: its mean over the ranks. Returns
    ``{name: (this rank's result, the ranks' result)}`` of ``model``'s metrics."""
    import numpy as np
    import tensorflow as tf

    variables = unique_variables(v for m in model.metrics for v in m.variables)
    local = _results(model)
    earlier = earlier or {}
    keys = sorted(logs)
    values = {k: _number(logs[k]) for k in keys}
    sources = {k: _sources(k, prefix, local, earlier) for k in keys}
    flags = [float(_backed(values[k], local[name] if now else earlier[name][0])) for k in keys
             for now, name in sources[k]]
    scalars = [float(values[k]) if _is_scalar(values[k]) else 0.0 for k in keys]
    states = [np.ravel(np.asarray(v.numpy(), np.float64)) for v in variables]
    message = np.concatenate(states + [np.array(flags + scalars, np.float64)])
    if not message.size:  # no metric, no log: the same on every rank (the same model)
        return {}
    summed = hvd.allreduce(tf.constant(message), op=hvd.Sum, name="kerasdist_metric_sums").numpy()
    start, totals = 0, {}
    for variable, state in zip(variables, states):
        totals[id(variable)] = summed[start:start + state.size].reshape(tuple(variable.shape)).astype(
            np.dtype(str(variable.dtype)))
        start += state.size
    if keep_states:
        ranks = {name: (local[name], value) for name, value in _summed_results(model, totals).items()}
    else:
        for variable in variables:
            variable.assign(totals[id(variable)])
        ranks = {name: (local[name], value) for name, value in _results(model).items()}
    size, means = hvd.size(), summed[start + len(flags):]
    for i, key in enumerate(keys):
        votes = summed[start:start + len(sources[key])]
        start += len(sources[key])
        backing = [source for source, vote in zip(sources[key], votes) if vote == size]
        if backing:  # every rank logged its result of that metric: the summed state's
            now, name = backing[0]
            logs[key] = _as_log((ranks if now else earlier)[name][1])
        elif _is_scalar(values[key]):
            logs[key] = float(means[i] / size)
    return ranks


def _sources(key, prefix, local, earlier):
    """The metrics whose result the log ``key`` may be, as ``(now, name)`` (``now``: the metrics' current state,
    else ``earlier``), the one ``key`` names first; the same on every rank."""
    now = key.startswith(prefix)
    base, names = (key[len(prefix):], sorted(local)) if now else (key, sorted(earlier))
    return [(now, name) for name in ([base] if base in names else []) + [n for n in names if n != base]]


def _summed_results(model, totals):
    """``model.get_metrics_result()``'s names and values from the summed states ``totals`` (by variable id),
    computed without writing them to the variables."""
    import numpy as np

    found = {}
    for metric in model.metrics:
        result = metric.stateless_result([totals.get(id(v), v.value) for v in metric.variables])
        entries = result if isinstance(result, dict) else {metric.name: result}
        found.update({name: np.asarray(value) for name, value in entries.items()})
    return found


def _number(value):
    """A log as Keras's callbacks may hand it (a tensor before Keras made it a Python number)."""
    return value.numpy() if hasattr(value, "numpy") else value


def _results(model):
    """``model.get_metrics_result()`` as NumPy values (a scalar is a 0-d array)."""
    import numpy as np

    return {name: np.asarray(value) for name, value in model.get_metrics_result().items()}


def _backed(value, result):
    """Whether the log ``value`` is this rank's ``result`` of a metric (Keras logs metrics' results)."""
    import numpy as np

    if result is None:
        return False
    try:
        value = np.asarray(value, np.float64)
    except (TypeError, ValueError):
        return False
    return value.shape == result.shape and bool(np.array_equal(value, result.astype(np.float64)))


def _is_scalar(value):
    import numpy as np

    return isinstance(value, (numbers.Number, np.number, np.ndarray)) and not isinstance(value, bool) \
        and np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.number)


def _as_log(value):
    return float(value) if value.ndim == 0 else value
