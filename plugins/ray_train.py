"""Ray Train as an engine: inside a Ray Train training function (``TensorflowTrainer``, ``TorchTrainer``, any
backend), ``fit`` of a model compiled with ``distribute=`` reports to Ray by itself.

- Every epoch, every worker calls ``ray.train.report(metrics=<the epoch's logs>)`` (Ray requires all workers to
  report, the same number of times); rank 0 passes the model saved as ``model.keras`` as the checkpoint.
- A model whose variables are split across processes (torch ``fsdp`` DTensors, a JAX layout sharded over
  processes) is reported without a checkpoint (rank 0 alone cannot read it), with one warning saying why.
- A retry (``FailureConfig(max_failures=...)``) resumes from the last completed epoch: the backup of ``fit``
  (``private_backups``) is keyed by the Ray run (experiment name, and the Tune trial when Ray gives one) and
  world size instead of the worker's command line, which under Ray holds per-process worker ids; the backup
  is removed when ``fit`` completes.

Ray is never imported here: the plugin acts only when the process already imported ``ray.train`` and Ray says
it runs a training function. See docs/ray.md.
"""

import os
import sys
import tempfile
import warnings

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


def _trial(context):
    """The Tune trial's id (else name) this run belongs to, or None: Ray Train V2 raises for both (a Train run
    inside a Tune trial has its own ``RunConfig(name)`` there), a run without Tune gives none."""
    for getter in ("get_trial_id", "get_trial_name"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Ray marks both deprecated
                value = getattr(context, getter)()
        except (RuntimeError, DeprecationWarning, AttributeError, NotImplementedError):
            continue
        if value:
            return str(value)
    return None


def backup_identity(context):
    """What identifies the job of ``fit``'s backup under Ray: the run, the Tune trial if any, the world size
    (trials of one Tune experiment share its name, and must not share a backup)."""
    trial = _trial(context)
    return ["ray-train", str(context.get_experiment_name())] + ([trial] if trial else []) \
        + [int(context.get_world_size())]


@kerasdist.hookimpl
def kerasdist_job_identity(identity):
    context = ray_train_context()
    if context is not None:
        identity["arguments"] = backup_identity(context)


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


def split_across_processes(model):
    """True when a variable of ``model`` (or of its optimizer) is split across processes, so that one process
    cannot save it alone: a torch DTensor (``fsdp``), a JAX array neither fully addressable nor replicated."""
    dtensor = getattr(getattr(getattr(sys.modules.get("torch"), "distributed", None), "tensor", None), "DTensor", None)
    optimizer = getattr(model, "optimizer", None)
    for variable in list(model.variables) + list(getattr(optimizer, "variables", None) or []):
        value = getattr(variable, "value", variable)
        if dtensor is not None and isinstance(value, dtensor):
            return True
        if not getattr(value, "is_fully_addressable", True) and not getattr(value, "is_fully_replicated", True):
            return True
    return False


def _report_to_ray(rank):
    import keras

    class ReportToRay(keras.callbacks.Callback):
        """Each epoch: the logs to Ray from every worker, rank 0's model as the checkpoint."""

        def on_train_begin(self, logs=None):
            self.checkpoints = rank == 0 and not split_across_processes(self.model)
            if rank == 0 and not self.checkpoints:
                warnings.warn("ray_train: the model's variables are split across processes (fsdp, a sharded "
                              "layout): rank 0 cannot save it alone, so each epoch is reported to Ray without a "
                              "checkpoint (docs/ray.md)", stacklevel=2)

        def on_epoch_end(self, epoch, logs=None):
            import ray.train

            metrics = dict(_scalars(logs), epoch=epoch)
            if not self.checkpoints:
                ray.train.report(metrics)  # Ray keeps rank 0's metrics, but every worker must report
                return
            with tempfile.TemporaryDirectory(prefix="kerasdist-ray-", ignore_cleanup_errors=True) as folder:
                self.model.save(os.path.join(folder, "model.keras"))  # reads this worker's copy: no collective
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

    return ReportToRay()
