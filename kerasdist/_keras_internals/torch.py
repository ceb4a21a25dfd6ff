"""The private Keras pieces data parallelism on the PyTorch backend needs (part of kerasdist._keras_internals).

- Whether the installed Keras's torch trainer wraps the model in ``DistributedDataParallel`` by itself once
  torch.distributed is initialised (Keras's main branch, keras-team/keras#23316, for 3.16), and the switch
  that turns it off per model (``Trainer._initialize_ddp``, the ``ddp_model`` attribute): DDP averages the
  ranks' gradients with equal weights (an uneven last batch, an empty share: wrong) and only for steps that
  call the model through it (a custom ``train_step`` calls ``self``: never averaged), so kerasdist keeps
  averaging them itself, as on 3.15. Also the trainer's ``get_metrics_result``, which on 3.16 sums every
  metric state over the ranks (kerasdist sums them once, itself): the base trainer's is called instead.
- ``BatchNormalization._moments`` (private, replaced per instance) for batch statistics over every rank.
- ``Layer._flatten_layers`` (private) to find nested layers.
- The order of Keras's own torch ``train_step`` (``training.keras_step_order_is_known``): the loss trackers are
  updated before ``optimizer.apply``, the compiled metrics (``Trainer._compile_metrics``, private) after it.

torch is imported only inside the functions (``import kerasdist`` never imports it).
"""

import inspect
import weakref

from .training import replace_moments
from .versions import installed_keras_version, locate, missing, owner_of


def keras_wraps_ddp():
    """Whether this Keras's torch trainer wraps the model in DDP itself when torch.distributed is
    initialised (Keras >= 3.16, or a trainer whose source uses ``DistributedDataParallel``)."""
    version = installed_keras_version() or "0"
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) >= (3, 16):
        return True
    if missing("torch_train_step"):
        return False
    trainer_class, _ = owner_of("torch_train_step")
    try:
        return "DistributedDataParallel" in inspect.getsource(inspect.getmodule(trainer_class))
    except (ImportError, OSError, TypeError):
        return False


def keep_keras_from_wrapping_ddp(model):
    """On a Keras whose torch trainer wraps the model in DistributedDataParallel itself (3.16): turn that off
    for ``model`` (an instance attribute; a DDP the trainer already made is dropped), so that kerasdist's own
    averaging (each rank weighted by its rows, a custom step's too) is the only one. Returns whether it was on.
    A trainer that wraps DDP elsewhere than kerasdist knows is one KerasdistError (never averaged twice)."""
    if not keras_wraps_ddp():
        return False
    _, attribute = owner_of("torch_ddp_wrapping")
    object.__setattr__(model, attribute, _no_ddp)
    if getattr(model, "ddp_model", None) is not None:
        object.__setattr__(model, "ddp_model", None)
    return True


def _no_ddp(*args, **kwargs):
    """The trainer's DDP wrapping, turned off (kerasdist averages the gradients)."""


#: the models whose torch trainer's ``get_metrics_result`` gives this rank's results (kerasdist sums them itself)
_LOCAL_RESULTS = weakref.WeakSet()


def local_metrics_result(model):
    """``model.get_metrics_result`` of this rank alone: the base trainer's where the model has the torch
    trainer's own (3.16's sums every metric state over the ranks; kerasdist sums them itself, once). A model
    class's own override stays, and its ``super()`` call reaches the trainer's: that one gives this rank's
    results for the models kerasdist distributes."""
    summing, base = locate("torch_trainer_metrics_result"), locate("trainer_metrics_result")
    if getattr(type(model), "get_metrics_result", None) is summing:
        return base.__get__(model)
    if summing is not base:
        _local_through_super(model)
    return model.get_metrics_result


def _local_through_super(model):
    owner, attribute = owner_of("torch_trainer_metrics_result")
    summing, base = getattr(owner, attribute), locate("trainer_metrics_result")
    if not getattr(summing, "kerasdist_local_for_distributed_models", False):
        def get_metrics_result(self):
            return base(self) if self in _LOCAL_RESULTS else summing(self)

        get_metrics_result.kerasdist_local_for_distributed_models = True
        get_metrics_result.__wrapped__ = summing
        setattr(owner, attribute, get_metrics_result)
    _LOCAL_RESULTS.add(model)


def compiled_metrics(model):
    """The metrics Keras's ``compute_metrics`` updates (those of the latest ``compile``): [] or [one Metric]."""
    compiled = getattr(model, "_compile_metrics", None)
    return [compiled] if compiled is not None else []


def synchronize_torch_batch_norm(model, sum_across, weight_of_rows=lambda: 1.0):
    """Make every ``keras.layers.BatchNormalization`` of ``model`` (nested ones too) compute its training
    moments over every rank: ``sum_across(tensor)`` sums a torch tensor over the ranks with autograd
    (``torch.distributed.nn.functional.all_reduce``); the local sum, squared sum and row count are summed,
    each multiplied by ``weight_of_rows()`` (0 for a rank holding a placeholder row). Masked calls keep
    local statistics. Returns the number of layers changed."""
    return replace_moments(model, lambda layer: _summed_moments(layer, layer._moments, sum_across, weight_of_rows))


def _summed_moments(layer, local_moments, sum_across, weight_of_rows):
    import torch

    def moments(inputs, mask):
        if mask is not None:
            return local_moments(inputs, mask)
        axes = [a % inputs.ndim for a in layer._reduction_axes]
        x = inputs.float() if inputs.dtype in (torch.float16, torch.bfloat16) else inputs
        weight = float(weight_of_rows())
        local_sum = x.sum(dim=axes, keepdim=True) * weight
        local_squares = (x * x).sum(dim=axes, keepdim=True) * weight
        count = 1
        for a in axes:
            count *= x.shape[a]
        local_count = torch.tensor([count * weight], dtype=x.dtype, device=x.device)
        size = local_sum.numel()
        total = sum_across(torch.cat([local_sum.reshape(-1), local_squares.reshape(-1), local_count]))
        n = torch.clamp(total[2 * size], min=1.0)
        mean = (total[:size] / n).reshape(local_sum.shape)
        variance = torch.clamp((total[size:2 * size] / n).reshape(local_sum.shape) - mean * mean, min=0.0)
        mean, variance = mean.squeeze(tuple(axes)), variance.squeeze(tuple(axes))
        return mean.to(inputs.dtype), variance.to(inputs.dtype)

    return moments
