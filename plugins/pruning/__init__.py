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
- The schedule math is TFMOT's ``PolynomialDecay`` / ``ConstantSparsity``, re-implemented here.
- ``logs["sparsity"]`` (History, TensorBoard, progress bar) reports the pruned fraction at the end
  of each epoch, after any pruning step due then (``end_step`` included), so the last epoch's value
  is the weights' own; :func:`sparsity` reports it per layer from the weights themselves.
- :func:`strip` ends pruning for a model: the masks are applied a last time and the constraints
  removed, leaving a plain Keras model whose pruned weights are exactly zero.
"""

import dataclasses
import logging
import math
import numbers
import warnings
import weakref
from typing import Callable, Optional, Sequence, Union

import kerasdist
from kerasdist.plugin_tools import check_number

from kerasdist_plugins.pruning.masks import (MaskConstraint, check_block, check_kernel_fits, magnitude_mask,  # noqa: F401
                                             mask_for, parse_pattern)

log = logging.getLogger("kerasdist.prune")

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
        if self.schedule not in SCHEDULES:
            raise kerasdist.KerasdistError(
                f"prune: schedule={self.schedule!r} is not valid; choose 'polynomial' or 'constant'.")
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


# -- the schedule (TFMOT's math) ------------------------------------------------

def scheduled_sparsity(spec, step, end_step):
    """The schedule's sparsity at ``step`` (TFMOT PolynomialDecay / ConstantSparsity)."""
    if spec.schedule == "constant":
        return spec.target_sparsity
    progress = min(1.0, max(0.0, (step - spec.begin_step) / (end_step - spec.begin_step)))
    return spec.target_sparsity + (spec.initial_sparsity - spec.target_sparsity) * (1.0 - progress) ** spec.power


def last_pruning_step(spec, step, end_step):
    """The latest step <= ``step`` at which the schedule prunes, or None (before ``begin_step``).

    Pruning steps are TFMOT's (``begin_step``, then every ``frequency`` steps while
    ``step <= end_step``) plus ``end_step`` itself, so that the target is reached there.
    """
    if step < spec.begin_step:
        return None
    if end_step is not None and step >= end_step:
        return end_step
    return spec.begin_step + (step - spec.begin_step) // spec.frequency * spec.frequency


# -- which layers ---------------------------------------------------------------

def _default_types():
    from keras import layers

    return (layers.Dense, layers.EinsumDense, layers.Conv1D, layers.Conv2D, layers.Conv3D,
            layers.Conv1DTranspose, layers.Conv2DTranspose, layers.Conv3DTranspose)


def _all_layers(model):
    for layer in getattr(model, "layers", []):
        yield layer
        if hasattr(layer, "layers"):
            yield from _all_layers(layer)


def _has_float_kernel(layer):
    kernel = getattr(layer, "kernel", None)
    return kernel is not None and hasattr(kernel, "assign") and "float" in str(kernel.dtype)


def prunable_layers(model, choice=None):
    """The layers whose kernels ``choice`` (see :class:`Prune` ``layers``) selects in ``model``."""
    candidates = [layer for layer in _all_layers(model) if _has_float_kernel(layer)]
    if choice is None:
        chosen = [layer for layer in candidates if isinstance(layer, _default_types())]
        what = "Dense, EinsumDense or Conv layers with a float kernel"
    elif callable(choice):
        chosen = [layer for layer in candidates if choice(layer)]
        what = f"layers with a float kernel accepted by layers={choice!r}"
    else:
        by_name = {layer.name: layer for layer in _all_layers(model)}
        unknown = [name for name in choice if name not in by_name]
        if unknown:
            raise kerasdist.KerasdistError(
                f"prune: layers={list(choice)!r} names {unknown} that the model does not have; its layers "
                f"are {sorted(by_name)}.")
        kernelless = [name for name in choice if not _has_float_kernel(by_name[name])]
        if kernelless:
            raise kerasdist.KerasdistError(
                f"prune: layers {kernelless} have no float `kernel` to prune; name Dense/Conv-like layers.")
        chosen = [by_name[name] for name in choice]
        what = f"layers named {list(choice)}"
    if not chosen:
        types = sorted({type(layer).__name__ for layer in _all_layers(model)}) or ["none"]
        raise kerasdist.KerasdistError(
            f"prune: model {model.name!r} has no prunable layers (looked for {what}; its layer types are "
            f"{', '.join(types)}). Add a Dense or Conv layer, or choose layers with prune(layers=[...]).")
    return chosen


