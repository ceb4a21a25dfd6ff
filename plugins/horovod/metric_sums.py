"""Logs over every rank: each metric's state summed over the ranks before its result is read.

A rank's share of a batch may be smaller than another's (a last global batch whose rows do not divide by the
ranks; ranks given different row counts), so averaging the ranks' results would weigh each rank alike and log
something else than one process on the same data. Keras's metrics keep additive states (a ``Mean``'s total and
count, confusion counts): their sums over the ranks are the states of one process that saw every row, and their
results are that process's logs. A log no metric backs (a custom step's own scalar) is averaged, as before.
"""

import numbers

from kerasdist.plugin_tools import unique_variables


def combine_over_ranks(hvd, model, logs, prefix="", earlier=None):
    """Make ``logs`` (a dict, changed in place) the same on every rank, in ONE all-reduce: ``model``'s metric
    states are summed over the ranks (in place), and a log ``prefix + name`` whose value here is this rank's
    result of metric ``name`` becomes the result of the summed state (where every rank says so); ``earlier``:
    ``{name: (this rank's result, the ranks' result)}`` of states summed before (fit's training metrics, summed
    before validation resets them), for the logs without ``prefix``. Any other float scalar: its mean over the
    ranks. Returns ``{name: (this rank's result, the ranks' result)}`` of ``model``'s metrics."""
    import numpy as np
    import tensorflow as tf

    variables = unique_variables(v for m in model.metrics for v in m.variables)
    local = _results(model)
    earlier = earlier or {}
    keys = sorted(logs)
    flags = [float(_backed(logs[k], _this_ranks_result(k, prefix, local, earlier))) for k in keys]
    scalars = [float(logs[k]) if _is_scalar(logs[k]) else 0.0 for k in keys]
    states = [np.ravel(np.asarray(v.numpy(), np.float64)) for v in variables]
    message = np.concatenate(states + [np.array(flags + scalars, np.float64)])
    if not message.size:  # no metric, no log: the same on every rank (the same model)
        return {}
    summed = hvd.allreduce(tf.constant(message), op=hvd.Sum, name="kerasdist_metric_sums").numpy()
    start = 0
    for variable, state in zip(variables, states):
        value = summed[start:start + state.size].reshape(tuple(variable.shape))
        variable.assign(value.astype(np.dtype(str(variable.dtype))))
        start += state.size
    ranks = {name: (local[name], value) for name, value in _results(model).items()}
    size = hvd.size()
    for i, key in enumerate(keys):
        if summed[start + i] == size:  # every rank logged its result of the metric: the summed state's
            logs[key] = _as_log(_pick(key, prefix, ranks, earlier)[1])
        elif _is_scalar(logs[key]):
            logs[key] = float(summed[start + len(keys) + i] / size)
    return ranks


def _results(model):
    """``model.get_metrics_result()`` as NumPy values (a scalar is a 0-d array)."""
    import numpy as np

    return {name: np.asarray(value) for name, value in model.get_metrics_result().items()}


def _pick(key, prefix, current, earlier):
    if key.startswith(prefix) and key[len(prefix):] in current:
        return current[key[len(prefix):]]
    return earlier.get(key)


def _this_ranks_result(key, prefix, local, earlier):
    if key.startswith(prefix) and key[len(prefix):] in local:
        return local[key[len(prefix):]]
    return earlier[key][0] if key in earlier else None


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
