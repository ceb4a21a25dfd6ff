"""What makes the ranks train as one device on the global batch: the same starting weights, gradients of
the global mean loss, and the same (all-reduced) metrics in every rank.

Gradients: each rank's gradient of its loss (a mean over its rows) is weighted by ``n_r / u``, ``n_r`` its
row count and ``u`` the largest share of the first step (the same in every rank, so a full batch weighs 1:
float16 gradients are not inflated): before the backward pass when the step calls ``optimizer.scale_loss``
(Keras's own step, a LossScaleOptimizer), else in ``optimizer.apply`` (a custom step such as keras.io's, which
calls ``loss.backward()`` itself). ``apply`` sums the gradients and the weights of every rank in one
``all_reduce`` over one flat buffer and divides by the summed weight: the gradient of the global mean,
``sum_r (n_r / N) grad_r``, also when the ranks' shares differ (an uneven last batch) or one is empty.
Gradients that cross ranks through synchronized BatchNormalization are weighted in its backward all-reduce
(:func:`sum_across_ranks`) when the weighting waits for ``apply``. Every optimizer the model holds (a GAN's
two) is wrapped so. Keras then applies its own clipping, loss scaling and gradient accumulation to that
gradient, exactly as on one device. A gradient that is None (a weight the loss does not reach) stays None.

Metrics: every rank logs the metrics of every rank (their states summed, additive: totals, counts, confusion
counts). With Keras's own ``train_step`` and ``compute_metrics`` the states the step has already updated when
``optimizer.apply`` runs (the loss trackers) travel in the gradients' all-reduce, and only the compiled
metrics, updated after it, need a second (small) one: one collective a step for a model compiled without
``metrics=``. A custom train step and every test step: custom_steps.py sums the metrics' changes and
reduces the step's own logs after each step.

A rank whose share of a batch is empty gets a placeholder row (data.py marks it with a sample weight of
-0.0): it runs the same forward/backward (the same collectives) with weight 0, and its metrics are untouched.
"""

import math

import keras

from kerasdist.plugin_tools import (all_layers, compiled_metrics, keras_step_order_is_known, local_metrics_result,
                                    note_applied, optimizers_held_by, synchronize_torch_batch_norm, unique_variables)

PLACEHOLDER_MARK = -0.0  # the sample weight of a placeholder row (a rank with no rows in this batch)


class StepState:
    """One model's current training step (shared by its optimizers and synchronized BatchNormalization):
    its rows, whether it holds only a placeholder, and the metric states summed with its gradients."""

    rows = 1
    placeholder = False
    unit = None  # the largest share of the first training step, agreed by every rank
    early_states = None  # metric states updated before optimizer.apply (Keras's own step): summed with the grads
    early_sums = None  # their sums over the ranks, for this step's get_metrics_result
    loss_scaled = False  # a scale_loss (any optimizer's) weighted the loss since the last apply
    metrics_global = False  # the metric states already hold every rank's updates (custom_steps.py)
    batch_level = frozenset()  # the metrics updated with one scalar in this step (custom_steps.py)
    global_statistics = frozenset()  # ids of synchronized BatchNormalization's moving statistics (every rank's)

    @property
    def weight(self):
        return self.rows / self.unit if self.unit else float(self.rows)


def broadcast_from_rank0(variables):
    """Every rank starts from rank 0's values (as DDP does at wrap time)."""
    import torch
    import torch.distributed as dist

    for variable in unique_variables(variables):
        value = variable.value.detach().clone()
        dist.broadcast(value, src=0)
        with torch.no_grad():
            variable.assign(value)


def barrier():
    import torch.distributed as dist

    dist.barrier()


def is_placeholder(data):
    import torch

    _, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if not isinstance(sample_weight, torch.Tensor) or sample_weight.numel() == 0:
        return False
    return bool(torch.all(sample_weight == 0) and torch.all(torch.signbit(sample_weight)))


def local_rows(data):
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    first = next((t for t in keras.tree.flatten(x) if t is not None), None)
    return int(first.shape[0]) if first is not None and len(first.shape) else 1


def state_of(model):
    """The model's :class:`StepState` (one per model: a recompiled model's new optimizer shares it)."""
    state = model.__dict__.get("_kerasdist_torch_state")
    if state is None:
        state = model._kerasdist_torch_state = StepState()
    return state


