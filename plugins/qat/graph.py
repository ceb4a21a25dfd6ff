"""Where the quantizers go: the layers a runtime quantizes, read from the model's layer graph.

The LiteRT (int8) recipe mirrors what the converter does: a weighted layer's kernel is quantized, and
one activation quantizer sits where the runtime writes an int8 tensor: after the layer's activation,
or after the BatchNormalization and ReLU that the converter fuses into it. Layers that keep the scale
(Flatten, Reshape, MaxPooling, Dropout) need none; a weighted layer whose input does not already carry
a range (the model's input, an unquantized layer) quantizes its input. The TensorRT recipe quantizes
the inputs of the weighted layers only (symmetric), as TensorRT's explicit quantization expects.
"""

import dataclasses
import warnings

import kerasdist

from .quantizers import EMA_DECAY

FUSED_ACTIVATIONS = ("linear", "relu", "relu6")


@dataclasses.dataclass
class LayerPlan:
    """What one layer quantizes; stored in the layer's config (``kerasdist_qat``)."""

    recipe: str = "litert"
    weights: bool = False
    per_channel: bool = True
    input: bool = False
    output: bool = False
    pre_activation: bool = False
    ema_decay: float = EMA_DECAY

    def to_config(self):
        return dataclasses.asdict(self)


def weighted_types():
    from keras import layers

    return (layers.Dense, layers.EinsumDense, layers.Conv1D, layers.Conv2D, layers.Conv3D,
            layers.DepthwiseConv1D, layers.DepthwiseConv2D)


def per_tensor_in_litert(layer):
    """Kernels the LiteRT converter cannot take with per-output-channel ranges: it transposes Dense and
    EinsumDense kernels for FullyConnected ("'tfl.transpose' op has mismatched quantized axes") and
    reshapes 1-d (and 3-d) convolution kernels ("'tfl.reshape' op requires ... cast compatible"), moving
    the channel axis (measured, TF 2.21). TFMOT's default quantizes them per tensor too."""
    from keras import layers

    return isinstance(layer, (layers.Dense, layers.EinsumDense, layers.Conv1D, layers.DepthwiseConv1D, layers.Conv3D))


def _pass_through_types():
    from keras import layers

    return (layers.Flatten, layers.Reshape, layers.MaxPooling1D, layers.MaxPooling2D, layers.MaxPooling3D,
            layers.Dropout, layers.SpatialDropout1D, layers.SpatialDropout2D, layers.Identity,
            layers.ZeroPadding1D, layers.ZeroPadding2D, layers.Cropping1D, layers.Cropping2D, layers.InputLayer)


def activation_name(layer):
    from keras import activations

    function = getattr(layer, "activation", None)
    if function is None:
        return "linear"
    try:
        return activations.serialize(function) if not isinstance(function, str) else function
    except Exception:
        return getattr(function, "__name__", repr(function))


def is_fusable_activation(layer):
    from keras import layers

    if isinstance(layer, layers.ReLU):
        return layer.max_value in (None, 6.0) and not layer.negative_slope and not layer.threshold
    return isinstance(layer, layers.Activation) and activation_name(layer) in FUSED_ACTIVATIONS


def why_unsupported(layer):
    """Why a weighted layer cannot be quantization-aware trained, or None."""
    if getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None):
        return (f"it was quantized with model.quantize({layer.dtype_policy.quantization_mode!r}); "
                "quantization-aware training starts from the float model")
    if getattr(layer, "lora_enabled", False):
        return "LoRA is enabled on it"
    if getattr(layer, "padding", None) == "causal":
        return "causal padding is not supported"
    kernel = getattr(layer, "kernel", None)
    if kernel is None or "float" not in str(kernel.dtype):
        return "it has no float kernel"
    return None


class Graph:
    """Producers and consumers of a functional (or Sequential) model's tensors."""

    def __init__(self, model):
        import keras

        self.layers = list(getattr(model, "layers", []))
        self.producer, self.consumers, self.known = {}, {}, True
        for layer in self.layers:
            try:
                inputs, outputs = layer.input, layer.output
            except (AttributeError, ValueError):  # a subclassed model, or a layer called twice
                self.known = False
                continue
            for tensor in keras.tree.flatten(outputs):
                self.producer[id(tensor)] = layer
            for tensor in keras.tree.flatten(inputs):
                self.consumers.setdefault(id(tensor), []).append(layer)

    def input_producer(self, layer):
        """The layer producing ``layer``'s single input, skipping pass-through layers; None for a
        model input or several inputs."""
        import keras

        try:
            (tensor,) = keras.tree.flatten(layer.input)
        except (AttributeError, ValueError):
            return None
        source = self.producer.get(id(tensor))
        while source is not None and isinstance(source, _pass_through_types()):
            try:
                (tensor,) = keras.tree.flatten(source.input)
            except (AttributeError, ValueError):
                return None
            source = self.producer.get(id(tensor))
        return source

    def only_consumer(self, layer):
        import keras

        try:
            outputs = keras.tree.flatten(layer.output)
        except (AttributeError, ValueError):
            return None
        consumers = self.consumers.get(id(outputs[0]), []) if len(outputs) == 1 else []
        return consumers[0] if len(consumers) == 1 else None


