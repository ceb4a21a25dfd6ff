"""Keras's own quantization under a strategy: ``kerasdist.float8()`` (float8 training) and
``kerasdist.qlora(rank=4, mode="int8")`` (an int8 / int4 weight-quantized model fine-tuned through LoRA, as
KerasHub's QLoRA guide does), on TensorFlow, JAX and PyTorch.

- ``float8()`` calls ``model.quantize("float8")`` at compile (``layers=`` names a subset); ``qlora(...)`` calls
  ``model.quantize(mode)`` and then ``enable_lora(rank)`` on every layer it quantized (Keras's order: quantize
  first). A model the user already quantized that way is taken as it is (a second compile too).
- int8 / int4 with LoRA need nothing more: the int8 kernel is frozen, its inputs are quantized row by row, and
  the LoRA and bias gradients are ordinary ones, summed by every strategy (max |dw| 1.5e-8 from one process).
- Float8 needs one fix, made for every float8 model compiled with a word, whether ``float8()`` is in the list or
  the user called ``model.quantize("float8")`` before compile. Keras keeps each layer's scales and amax
  histories as trainable variables whose "gradient" is their new value (``overwrite_with_gradient``): the
  newest amax of the inputs and of the output gradients, taken over the batch the process sees. Under a word each
  replica saw only its share, and the replicas' values were kept or averaged: the scales then followed the
  local maxima and the weights drifted from one process's (TensorFlow mirrored: max |dw| 1.9e-3 after 8 steps).
  Here those values are reduced with an element-wise MAX over every replica before they are written (the rest
  of the history is the same everywhere), which is exactly what one process computes on the global batch:
  TensorFlow's replica context (all_gather: mirrored, central_storage); PyTorch's process group
  (``all_reduce(MAX)``, outside the gradient average of data_parallel; fsdp needs nothing). JAX needs
  nothing: its batch is one global array, so the maxima are already global.
- Refused at compile, with the fix: float8 over several TensorFlow processes (multiworker's two steps, horovod,
  a parameter-server cluster: each would write its own amax), Keras's gradient accumulation with float8 under a
  word, and these specs under torch fsdp (quantize before compile there: it is then equal to one process).
"""

import dataclasses
import weakref
from typing import Optional, Sequence

import kerasdist
from kerasdist.plugin_tools import (all_layers, check_choice, check_number, keras_backend, layers_by_name,
                                    note_applied, optimizers_held_by, process_group_size)

BACKENDS = ("tensorflow", "jax", "torch")
QLORA_MODES = ("int8", "int4")
_REDUCED = "_kerasdist_float8_max"  # marks an optimizer.apply that reduces the float8 maxima


@dataclasses.dataclass
class Float8(kerasdist.OptimizationSpec):
    """Float8 training (Keras's ``model.quantize("float8")``: e4m3 forward, e5m2 gradients, delayed scaling).

    :param layers: None (every Dense and EinsumDense) or the names of the layers to quantize.
    """

    layers: Optional[Sequence[str]] = None

    def __post_init__(self):
        self.layers = _names(self.layers, "float8")

    mode = "float8"


@dataclasses.dataclass
class QLoRA(kerasdist.OptimizationSpec):
    """Fine-tune a weight-quantized model through LoRA: ``model.quantize(mode)``, then ``enable_lora(rank)``.

    :param rank: LoRA rank (>= 1).
    :param mode: "int8" or "int4" (Keras's weight-only modes that take LoRA).
    :param alpha: LoRA alpha (None: Keras's default, the rank).
    :param layers: None (every Dense, EinsumDense and Embedding) or the names of the layers to quantize.
    """

    rank: int = 4
    mode: str = "int8"
    alpha: Optional[float] = None
    layers: Optional[Sequence[str]] = None

    def __post_init__(self):
        check_number(self.rank, "rank", "qlora", minimum=1, integer=True)
        check_choice(self.mode, "mode", "qlora", QLORA_MODES)
        check_number(self.alpha, "alpha", "qlora", minimum=0, allow_none=True)
        self.layers = _names(self.layers, "qlora")


def _names(layers, where):
    if layers is None:
        return None
    layers = [layers] if isinstance(layers, str) else list(layers)
    if not layers or not all(isinstance(name, str) for name in layers):
        raise kerasdist.KerasdistError(f"{where}: layers={layers!r} is not valid; give None (every Dense, "
                                       "EinsumDense and Embedding) or a list of layer names.")
    return layers


# -- quantizing the model ------------------------------------------------------------------------

def _quantizable(layer, mode):
    """Keras quantizes layers of exactly these classes (not subclasses); Embedding has no float8."""
    import keras

    kinds = (keras.layers.Dense, keras.layers.EinsumDense) + ((keras.layers.Embedding,) if mode != "float8" else ())
    return type(layer) in kinds