def install(model):
    """Wrap this model's steps, ``get_metrics_result``, and the ``scale_loss``/``apply`` of every optimizer it
    holds (instance attributes: other models and optimizers are untouched). Idempotent per object; an
    optimizer set later (a recompile, a GAN's own ``compile``) is wrapped at the next call."""
    state = state_of(model)
    if "_kerasdist_torch" not in model.__dict__:
        model._kerasdist_torch = True
        model.train_step = _train_step(model, model.train_step, state)
        model.test_step = _test_step(model, model.test_step, state)
        model.get_metrics_result = _all_reduced_metrics(model, local_metrics_result(model), state)
    for optimizer in optimizers_held_by(model):
        if "_kerasdist_torch" not in optimizer.__dict__:
            optimizer._kerasdist_torch = True
            optimizer.scale_loss = _weighted_loss(optimizer.scale_loss, state)
            optimizer.apply = _averaged_apply(optimizer.apply, state, model)


def _train_step(model, original, state):
    if not keras_step_order_is_known(model):  # asked before the instance's train_step is replaced
        from .custom_steps import summed_step

        def custom_train_step(data):
            return summed_step(model, state, original, data, training=True)

        return custom_train_step

    def train_step(data):
        try:
            state.metrics_global = state.loss_scaled = False
            state.early_states = _states_before_apply(model)
            state.placeholder = is_placeholder(data)
            state.rows = 0 if state.placeholder else local_rows(data)
            if state.unit is None:
                state.unit = largest(state.rows)
            return original(data) if not state.placeholder else _placeholder_step(model, data)
        finally:
            state.early_states = state.early_sums = None

    return train_step


def _placeholder_step(model, data):
    """The collectives of a training step (forward, backward, gradient all-reduce) with zero weight."""
    import torch

    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=True)
    model.zero_grad()
    outputs = [t for t in keras.tree.flatten(y_pred) if isinstance(t, torch.Tensor)]
    loss = sum((t.float().sum() * 0.0 for t in outputs), torch.zeros((), device=outputs[0].device))
    loss = model.optimizer.scale_loss(loss)
    variables = model.trainable_weights[:]
    if variables:  # as Keras's step: no trainable weights, no apply
        if loss.requires_grad:
            loss.backward()
        with torch.no_grad():
            model.optimizer.apply([v.value.grad for v in variables], variables)
    return model.get_metrics_result()


def largest(rows):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rows)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return max(float(value), 1.0)


def _test_step(model, original, state):
    from .custom_steps import summed_step

    def test_step(data):  # Keras's own or a custom one: the metrics' changes summed after each step
        return summed_step(model, state, original, data, training=False)

    return test_step


def _weighted_loss(original, state):
    def scale_loss(loss):
        state.loss_scaled = True  # the gradients that apply gets next are weighted already
        return original(loss) * state.weight

    return scale_loss


def _averaged_apply(original, state, model):
    def apply(grads, trainable_variables=None):
        import torch
        import torch.distributed as dist

        note_applied(model, model.trainable_variables if trainable_variables is None else trainable_variables)
        factor = 1.0 if state.loss_scaled else state.weight  # a loss no scale_loss weighted: its gradient, here
        state.loss_scaled = False
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else [None] * len(grads)
        device = next((g.device for g in grads if g is not None), "cpu")
        # a gradient that is None (a weight the loss does not reach) is sent as zeros with a "present" flag 0:
        # every rank sends the same buffer, whichever of its gradients are None
        likes = [g if g is not None else v.value if v is not None else torch.zeros(0, device=device)
                 for g, v in zip(grads, variables)]
        parts = [_weighted(g, factor) if g is not None else torch.zeros(like.numel(), device=device)
                 for g, like in zip(grads, likes)]
        early = state.early_states or []
        flags = [float(g is not None) for g in grads] + [state.weight]
        flat = torch.cat(parts + [v.value.detach().reshape(-1).float().to(device) for v in early]
                         + [torch.tensor(flags, device=device)])
        dist.all_reduce(flat)
        at = sum(p.numel() for p in parts)
        if state.early_states is not None:
            state.early_sums = _unflatten(flat[at:len(flat) - len(flags)], [v.value.shape for v in early])
        present = flat[len(flat) - len(flags):-1].tolist()
        total = flat[-1] if float(flat[-1]) > 0 else torch.ones((), device=device)  # every share empty: no step
        flat[:at].div_(total)  # in place, one pass: the averaged gradients are views of the buffer
        averaged = [part.to(like.dtype) if count > 0 else None
                    for part, like, count in zip(_unflatten(flat, [like.shape for like in likes]), likes, present)]
        return original(averaged, trainable_variables)

    return apply


