"""distribute=[..., "prune"]: magnitude pruning of Keras 3 kernels, under any strategy.

How it works (no tensorflow_model_optimization: it rejects Keras 3 and switches the whole
process to Keras 2 on import):

- At compile, each pruned kernel gets a mask variable (created under the strategy, so one copy
  per replica) and a constraint ``kernel * mask``. Keras applies variable constraints inside the
  train step right after every optimizer update, so pruned weights stay exactly zero in-graph.
- A callback added to ``fit`` recomputes the masks at the schedule's pruning steps: it keeps the
  ``n - round(sparsity * n)`` largest-magnitude weights of each kernel (exact top-k, so the
  sparsity is exact). It runs in cross-replica context: each mask is computed once and written to
  every replica, which therefore stay identical.
- On JAX and PyTorch (see :mod:`.host_masks`) each mask is computed in every process from the whole
  kernel, gathered over devices, processes and fsdp shards, and the constraint multiplies by it (JAX: a
  constant of the traced step, re-traced when a mask changes; PyTorch: one tensor updated in place).
- The schedule math is TFMOT's ``PolynomialDecay`` / ``ConstantSparsity``, re-implemented here.
- ``logs["sparsity"]`` (History, TensorBoard, progress bar) reports the pruned fraction at the end
  of each epoch, after any pruning step due then (``end_step`` included), so the last epoch's value
  is the weights' own; :func:`sparsity` reports it per layer from the weights themselves.
- :func:`strip` ends pruning for a model: the masks are applied a last time and the constraints
  removed, leaving a plain Keras model whose pruned weights are exactly zero.
"""

import dataclasses
import numbers
from typing import Callable, Optional, Sequence, Union

import kerasdist
from kerasdist.plugin_tools import check_choice, check_number

from .masks import (MaskConstraint, check_block, check_kernel_fits, magnitude_mask, mask_for,  # noqa: F401
                    parse_pattern)
from .host_masks import full_kernel
from .schedule import last_pruning_step, scheduled_sparsity  # noqa: F401 (public here)
from .selection import prunable_layers
from .state import PruningState, forget_state, make_callback, remember_state, state_of

SCHEDULES = ("polynomial", "constant")


# -- the spec -----------------------------------------------------------------

@dataclasses.dataclass
class Prune(kerasdist.OptimizationSpec):
    """Magnitude pruning with a TFMOT-compatible schedule.

    :param target_sparsity: fraction of each kernel's weights set to zero at the end, in [0, 1).
    :param schedule: "polynomial" (from ``initial_sparsity`` to the target between ``begin_step``
        and ``end_step``, TFMOT's PolynomialDecay) or "constant" (the target from ``begin_step``
        on, TFMOT's ConstantSparsity).
    :param initial_sparsity: polynomial only: the sparsity at ``begin_step``.
    :param begin_step: first optimizer step (``optimizer.iterations``) that prunes.
    :param end_step: last pruning step; pruning also happens at ``end_step`` itself, so the target
        is reached there. None: for "polynomial", the last step of the first ``fit``; for
        "constant", never stop.
    :param frequency: masks are recomputed every ``frequency`` steps from ``begin_step``.
    :param power: polynomial exponent (TFMOT's default 3).
    :param layers: which kernels to prune: None (every Dense, EinsumDense and Conv kernel), a list
        of layer names, or a callable ``layer -> bool`` over the layers that have a kernel.
    :param pattern: "2:4": structured N:M sparsity, at most 2 non-zeros in every 4 consecutive weights
        along the input dimension, from ``begin_step`` on (the schedule's sparsity is then 0.5).
    :param block: ``(input, output)`` block shape, e.g. ``(1, 4)``: whole blocks are zeroed (those with
        the smallest mean magnitude) following the schedule.
    """

    target_sparsity: float = 0.5
    schedule: str = "polynomial"
    initial_sparsity: float = 0.0
    begin_step: int = 0
    end_step: Optional[int] = None
    frequency: int = 100
    power: float = 3.0
    layers: Optional[Union[Sequence[str], Callable]] = None
    pattern: Optional[str] = None
    block: Optional[Sequence[int]] = None

    def __post_init__(self):
        self.n_of_m = parse_pattern(self.pattern)
        self.block = check_block(self.block)
        if self.n_of_m and self.block:
            raise kerasdist.KerasdistError("prune: give pattern= or block=, not both.")
        self.target_sparsity = _check_fraction("target_sparsity", self.target_sparsity)
        self.initial_sparsity = _check_fraction("initial_sparsity", self.initial_sparsity)
        self.schedule = check_choice(self.schedule, "schedule", "prune", SCHEDULES)
        _check_int("begin_step", self.begin_step, minimum=0)
        _check_int("frequency", self.frequency, minimum=1)
        if self.end_step is not None:
            _check_int("end_step", self.end_step, minimum=self.begin_step + 1)
        self.power = check_number(self.power, "power", "prune", minimum=0, inclusive_minimum=False)
        if isinstance(self.layers, str):
            self.layers = [self.layers]


def _check_fraction(name, value):
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0.0 <= value < 1.0):
        raise kerasdist.KerasdistError(
            f"prune: {name}={value!r} is not valid; give a fraction in [0, 1), e.g. 0.75 for "
            "75% of each kernel's weights set to zero.")
    return float(value)


def _check_int(name, value, minimum):
    return check_number(value, name, "prune", minimum=minimum, integer=True)


# -- public helpers -----------------------------------------------------------------

def sparsity(model):
    """``{layer name: fraction of exactly-zero kernel weights}`` for the pruned layers (over the whole kernel:
    with JAX or PyTorch processes sharing a kernel, call it in every process)."""
    import numpy as np

    state = state_of(model)
    layers = state.layers if state is not None and state.layers else prunable_layers(model)
    return {layer.name: float(np.mean(full_kernel(layer.kernel) == 0)) for layer in layers}


def strip(model):
    """End pruning: apply the masks, remove the constraints, forget the pruning state.

    The model is plain Keras afterwards (pruned weights exactly zero); later ``fit`` calls train
    every weight again. Compile with "prune" again to resume pruning. Returns the model.
    """
    state = forget_state(model)
    if state is not None and state.attached:
        state.detach()
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)  # the traced step still applied the masks
    return model


# -- hooks ------------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_optimizations(register):
    register("prune", Prune, aliases=("pruning",), backends=("tensorflow", "jax", "torch"),
             description="Magnitude pruning (TFMOT-style polynomial/constant schedules) on any strategy of "
                         "TensorFlow, JAX and PyTorch; replicas, ranks and shards keep one mask.")


@kerasdist.hookimpl
def kerasdist_prepare_model(model, spec):
    if not isinstance(spec, Prune):
        return
    strip(model)  # a re-compile replaces an earlier pruning state
    state = PruningState(spec, model)
    if model.built:
        state.attach()  # errors (no prunable layers) surface at compile
    remember_state(model, state)


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, spec):
    if method != "fit" or not isinstance(spec, Prune):
        return
    state = state_of(model)
    if state is not None:
        call_kwargs["callbacks"].append(make_callback(state, call_kwargs.get("initial_epoch") or 0))
