"""Per-model pruning state: the masks, their constraints, where the schedule stands, and the callback
that moves it during ``fit``."""

import logging
import math
import warnings
import weakref

import kerasdist
from kerasdist.plugin_tools import process_state

from .masks import MaskConstraint, mask_for
from .schedule import last_pruning_step, scheduled_sparsity
from .selection import fitting_structure, prunable_layers

log = logging.getLogger("kerasdist.prune")


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
            self.layers = fitting_structure(self.layers, self.spec)
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


def _states():
    """``{model: PruningState}`` (weak keys), in kerasdist's one home for process-wide state."""
    return process_state.slot("pruning.states", weakref.WeakKeyDictionary)


def state_of(model):
    """The :class:`PruningState` of a model compiled with "prune", or None."""
    return _states().get(model)


def remember_state(model, state):
    _states()[model] = state


def forget_state(model):
    """The model's state, no longer recorded (None if it had none)."""
    return _states().pop(model, None)


def make_callback(state, initial_epoch):
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