def _weighted(grad, factor):
    """A gradient, flat, in float32, times ``factor`` (0: an empty share adds exact zeros, never NaN)."""
    import torch

    flat = grad.reshape(-1).float()
    if factor == 1.0:
        return flat
    return flat * factor if factor else torch.zeros_like(flat)


def synchronize_batch_norm(model):
    """Every BatchNormalization of ``model`` computes its statistics over every rank (a placeholder row weighs
    0); their moving statistics are noted in the model's state (an empty share's step keeps their update)."""
    state = state_of(model)
    synchronize_torch_batch_norm(model, sum_across_ranks(state), lambda: 0.0 if state.placeholder else 1.0)
    state.global_statistics = frozenset(id(v) for layer in all_layers(model)
                                        if isinstance(layer, keras.layers.BatchNormalization)
                                        for v in layer.non_trainable_variables)


def sum_across_ranks(state):
    """A sum over the ranks with autograd for synchronized BatchNormalization (the gradient is summed over the
    ranks too). When the step weights its gradients in ``apply`` (it did not call ``scale_loss``), each rank's
    incoming gradient is weighted by its share before the sum and the sum divided by it after, so that
    ``apply``'s weighting leaves every rank's contribution weighted by its own share."""
    import torch
    import torch.distributed as dist

    class SumAcrossRanks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            total = tensor.clone()
            if total.is_meta:  # fit's symbolic build: shapes only, no collective
                return total
            dist.all_reduce(total)
            return total

        @staticmethod
        def backward(ctx, grad):
            weight = 1.0 if state.loss_scaled else state.weight
            total = grad * weight
            dist.all_reduce(total)
            return total / weight if weight else total

    return SumAcrossRanks.apply


def _states_before_apply(model):
    """The metric states Keras's own training step has updated when it calls ``optimizer.apply``: all but
    the compiled metrics' (float32 ones: they travel in the gradients' float32 all-reduce)."""
    later = {id(v) for m in compiled_metrics(model) for v in m.variables}
    return [v for v in _metric_states(model) if id(v) not in later and str(v.dtype) == "float32"]


def _metric_states(model):
    return unique_variables(v for m in model.metrics for v in m.variables)


def _unflatten(flat, shapes):
    """The start of ``flat`` cut into tensors of these shapes, in order."""
    parts, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        parts.append(flat[at:at + size].reshape(shape))
        at += size
    return parts


def _all_reduced_metrics(model, original, state):
    """``get_metrics_result`` over every rank: the metrics' state variables (totals, counts, confusion
    counts: additive) summed over the ranks for the result, then put back, so each rank keeps its own. The
    states summed in this step's gradient all-reduce are taken from there; the rest in one all-reduce."""
    def get_metrics_result():
        import torch
        import torch.distributed as dist

        if state.metrics_global:
            return original()
        taken = state.early_sums is not None  # this step's apply summed the early states
        summed, sums = (list(state.early_states), list(state.early_sums)) if taken else ([], [])
        state.early_sums = None  # read once: a later call (epoch end) sums every state again
        done = {id(v) for v in summed}
        rest = [v for v in _metric_states(model) if id(v) not in done]
        if not rest and not summed:
            return original()
        variables = summed + rest
        # fit's symbolic build (meta tensors): no collective. torch's meta all_reduce draws from Python's random,
        # which Keras seeds every later initializer from: models built after the fit differed from one process's.
        if any(v.value.is_meta for v in variables):
            return original()
        local = [v.value.detach().clone() for v in variables]
        if rest:
            flat = torch.cat([v.value.detach().reshape(-1).double() for v in rest])
            dist.all_reduce(flat)
            sums += _unflatten(flat, [v.value.shape for v in rest])
        with torch.no_grad():  # copied in place, as Keras's torch Variable.assign does (without its checks)
            for variable, total in zip(variables, sums):
                variable.value.copy_(total)
            try:
                result = keras.tree.map_structure(
                    lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, original())
            finally:
                for variable, value in zip(variables, local):
                    variable.value.copy_(value)
        return result

    return get_metrics_result
