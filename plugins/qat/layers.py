"""Quantization-aware versions of Keras layers, made by switching a layer's class in place.

``QAT<Base>`` subclasses ``<Base>`` (Dense, Conv2D, BatchNormalization, ...) and adds what the layer's
:class:`.graph.LayerPlan` asks for: a fake-quantized kernel, and moving-average
ranges for its input, its pre-activation output or its output. The model keeps its layers, weights and
graph; the classes are registered Keras serializables (``kerasdist>QATDense``...), so ``model.save`` /
``keras.saving.load_model`` keep the quantization state. The layers follow :mod:`kerasdist.exporting`'s
quantization protocol (``kerasdist_quantization_recipe``, ``kerasdist_quantization_ranges()``), through
which exporters read them.
"""

import inspect

from kerasdist.plugin_tools import process_state

from . import quantizers
from .graph import LayerPlan, weighted_types

CONFIG_KEY = "kerasdist_qat"
RANGES = ("input", "pre", "output")


class QuantizationAware:
    """The mixin; see the module docstring."""

    def __init__(self, *args, **kwargs):
        qat = kwargs.pop(CONFIG_KEY, None)
        super().__init__(*args, **kwargs)
        self.set_quantization_plan(LayerPlan(**qat) if qat else LayerPlan())

    def set_quantization_plan(self, plan):
        self._qat_plan = plan
        self._qat_ranges = {}
        if self.built:
            self._qat_add_ranges()

    def build(self, input_shape):
        super().build(input_shape)
        self._qat_add_ranges()

    def _qat_add_ranges(self):
        import keras

        wanted = [name for name, on in zip(RANGES, (self._qat_plan.input, self._qat_plan.pre_activation,
                                                    self._qat_plan.output)) if on]
        for name in wanted:
            if name in self._qat_ranges:
                continue
            pair = tuple(self.add_weight(name=f"qat_{name}_{end}", shape=(), dtype="float32", trainable=False,
                                         initializer=keras.initializers.Constant(unseen), autocast=False,
                                         aggregation="only_first_replica")
                         for end, unseen in zip(("min", "max"), unseen_range()))
            self._qat_ranges[name] = pair

    @property
    def quantization_plan(self):
        """The :class:`.graph.LayerPlan` this layer follows."""
        return self._qat_plan

    @property
    def range_variables(self):
        """``{"input"|"pre"|"output": (min variable, max variable)}``."""
        return dict(self._qat_ranges)

    def ranges(self):
        """``{"input"|"pre"|"output": (min, max)}`` as floats (not finite before the first training step: see
        :func:`unseen_range`)."""
        import numpy as np

        return {name: tuple(float(np.asarray(v.numpy())) for v in pair) for name, pair in self._qat_ranges.items()}

    kerasdist_quantization_ranges = ranges  # kerasdist.exporting's protocol

    @property
    def kerasdist_quantization_recipe(self):
        """The recipe these ranges were learned for ("litert" or "tensorrt"; kerasdist.exporting's protocol)."""
        return self._qat_plan.recipe

    def _qat_activation(self, name, x, training):
        if name not in self._qat_ranges:
            return x
        low, high = self._qat_ranges[name]
        return quantizers.fake_quant_activations(x, low, high, training, self._qat_plan.ema_decay,
                                                 symmetric=self._qat_plan.recipe == "tensorrt")

    def call(self, inputs, *args, training=None, **kwargs):
        if quantizers.mode() == "float":
            return self._qat_base_call(inputs, *args, training=training, **kwargs)
        x = self._qat_activation("input", inputs, training)
        if self._qat_plan.weights:
            kernel = quantizers.fake_quant_weights(self.kernel, self._qat_plan.per_channel, depthwise=is_depthwise(self))
            y = linear(self, x, kernel)
            y = self._qat_activation("pre", y, training)
            if self.activation is not None:
                y = self.activation(y)
        else:
            y = self._qat_base_call(x, *args, training=training, **kwargs)
        return self._qat_activation("output", y, training)

    def _qat_base_call(self, inputs, *args, training=None, **kwargs):
        base_call = super().call
        if "training" in inspect.signature(base_call).parameters:
            kwargs["training"] = training
        return base_call(inputs, *args, **kwargs)

    def get_config(self):
        return {**super().get_config(), CONFIG_KEY: self._qat_plan.to_config()}

    def _qat_unsaved(self):
        """How many variables the base class saves, and the ranges it does not save itself."""
        saved = {}
        super().save_own_variables(saved)
        ids = {id(value) for value in saved.values()}
        return len(saved), [v for pair in self._qat_ranges.values() for v in pair if id(v) not in ids]

    def save_own_variables(self, store):
        super().save_own_variables(store)
        count, extra = self._qat_unsaved()
        for i, variable in enumerate(extra):
            store[str(count + i)] = variable

    def load_own_variables(self, store):
        super().load_own_variables(store)
        count, extra = self._qat_unsaved()
        for i, variable in enumerate(extra):
            variable.assign(store[str(count + i)])