def _chosen(model, spec, where):
    if spec.layers is None:
        return [layer for layer in all_layers(model) if _quantizable(layer, spec.mode)]
    chosen = layers_by_name(model, spec.layers, where)
    wrong = [layer.name for layer in chosen if not _quantizable(layer, spec.mode)]
    if wrong:
        raise kerasdist.KerasdistError(
            f"{where}: Keras cannot quantize layers {wrong} in mode {spec.mode!r} (it quantizes Dense and EinsumDense "
            "layers, and Embedding in int8/int4, of exactly those classes); leave them out of layers=.")
    return chosen


def quantize_model(model, spec):
    """Quantize ``model`` in place per ``spec`` (idempotent: layers already in the mode are kept)."""
    where = "float8" if isinstance(spec, Float8) else "qlora"
    if not model.built:
        raise kerasdist.KerasdistError(
            f"{where}: model {model.name!r} is not built, so Keras cannot quantize its layers yet; give it a "
            f"keras.Input (or call model.build(input_shape)) before compile(distribute=[..., {where}(...)]).")
    layers = _chosen(model, spec, where)
    if not layers:
        raise kerasdist.KerasdistError(f"{where}: model {model.name!r} has no layer Keras can quantize in mode "
                                       f"{spec.mode!r} (Dense, EinsumDense; Embedding in int8/int4).")
    other = [f"{layer.name} ({layer.quantization_mode})" for layer in layers
             if layer.quantization_mode not in (None, spec.mode)]
    lora_first = [layer.name for layer in layers if layer.quantization_mode is None and layer.lora_enabled]
    if other or lora_first:
        raise kerasdist.KerasdistError(
            f"{where}: layers {other or lora_first} are already "
            f"{'quantized in another mode' if other else 'LoRA-enabled before quantization'}; Keras quantizes a "
            f"layer once, and LoRA goes on after quantizing. Start from the float model (load its weights again).")
    fresh = {id(layer) for layer in layers if layer.quantization_mode is None}
    if fresh:
        model.quantize(spec.mode, filters=lambda layer: id(layer) in fresh)
    if isinstance(spec, QLoRA):
        for layer in layers:
            if not layer.lora_enabled:
                layer.enable_lora(spec.rank, lora_alpha=spec.alpha)
    return layers


def float8_layers(model):
    return [layer for layer in all_layers(model) if getattr(layer, "quantization_mode", None) == "float8"]


# -- float8's amax and scales: the maximum over every replica -----------------------------------------------

def _replica_context():
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    return context if context is not None and context.num_replicas_in_sync > 1 else None


def _write_max_tf(pairs):
    """TensorFlow, in replica context: each float8 value's maximum over the replicas (all_gather), written in
    cross-replica context (a central_storage variable takes no assignment in replica context)."""
    import tensorflow as tf

    context = _replica_context()
    values = [tf.reduce_max(context.all_gather(tf.expand_dims(g, 0), axis=0), axis=0) for g, _ in pairs]

    def write(strategy, *values):
        for (_, variable), value in zip(pairs, values):
            one = strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)  # equal on every replica
            strategy.extended.update(variable.value, lambda var, x: var.assign(x), args=(one,), group=False)

    context.merge_call(write, args=tuple(values))


def _write_max_torch(pairs):
    import torch.distributed as dist

    for g, variable in pairs:
        total = g.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        variable.assign(total)


def _overwritten(variable):
    return bool(getattr(variable, "overwrite_with_gradient", False))


def _max_apply(model, optimizer, write, where):
    """Wrap ``optimizer.apply``: the float8 values (variables Keras overwrites with their "gradient") are reduced
    with MAX over every replica and written here; the rest goes on to ``apply`` (the strategy's sum or the ranks'
    average of the real gradients)."""
    keras_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        if trainable_variables is None:
            return keras_apply(grads, trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None and _overwritten(v)]
        if not pairs or (where == "replica" and _replica_context() is None):
            return keras_apply(grads, trainable_variables)
        written = {id(v) for _, v in pairs}
        write(pairs)
        note_applied(model, [v for _, v in pairs])
        kept = [(g, v) for g, v in zip(grads, trainable_variables) if id(v) not in written]
        return keras_apply([g for g, _ in kept], [v for _, v in kept])

    setattr(apply, _REDUCED, where)
    object.__setattr__(optimizer, "apply", apply)


def _no_accumulation(optimizer):
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise kerasdist.KerasdistError(
            "float8: gradient_accumulation_steps with float8 training under a strategy word is not supported (the "
            "amax maxima are written at every step, over the replicas); leave it out or train float8 in one process.")