def _fitting_structure(layers, spec):
    """The layers whose kernels the pattern/block divides: a layer named in ``layers=`` that does not fit is
    an error; one chosen by default is left dense, with a warning."""
    fitting, skipped = [], []
    for layer in layers:
        try:
            check_kernel_fits(layer, spec.n_of_m, spec.block)
            fitting.append(layer)
        except kerasdist.KerasdistError:
            if spec.layers is not None and not callable(spec.layers):
                raise
            skipped.append(f"{layer.name} {tuple(layer.kernel.shape)}")
    if skipped:
        warnings.warn(f"prune: {'pattern=' + repr(spec.pattern) if spec.pattern else 'block=' + repr(spec.block)} "
                      f"does not divide the kernels of {skipped}; they stay dense.", UserWarning, stacklevel=4)
    if not fitting:
        check_kernel_fits(layers[0], spec.n_of_m, spec.block)  # raises, naming the first layer
    return fitting


# -- per-model state --------------------------------------------------------------

class PruningState:
    """The masks of one model, their constraints, and where the schedule stands."""

    def __init__(self, spec, model):
        self.spec, self.model = spec, weakref.proxy(model)
        self.end_step = spec.end_step
        self.last_pruned_step = None
        self.layers, self.masks, self.constraints = [], [], []
        self.attached = False

    def attach(self):
        """Create the masks (under the model's strategy) and add the mask constraints."""
        import keras

        self.layers = prunable_layers(self.model, self.spec.layers)
        if self.spec.n_of_m or self.spec.block:
            self.layers = _fitting_structure(self.layers, self.spec)
        with self.model.distribute_strategy.scope():
            for layer in self.layers:
                kernel = layer.kernel
                mask = keras.Variable(keras.ops.ones(kernel.shape, kernel.dtype), trainable=False,
                                      name=f"{layer.name}_prune_mask")
                self.masks.append(mask)
                self.constraints.append(kernel.constraint)
                kernel.constraint = MaskConstraint(mask, kernel.constraint)
        self.attached = True

    def detach(self):
        """Apply the masks a last time and restore each kernel's own constraint."""
        self.apply_masks()
        for layer, constraint in zip(self.layers, self.constraints):
            layer.kernel.constraint = constraint
        self.attached = False

    def prune(self, sparsity):
        """New masks at ``sparsity``; call in cross-replica context (writes every replica)."""
        for layer, mask in zip(self.layers, self.masks):
            mask.assign(mask_for(layer.kernel, sparsity, self.spec.n_of_m, self.spec.block))
        self.apply_masks()

    def apply_masks(self):
        for layer, mask in zip(self.layers, self.masks):
            layer.kernel.assign(layer.kernel * mask)

    def mask_sparsity(self):
        """Fraction of the pruned kernels' weights that the masks zero (what logs report)."""
        from keras import ops

        total = sum(math.prod(mask.shape) for mask in self.masks)
        kept = sum(float(ops.convert_to_numpy(ops.sum(mask))) for mask in self.masks)
        return 1.0 - kept / total if total else 0.0

    def resolve_end_step(self, start_step, epochs, steps_per_epoch):
        if self.end_step is not None or self.spec.schedule == "constant":
            return
        if not steps_per_epoch:
            raise kerasdist.KerasdistError(
                "prune: end_step=None means 'the end of this fit', but the input's size is unknown; "
                "give prune(end_step=...) or fit(steps_per_epoch=...).")
        self.end_step = max(start_step + epochs * steps_per_epoch, self.spec.begin_step + 1)
        if self.spec.schedule == "polynomial" and self.end_step - self.spec.begin_step <= self.spec.frequency:
            warnings.warn(f"prune: frequency={self.spec.frequency} steps is not shorter than the pruning period "
                          f"(steps {self.spec.begin_step}..{self.end_step}), so the masks change only at its start "
                          "and end: the sparsity jumps to the target at the last step. Give a smaller frequency "
                          "for gradual pruning.", stacklevel=2)

    def step_to(self, step):
        """Prune if the schedule has a pruning step in (last pruned step, ``step``]."""
        due = last_pruning_step(self.spec, step, self.end_step)
        if due is None or (self.last_pruned_step is not None and due <= self.last_pruned_step):
            return
        target = scheduled_sparsity(self.spec, due, self.end_step)
        self.prune(target)
        self.last_pruned_step = due
        log.debug("prune: step %d, sparsity %.4f", due, target)