def unseen_range():
    """The (min, max) a range holds before its first training batch: NaN, NaN; on JAX the empty range
    (+inf, -inf). JAX checks that every process places the same value on a mesh of several processes
    (``multihost_utils.assert_equal``, which NaN, unequal to itself, fails: ``compile`` with quantize() under
    data_parallel over 2 processes raised it). Both are "not finite", which is what "unseen" is tested by."""
    from kerasdist.plugin_tools import keras_backend

    return (float("inf"), float("-inf")) if keras_backend() == "jax" else (float("nan"), float("nan"))


def linear(layer, x, kernel):
    """The layer's affine part with ``kernel`` in place of its own: Dense, EinsumDense, Conv, DepthwiseConv."""
    from keras import layers, ops

    if isinstance(layer, layers.EinsumDense):
        y = ops.einsum(layer.equation, x, kernel)
    elif isinstance(layer, layers.Dense):
        y = ops.matmul(x, kernel)
    elif isinstance(layer, (layers.DepthwiseConv1D, layers.DepthwiseConv2D)):
        y = ops.depthwise_conv(x, kernel, strides=layer.strides, padding=layer.padding,
                               dilation_rate=layer.dilation_rate, data_format=layer.data_format)
    else:
        y = layer.convolution_op(x, kernel)
    if layer.bias is None:
        return y
    bias = layer.bias
    if getattr(layer, "data_format", "channels_last") == "channels_first":
        bias = ops.reshape(bias, (1, -1) + (1,) * (len(y.shape) - 2))
    return ops.add(y, bias)


def is_depthwise(layer):
    from keras import layers

    return isinstance(layer, (layers.DepthwiseConv1D, layers.DepthwiseConv2D))


def class_for(base):
    """The registered ``QAT<Base>`` class for a Keras layer class."""
    # kept through process_state.reset(): Keras's serialization registry holds these classes for good
    classes = process_state.slot("qat.layer_classes", dict, keep=True)
    if base not in classes:
        import keras

        name = f"QAT{base.__name__}"
        cls = type(name, (QuantizationAware, base), {"__module__": __name__, "__doc__": f"Quantization-aware {base.__name__}."})
        classes[base] = keras.saving.register_keras_serializable(package="kerasdist", name=name)(cls)
    return classes[base]


def serializable_classes():
    """Every QAT class, registered (for loading saved models)."""
    from keras import layers

    return [class_for(base) for base in weighted_types() + (layers.BatchNormalization, layers.Activation, layers.ReLU)]


def make_quantization_aware(layer, plan):
    """Switch ``layer`` to its QAT class with ``plan``; its variables and graph stay."""
    from kerasdist.plugin_tools import refresh_call_signature

    layer.__class__ = class_for(type(layer))
    layer.set_quantization_plan(plan)
    refresh_call_signature(layer)


def quantization_aware_layers(model):
    from kerasdist.plugin_tools import all_layers

    return [layer for layer in all_layers(model) if isinstance(layer, QuantizationAware)]