def tail(graph, layer, per_channel):
    """``layer`` and the layers a converter fuses after it: a BatchNormalization after a convolution
    with no activation (per-channel weights only: folding then commutes with the weight quantizer), then
    a ReLU/ReLU6."""
    from keras import layers

    chain = [layer]
    if activation_name(layer) != "linear":
        return chain
    follower = graph.only_consumer(layer)
    if (per_channel and isinstance(follower, layers.BatchNormalization) and not per_tensor_in_litert(layer)
            and follower.axis in (-1, len(follower.input.shape) - 1)):
        chain.append(follower)
        follower = graph.only_consumer(follower)
    if follower is not None and is_fusable_activation(follower):
        chain.append(follower)
    return chain


def plan(model, chosen, recipe, per_channel, ema_decay):
    """``{layer: LayerPlan}`` for the weighted layers ``chosen`` and the fused layers after them."""
    graph = Graph(model)
    plans = {}
    if recipe == "tensorrt":
        for layer in chosen:
            plans[layer] = LayerPlan(recipe, weights=True, per_channel=True, input=True, ema_decay=ema_decay)
        return plans
    ends = {}
    for layer in chosen:
        chain = tail(graph, layer, per_channel) if graph.known else [layer]
        pre = activation_name(layer) not in FUSED_ACTIVATIONS
        plans[layer] = LayerPlan(recipe, weights=True, per_channel=per_channel and not per_tensor_in_litert(layer),
                                 pre_activation=pre, ema_decay=ema_decay)
        ends[layer] = chain[-1]
    quantized_ends = set(map(id, ends.values()))
    for layer in chosen:
        source = graph.input_producer(layer) if graph.known else None
        plans[layer].input = source is None or id(source) not in quantized_ends
        end = ends[layer]
        if end is layer:
            plans[layer].output = True
        else:
            plans[end] = LayerPlan(recipe, output=True, ema_decay=ema_decay)
    return plans


def choose(model, layer_names):
    """The weighted layers to quantize: every supported one (others skipped with a warning), or the
    ones named (an unsupported one is an error)."""
    from kerasdist.plugin_tools import all_layers, layers_by_name

    layers = list(all_layers(model))
    if layer_names is not None:
        named = layers_by_name(model, layer_names, "quantize")
        bad = {layer.name: why_unsupported(layer) if isinstance(layer, weighted_types())
               else f"{type(layer).__name__} is not a quantizable layer type" for layer in named}
        bad = {name: why for name, why in bad.items() if why}
        if bad:
            raise kerasdist.KerasdistError(
                "quantize: cannot quantize " + "; ".join(f"layer {name!r}: {why}" for name, why in bad.items())
                + f". Quantizable types: {', '.join(t.__name__ for t in weighted_types())}.")
        return named
    candidates = [layer for layer in layers if isinstance(layer, weighted_types())]
    keras_quantized = [layer.name for layer in candidates
                       if getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)]
    if keras_quantized:
        raise kerasdist.KerasdistError(
            f"quantize: layers {keras_quantized} were already quantized with Keras's model.quantize(); "
            "quantization-aware training needs the float model: build (or load) it without quantize().")
    skipped = {layer.name: why_unsupported(layer) for layer in candidates if why_unsupported(layer)}
    if skipped:
        warnings.warn("quantize: skipping " + "; ".join(f"{name!r} ({why})" for name, why in skipped.items())
                      + ": they stay float.", UserWarning, stacklevel=4)
    chosen = [layer for layer in candidates if layer.name not in skipped]
    if not chosen:
        types = sorted({type(layer).__name__ for layer in layers}) or ["none"]
        raise kerasdist.KerasdistError(
            f"quantize: model {model.name!r} has no quantizable layer (its layer types: {', '.join(types)}). "
            f"Quantizable: {', '.join(t.__name__ for t in weighted_types())}.")
    return chosen


def unquantized(model, plans):
    """Names of layers whose output a full-integer runtime needs a range for but that carry none."""
    from kerasdist.plugin_tools import all_layers

    from keras import layers as keras_layers

    covered = set(map(id, plans))
    fused = (keras_layers.BatchNormalization, keras_layers.Activation, keras_layers.ReLU)
    return sorted(layer.name for layer in all_layers(model)
                  if id(layer) not in covered and not isinstance(layer, _pass_through_types() + fused)
                  and not hasattr(layer, "layers"))
