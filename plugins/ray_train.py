"""Ray Train as an engine: inside a Ray Train training function (``TensorflowTrainer``, ``TorchTrainer``, any
backend), ``fit`` of a model compiled with ``distribute=`` reports to Ray by itself.

- Every epoch, every worker calls ``ray.train.report(metrics=<the epoch's logs>)`` (Ray requires all workers to
  report, the same number of times); rank 0 passes the model saved as ``model.keras`` as the checkpoint.
- A retry (``FailureConfig(max_failures=...)``) resumes from the last completed epoch: the backup of ``fit``
  (``private_backups``) is keyed by the Ray run (experiment name) and world size instead of the worker's
  command line, which under Ray holds per-process worker ids; the backup is removed when ``fit`` completes.

Ray is never imported here: the plugin acts only when the process already imported ``ray.train`` and Ray says
it runs a training function. See docs/ray.md.
"""

import os
import sys
import tempfile

import kerasdist


def ray_train_context():
    """Ray Train's context when this process runs a Ray Train training function, else None."""
    train = sys.modules.get("ray.train")
    if train is None or not hasattr(train, "get_context"):
        return None
    try:
        context = train.get_context()
        context.get_world_size()
    except (RuntimeError, DeprecationWarning, AttributeError):  # the driver, a Tune session, no session
        return None
    return context


@kerasdist.hookimpl
def kerasdist_job_identity(identity):
    context = ray_train_context()
    if context is not None:
        identity["arguments"] = ["ray-train", str(context.get_experiment_name()), int(context.get_world_size())]


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, spec):
    if method != "fit" or not isinstance(spec, kerasdist.StrategySpec):
        return
    context = ray_train_context()
    if context is None or any(type(cb).__module__.startswith("ray.") for cb in call_kwargs["callbacks"]):
        return  # not under Ray Train, or the user reports with Ray's own callback
    call_kwargs["callbacks"].append(_report_to_ray(int(context.get_world_rank())))


def _scalars(logs):
    metrics = {}
    for name, value in (logs or {}).items():
        try:
            metrics[name] = float(value)
        except (TypeError, ValueError):
            pass  # not a number: Ray's metrics are plain values
    return metrics


def _report_to_ray(rank):
    import keras

    class ReportToRay(keras.callbacks.Callback):
        """Each epoch: the logs to Ray from every worker, rank 0's model as the checkpoint."""

        def on_epoch_end(self, epoch, logs=None):
            import ray.train

            metrics = dict(_scalars(logs), epoch=epoch)
            if rank != 0:
                ray.train.report(metrics)  # Ray keeps rank 0's metrics, but every worker must report
                return
            with tempfile.TemporaryDirectory(prefix="kerasdist-ray-", ignore_cleanup_errors=True) as folder:
                self.model.save(os.path.join(folder, "model.keras"))  # reads this worker's copy: no collective
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

    return ReportToRay()
