"""Per-model pruning state: the masks, their constraints, where the schedule stands, and the callback
that moves it during ``fit``."""

import logging
import math
import warnings
import weakref

import kerasdist
from kerasdist.plugin_tools import keras_backend, process_state

from .host_masks import HostMask, assign_masked, full_kernel, host_mask, pruned_weights_moved
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
        self.on_tensorflow = keras_backend() == "tensorflow"

    def attach(self):
        """Create the masks and add the mask constraints: on TensorFlow a mask variable under the model's
        strategy (one copy per replica), on JAX and PyTorch a :class:`HostMask`."""
        self.layers = prunable_layers(self.model, self.spec.layers)
        if self.spec.n_of_m or self.spec.block:
            self.layers = fitting_structure(self.layers, self.spec)
        self.masks = [self._new_mask(layer) for layer in self.layers]
        for layer, mask in zip(self.layers, self.masks):
            self.constraints.append(layer.kernel.constraint)
            layer.kernel.constraint = MaskConstraint(mask, layer.kernel.constraint)
        self.attached = True

    def _new_mask(self, layer):
        if not self.on_tensorflow:
            return HostMask(layer.kernel)
        import keras

        with self.model.distribute_strategy.scope():
            return keras.Variable(keras.ops.ones(layer.kernel.shape, layer.kernel.dtype), trainable=False,
                                  name=f"{layer.name}_prune_mask")

    def detach(self):
        """Apply the masks a last time and restore each kernel's own constraint."""
        self.apply_masks()
        for layer, constraint in zip(self.layers, self.constraints):
            layer.kernel.constraint = constraint
        self.attached = False

    def prune(self, sparsity):
        """New masks at ``sparsity`` from the whole kernels; on TensorFlow call in cross-replica context (writes
        every replica), on JAX and PyTorch in every process (the kernels are gathered). Whether a mask changed
        (always True on TensorFlow)."""
        if self.on_tensorflow:
            for layer, mask in zip(self.layers, self.masks):
                mask.assign(mask_for(layer.kernel, sparsity, self.spec.n_of_m, self.spec.block))
            self.apply_masks()
            return True
        changed = False
        for layer, mask in zip(self.layers, self.masks):
            full = full_kernel(layer.kernel)
            if mask.set(host_mask(full, sparsity, self.spec.n_of_m, self.spec.block)):
                assign_masked(layer.kernel, full, mask)
                changed = True
        return changed

    def apply_masks(self):
        for layer, mask in zip(self.layers, self.masks):
            if self.on_tensorflow:
                layer.kernel.assign(layer.kernel * mask)
            else:
                assign_masked(layer.kernel, full_kernel(layer.kernel), mask)

    def check_constraints_applied(self):
        """Off TensorFlow the masks live in the kernels' constraints, which Keras's optimizer applies: a train
        step that updates the kernels another way would leave them dense. One clear error instead."""
        for layer, mask in zip(self.layers, self.masks):
            if pruned_weights_moved(full_kernel(layer.kernel), mask):
                raise kerasdist.KerasdistError(
                    f"prune: layer {layer.name!r} has non-zero weights where its mask prunes them: the train step "
                    "updated the kernel without the optimizer's constraints. In a custom train_step, update with "
                    "optimizer.apply(grads, variables) / optimizer.apply_gradients (JAX: "
                    "optimizer.stateless_apply), which applies the pruning masks after each update.")

    def mask_sparsity(self):
        """Fraction of the pruned kernels' weights that the masks zero (what logs report)."""
        from keras import ops

        total = sum(math.prod(mask.shape) for mask in self.masks)
        if self.on_tensorflow:
            kept = sum(float(ops.convert_to_numpy(ops.sum(mask))) for mask in self.masks)
        else:
            kept = sum(mask.kept() for mask in self.masks)
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

    def due(self, step):
        """The schedule's pruning step in (last pruned step, ``step``], or None."""
        due = last_pruning_step(self.spec, step, self.end_step)
        if due is None or (self.last_pruned_step is not None and due <= self.last_pruned_step):
            return None
        return due

    def step_to(self, step):
        """Prune if the schedule has a pruning step in (last pruned step, ``step``]; whether a mask changed."""
        due = self.due(step)
        if due is None:
            return False
        target = scheduled_sparsity(self.spec, due, self.end_step)
        changed = self.prune(target)
        self.last_pruned_step = due
        log.debug("prune: step %d, sparsity %.4f", due, target)
        return changed


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

    on_jax = keras_backend() == "jax"

    class PruningCallback(keras.callbacks.Callback):
        """Recomputes the masks at the schedule's steps and reports ``logs["sparsity"]``.

        On JAX the model's variables hold no values in the middle of an epoch (the trainer carries them):
        the step is counted from the epoch's first one, and ``self.model`` (which re-attaches the values)
        is touched only where a pruning step is due; the train function is then re-traced with the new masks.
        """

        epoch_start = 0

        def _iterations(self):
            return int(ops.convert_to_numpy(self.model.optimizer.iterations))

        def _step(self, batch):
            return self.epoch_start + batch if on_jax else int(ops.convert_to_numpy(state.model.optimizer.iterations))

        def _prune_to(self, step):
            if state.due(step) is None:
                return
            self.model  # noqa: B018  on JAX: the values back in the variables, read again by the next step
            if state.step_to(step) and on_jax:
                self.model.make_train_function(force=True)  # JAX: the masks are constants of the traced step

        def on_train_begin(self, logs=None):
            if not state.attached:
                state.attach()
            state.resolve_end_step(self._iterations(), self.params.get("epochs", 1) - initial_epoch,
                                   self.params.get("steps"))

        def on_epoch_begin(self, epoch, logs=None):
            if on_jax:
                self.epoch_start = self._iterations()

        def on_train_batch_begin(self, batch, logs=None):
            self._prune_to(self._step(batch))

        def on_epoch_end(self, epoch, logs=None):
            if not state.on_tensorflow:
                state.check_constraints_applied()
            self._prune_to(self._iterations())  # a pruning step due at the epoch's last step, end_step included
            if logs is not None:
                logs["sparsity"] = state.mask_sparsity()

        def on_train_end(self, logs=None):
            self._prune_to(self._iterations())
            if state.on_tensorflow:
                state.apply_masks()

    return PruningCallback()