def _world(strategy):
    return int(getattr(strategy, "world_size", None) or getattr(strategy, "num_replicas_in_sync", 1) or 1)


def _check_tensorflow(strategy):
    """Where the maxima cannot be reduced over the replicas of one synchronous step: one error with the fix."""
    import tensorflow as tf

    cluster = kerasdist.detect_cluster()
    replicas = getattr(strategy, "num_replicas_in_sync", 1)
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy) or cluster.has_parameter_servers:
        raise kerasdist.KerasdistError(
            "float8: float8 training keeps amax histories that every replica must take from the global batch; a "
            "parameter-server cluster's workers step asynchronously. Use 'mirrored' on one machine.")
    if cluster.num_workers > 1 or process_group_size() > 1:
        raise kerasdist.KerasdistError(
            f"float8: this is one of {cluster.num_workers} processes ({cluster.source}); float8 training over several "
            "TensorFlow processes is not supported: multiworker's steps (strategy-free and "
            "MultiWorkerMirroredStrategy's) and horovod would each scale float8 by their own batch's amax. Train float8 with 'mirrored' on one "
            "machine, or on JAX (data_parallel) or PyTorch (data_parallel) over several processes.")
    return replicas > 1


def _is_fsdp(spec):
    return getattr(spec, "name", "") == "fsdp"


#: optimizers whose float8 maxima are reduced in replica context (TensorFlow): once each
_installed = weakref.WeakSet()


def _make_float8_exact(optimizers, model, strategy, spec):
    """TensorFlow: wrap each optimizer (at compile, and at fit for a model quantized after compile); PyTorch:
    only the checks here, the wrapping at the start of fit (:func:`_outermost_max_callback`)."""
    if not float8_layers(model):
        return
    if keras_backend() == "tensorflow" and _check_tensorflow(strategy):
        for optimizer in optimizers:
            if optimizer is not None and optimizer not in _installed:
                _no_accumulation(optimizer)
                _installed.add(optimizer)
                _max_apply(model, optimizer, _write_max_tf, "replica")


def _outermost_max_callback(model):
    """PyTorch, at the start of each fit (after data_parallel wrapped ``apply``): reduce the float8 maxima
    outside that wrapper."""
    import keras

    class Float8Maxima(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            for optimizer in optimizers_held_by(model):
                _no_accumulation(optimizer)
                if getattr(optimizer.apply, _REDUCED, None) != "outermost":
                    _max_apply(model, optimizer, _write_max_torch, "outermost")

    return Float8Maxima()


# -- hooks ---------------------------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_optimizations(register):
    register("float8", Float8, aliases=("fp8",), backends=BACKENDS,
             description="Keras float8 training (model.quantize('float8')) under any strategy word, its amax "
                         "histories and scales taken over the global batch, as one process's.")
    register("qlora", QLoRA, backends=BACKENDS,
             description="Keras int8/int4 weight quantization plus LoRA (model.quantize, enable_lora): QLoRA-style "
                         "fine-tuning under any strategy word.")


#: model -> the strategy spec of its current plan (its prepare_model runs before an optimization's)
_strategy_specs = weakref.WeakKeyDictionary()


@kerasdist.hookimpl
def kerasdist_prepare_model(model, spec):
    if isinstance(spec, kerasdist.StrategySpec):
        _strategy_specs[model] = spec
    elif isinstance(spec, (Float8, QLoRA)):
        if keras_backend() == "torch" and _is_fsdp(_strategy_specs.get(model)):
            raise kerasdist.KerasdistError(
                f"{'float8' if isinstance(spec, Float8) else 'qlora'}: under 'fsdp' the kernels are already sharded "
                "when this spec would quantize them; quantize before compile instead (model.quantize(mode), then "
                "layer.enable_lora(rank) for LoRA) and compile with distribute='fsdp' alone.")
        quantize_model(model, spec)


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    _strategy_specs.pop(model, None)  # every prepare_model of this compile has run
    if isinstance(spec, (kerasdist.StrategySpec, Float8)):  # the strategy's spec, or float8 alone
        _make_float8_exact([compile_kwargs.get("optimizer")], model, strategy, spec)


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, strategy, spec):
    if method != "fit" or not isinstance(spec, (kerasdist.StrategySpec, Float8)) or not float8_layers(model):
        return
    _make_float8_exact(optimizers_held_by(model), model, strategy, spec)  # also the checks that need fit's cluster
    if keras_backend() == "torch" and _world(strategy) > 1 and isinstance(spec, kerasdist.StrategySpec) \
            and not _is_fsdp(spec):  # fsdp: measured equal to one process without it (max |dw| 1.5e-8)
        call_kwargs["callbacks"].append(_outermost_max_callback(model))
