"""distribute=[..., kerasdist.quantize()]: int8 quantization-aware training (QAT) for Keras 3, under any
tf.distribute strategy; and kerasdist.tensorrt(): TensorRT's QAT recipe, optionally with 2:4 sparsity.

- ``quantize()`` (the LiteRT recipe): kernels fake-quantized symmetric, per output channel (or per
  tensor), narrow range [-127, 127]; activations fake-quantized per tensor, asymmetric, where the
  LiteRT runtime writes int8 tensors (see :mod:`.graph`), with ranges learned as TFMOT's moving averages
  (decay 0.999); straight-through gradients. ``export(format="litert-int8")`` then needs no
  representative data, ``format="onnx"`` writes QuantizeLinear/DequantizeLinear pairs and float formats
  drop the quantizers.
- ``tensorrt()``: symmetric int8 on the inputs of the weighted layers and per-channel weights, the Q/DQ
  placement of TensorRT's explicit quantization; ``sparsity="2:4"`` prunes every weighted kernel to two
  non-zeros in each block of four input weights (sparse tensor cores).
- Replicas: each training step reduces the batch minimum/maximum over all replicas (all-gather) before
  the moving-average update, so every replica holds the same ranges, equal to one device's on the
  global batch.
- TFMOT is not imported: it rejects Keras 3 models and switches the process to Keras 2.
"""

import contextlib
import warnings

import kerasdist
from kerasdist.plugin_tools import keras_backend

from . import graph, quantizers
from .layers import make_quantization_aware, quantization_aware_layers, serializable_classes
from .recipes import Quantize, TensorRT  # noqa: F401 (the specs, public here)


def quantize_model(model, spec, strategy=None):
    """Make ``model``'s layers quantization-aware in place, per ``spec``; returns the layer plans."""
    from kerasdist.plugin_tools import state_unlocked

    where = "quantize" if spec.recipe == "litert" else "tensorrt"
    if not model.built:
        raise kerasdist.KerasdistError(
            f"{where}: model {model.name!r} is not built, so its layers are not known yet; give it a keras.Input "
            "(or call model.build(input_shape)) before compile(distribute=[..., quantize()]).")
    existing = quantization_aware_layers(model)
    if existing:
        recipes = {layer.quantization_plan.recipe for layer in existing}
        if recipes != {spec.recipe}:
            raise kerasdist.KerasdistError(
                f"{where}: model {model.name!r} is already quantization-aware with the {sorted(recipes)} recipe; "
                "build the float model again to change the recipe.")
        return {layer: layer.quantization_plan for layer in existing}
    tensorflow = keras_backend() == "tensorflow"
    if tensorflow:
        _check_replicas_share_steps(strategy or model.distribute_strategy, where)
    chosen = graph.choose(model, spec.layers)
    plans = graph.plan(model, chosen, spec.recipe, getattr(spec, "weights", "per_channel") == "per_channel",
                       spec.ema_decay)
    scope = (strategy or model.distribute_strategy).scope() if tensorflow else contextlib.nullcontext()
    with scope:
        for layer, plan in plans.items():
            with state_unlocked(layer):
                make_quantization_aware(layer, plan)
    left = graph.unquantized(model, plans)
    if left and spec.recipe == "litert":
        warnings.warn(f"quantize: layers {left} are not quantized (no int8 range is learned for their outputs); a "
                      "full-integer LiteRT export may keep them in float.", UserWarning, stacklevel=3)
    return plans


def _check_replicas_share_steps(strategy, where):
    """The ranges are reduced over the replicas of one synchronous tf.distribute step, or over a declared process
    group (multiworker's strategy-free step, horovod). A parameter-server cluster (asynchronous workers) or several
    processes that are neither would each learn their own ranges, so they are refused."""
    import tensorflow as tf

    from kerasdist.plugin_tools import process_group_size

    cluster = kerasdist.detect_cluster()
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy) or cluster.has_parameter_servers:
        raise kerasdist.KerasdistError(
            f"{where}: quantization-aware training needs synchronous replicas; under a parameter-server cluster "
            "each worker would learn its own int8 ranges. Use 'mirrored' or 'multiworker'.")
    if cluster.num_workers > 1 and strategy.num_replicas_in_sync * process_group_size() < cluster.num_workers:
        raise kerasdist.KerasdistError(
            f"{where}: this is one of {cluster.num_workers} processes ({cluster.source}) that are not replicas of "
            f"one tf.distribute strategy (it has {strategy.num_replicas_in_sync}), so each would learn its own "
            "int8 ranges. Use distribute=['multiworker', quantize()] (kerasdist launch) for several processes.")


# -- public helpers -----------------------------------------------------------------------

def is_quantization_aware(model):
    return bool(quantization_aware_layers(model))


def ranges(model):
    """``{layer name: {"input"|"pre"|"output": (min, max)}}`` of a quantization-aware model."""
    return {layer.name: layer.ranges() for layer in quantization_aware_layers(model) if layer.ranges()}


# -- hooks --------------------------------------------------------------------------------

BACKENDS = ("tensorflow", "jax", "torch")

@kerasdist.hookimpl
def kerasdist_register_optimizations(register):
    register("quantize", Quantize, aliases=("qat",), backends=BACKENDS,
             description="Int8 quantization-aware training (per-channel weights, learned activation ranges); "
                         "export to litert-int8 / ONNX Q/DQ without representative data.")
    register("tensorrt", TensorRT, aliases=("tensorrt-qat",), backends=BACKENDS,
             description="TensorRT's int8 QAT recipe (symmetric Q/DQ on layer inputs, per-channel weights), "
                         "optionally 2:4 structured sparsity.")


@kerasdist.hookimpl
def kerasdist_keras_imported(keras):
    serializable_classes()


@kerasdist.hookimpl
def kerasdist_prepare_model(model, strategy, spec):
    if isinstance(spec, (Quantize, TensorRT)):
        quantize_model(model, spec, strategy)  # tensorrt(sparsity="2:4") gets its pruning through the plan
