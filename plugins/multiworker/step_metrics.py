"""What a custom train step does with its model's metrics, watched while it is traced: which tensors it took from a
metric's ``result()`` (a log keyed ``loss`` may be the ``total_loss`` tracker's result: after the metric states are
summed over the workers it must be that tracker's summed result, not an average of the workers' own), and which
metrics it fed one scalar per step (``Mean.update_state(loss)``: each worker's scalar is its share's mean, so its
update counts as the share's rows over the global batch's, as one process's single update of the global mean)."""

import contextlib


class Watched:
    def __init__(self):
        self.results = []  # (tensor, metric): every result() returned during the step
        self.scalar_fed = []  # metrics updated with one unweighted scalar

    def metric_of(self, value):
        """The metric whose ``result()`` returned ``value`` (this very tensor), or None."""
        return next((metric for tensor, metric in self.results if tensor is value), None)


@contextlib.contextmanager
def watched_metrics(metrics):
    """While the step runs: each metric's ``result`` and ``update_state`` recorded in the Watched it yields."""
    watched, patched = Watched(), []
    for metric in metrics:
        if "result" in vars(metric) or "update_state" in vars(metric):
            continue  # already watched (a step calling a step)
        object.__setattr__(metric, "result", _recording_result(metric, metric.result, watched))
        object.__setattr__(metric, "update_state", _recording_update(metric, metric.update_state, watched))
        patched.append(metric)
    try:
        yield watched
    finally:
        for metric in patched:
            for name in ("result", "update_state"):
                vars(metric).pop(name, None)


def _recording_result(metric, result, watched):
    def recorded(*args, **kwargs):
        value = result(*args, **kwargs)
        watched.results.append((value, metric))
        return value

    return recorded


def _recording_update(metric, update_state, watched):
    def recorded(*args, **kwargs):
        unweighted = not kwargs or set(kwargs) == {"sample_weight"} and kwargs["sample_weight"] is None
        values = args[0] if len(args) == 1 and unweighted else None  # Keras's per-output loss trackers: None
        if values is not None and len(getattr(values, "shape", (None,))) == 0 and metric not in watched.scalar_fed:
            watched.scalar_fed.append(metric)
        return update_state(*args, **kwargs)

    return recorded