_states = weakref.WeakKeyDictionary()


def state_of(model):
    """The :class:`PruningState` of a model compiled with "prune", or None."""
    return _states.get(model)


def _make_callback(state, initial_epoch):
    import keras
    from keras import ops

    class PruningCallback(keras.callbacks.Callback):
        """Recomputes the masks at the schedule's steps and reports ``logs["sparsity"]``."""

        def _step(self):
            return int(ops.convert_to_numpy(state.model.optimizer.iterations))

        def on_train_begin(self, logs=None):
            if not state.attached:
                state.attach()
            state.resolve_end_step(self._step(), self.params.get("epochs", 1) - initial_epoch,
                                   self.params.get("steps"))

        def on_train_batch_begin(self, batch, logs=None):
            state.step_to(self._step())

        def on_epoch_end(self, epoch, logs=None):
            state.step_to(self._step())  # a pruning step due at the epoch's last step, end_step included
            if logs is not None:
                logs["sparsity"] = state.mask_sparsity()

        def on_train_end(self, logs=None):
            state.step_to(self._step())
            state.apply_masks()

    return PruningCallback()


# -- public helpers -----------------------------------------------------------------

def sparsity(model):
    """``{layer name: fraction of exactly-zero kernel weights}`` for the pruned layers."""
    import numpy as np

    state = state_of(model)
    layers = state.layers if state is not None and state.layers else prunable_layers(model)
    return {layer.name: float(np.mean(np.asarray(layer.kernel.numpy()) == 0)) for layer in layers}


def strip(model):
    """End pruning: apply the masks, remove the constraints, forget the pruning state.

    The model is plain Keras afterwards (pruned weights exactly zero); later ``fit`` calls train
    every weight again. Compile with "prune" again to resume pruning. Returns the model.
    """
    state = _states.pop(model, None)
    if state is not None and state.attached:
        state.detach()
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)  # the traced step still applied the masks
    return model


# -- hooks ------------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_optimizations(register):
    register("prune", Prune, aliases=("pruning",), backends=("tensorflow",),
             description="Magnitude pruning (TFMOT-style polynomial/constant schedules) on any strategy; "
                         "replicas keep identical masks.")


@kerasdist.hookimpl
def kerasdist_prepare_model(model, spec):
    if not isinstance(spec, Prune):
        return
    strip(model)  # a re-compile replaces an earlier pruning state
    state = PruningState(spec, model)
    if model.built:
        state.attach()  # errors (no prunable layers) surface at compile
    _states[model] = state


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, spec):
    if method != "fit" or not isinstance(spec, Prune):
        return
    state = state_of(model)
    if state is not None:
        call_kwargs["callbacks"].append(_make_callback(state, call_kwargs.get("initial_epoch") or 0))
