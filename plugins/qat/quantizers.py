"""Fake quantization with a straight-through gradient, and the moving-average activation ranges.

Training uses Keras's ``keras.quantizers.fake_quant_with_min_max_vars`` (TensorFlow's
``FakeQuantWithMinMaxVars*`` ops on the TensorFlow backend, which the LiteRT converter turns into
int8). While a model is exported (``kerasdist.exporting.tracing``), the ranges become constants and, for ONNX,
the weight quantizers become ``QuantizeAndDequantizeV4`` (tf2onnx writes both as
QuantizeLinear/DequantizeLinear pairs).
"""

from kerasdist.exporting import trace_mode as mode, tracing as export_mode  # noqa: F401 (qat's names for them)

EMA_DECAY = 0.999  # TFMOT's MovingAverageQuantizer default


def constant(value):
    """A variable's value as a constant of the traced graph (export modes)."""
    import numpy as np
    import tensorflow as tf

    with tf.init_scope():
        return np.asarray(value.numpy() if hasattr(value, "numpy") else value, dtype=np.float32)


# -- weights: per-channel (or per-tensor) symmetric, narrow range: [-127, 127] * scale ------------

def weight_range(kernel, per_channel):
    """TFMOT's LastValueQuantizer(symmetric=True, narrow_range=True): [-m, m], m = max |w| (per channel
    along the last axis)."""
    import numpy as np
    from keras import ops

    axes = tuple(range(len(kernel.shape) - 1)) if per_channel else None
    math = np if isinstance(kernel, np.ndarray) else ops  # numpy: constant ranges for an export
    limit = math.maximum(math.max(math.abs(kernel), axis=axes), 1e-8)  # an all-zero (pruned) channel
    return -limit, limit


def fake_quant_weights(variable, per_channel, depthwise=False, bits=8):
    """The kernel ``variable`` fake-quantized. A depthwise kernel (..., in, multiplier) is quantized per
    output channel (in * multiplier), as LiteRT and TensorRT do."""
    import keras
    from keras import ops

    kernel = ops.convert_to_tensor(variable)
    shape = tuple(kernel.shape)
    if depthwise:
        kernel = ops.reshape(kernel, shape[:-2] + (1, shape[-2] * shape[-1]))
    if mode() in ("litert", "onnx"):  # ranges from the variable's value, as graph constants
        value = constant(variable).reshape(tuple(kernel.shape))
        low, high = weight_range(value, per_channel)
    else:
        low, high = weight_range(kernel, per_channel)
    axis = len(kernel.shape) - 1 if per_channel else None
    if mode() == "onnx":
        import tensorflow as tf

        out = tf.quantization.quantize_and_dequantize_v2(kernel, low, high, signed_input=True, num_bits=bits,
                                                         range_given=True, narrow_range=True,
                                                         axis=axis)
    else:
        out = keras.quantizers.fake_quant_with_min_max_vars(kernel, low, high, num_bits=bits, narrow_range=True,
                                                            axis=axis)
    return ops.reshape(out, shape) if depthwise else out


# -- activations: per-tensor, asymmetric, moving-average ranges ------------------------------

def _across_replicas(value, reduce):
    """``reduce`` ("min" or "max") of the scalar ``value`` over everything that trains as one model: the
    replicas in sync (TensorFlow, in replica context) or the processes training without a strategy
    (multiworker's strategy-free step); torch's process group (data_parallel, fsdp). On JAX a batch is one
    global array (keras.distribution), so its min and max are already the global batch's."""
    from kerasdist.plugin_tools import keras_backend

    backend = keras_backend()
    if backend == "torch":
        return _across_torch_processes(value, reduce)
    if backend != "tensorflow":
        return value
    import tensorflow as tf

    from kerasdist.plugin_tools import gather_across_processes, process_group_size

    reduce = {"min": tf.reduce_min, "max": tf.reduce_max}[reduce]
    if not tf.distribute.has_strategy():
        return reduce(gather_across_processes(value)) if process_group_size() > 1 else value
    if tf.distribute.in_cross_replica_context():
        return value
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return reduce(context.all_gather(tf.reshape(value, [1]), axis=0))


def _across_torch_processes(value, reduce):
    """data_parallel: each rank's min/max all-reduced (MIN/MAX) over the default group. fsdp: the batch is a
    ``Shard(0)`` DTensor, so its min/max is already a pending reduction over the ranks (``Partial(min)``), which
    ``full_tensor()`` completes (c10d's all_reduce refuses a DTensor)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    value = value.detach()  # the ranges take no gradient on torch (see batch_range)
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MIN if reduce == "min" else dist.ReduceOp.MAX)
    return value


def batch_range(x, symmetric=False):
    """The range one training batch shows, over the global batch (all replicas): TFMOT's
    MovingAvgQuantize: [min(min x, 0), max(max x, 0)], or [-m, m] with m = max |x| when symmetric.
    On JAX and torch the range takes no gradient (as TFMOT, whose quantizer reads the updated variables):
    one process and many then train alike."""
    from keras import ops

    from kerasdist.plugin_tools import keras_backend

    x = ops.cast(x, "float32")
    if keras_backend() != "tensorflow":
        x = ops.stop_gradient(x)
    if symmetric:
        high = _across_replicas(ops.max(ops.abs(x)), "max")
        return -high, high
    low = _across_replicas(ops.min(x), "min")
    high = _across_replicas(ops.max(x), "max")
    return ops.minimum(low, 0.0), ops.maximum(high, 0.0)


def moving_average(variable, value, decay):
    """TFMOT's ``assign_moving_average(var, value, decay, zero_debias=False)``; a variable that has
    seen no batch yet (it starts not finite: NaN, or on JAX +-inf) takes the first batch's value."""
    from keras import ops

    old = ops.convert_to_tensor(variable)
    new = ops.where(ops.isfinite(old), old - (old - value) * (1.0 - decay), value)
    variable.assign(new)
    return new


def fake_quant_activations(x, low_var, high_var, training, decay=EMA_DECAY, symmetric=False, bits=8):
    """Fake-quantize ``x`` per tensor with the range variables, updating them first when training."""
    from keras import ops

    if mode() == "float":
        return x
    if mode() in ("litert", "onnx"):
        low, high = constant(low_var), constant(high_var)
    elif training:
        batch_low, batch_high = batch_range(x, symmetric)
        low, high = moving_average(low_var, batch_low, decay), moving_average(high_var, batch_high, decay)
    else:
        low, high = ops.convert_to_tensor(low_var), ops.convert_to_tensor(high_var)
        seen = ops.logical_and(ops.isfinite(low), ops.isfinite(high))
        low, high = ops.where(seen, low, -1.0), ops.where(seen, high, 1.0)  # not trained yet: see below
        quantized = _fake_quant(x, low, high, bits, symmetric)
        return ops.where(seen, quantized, x)  # evaluate before any training step: float
    return _fake_quant(x, low, high, bits, symmetric)


def _fake_quant(x, low, high, bits, symmetric):
    """Asymmetric: FakeQuantWithMinMaxVars (LiteRT's int8 activations). Symmetric (TensorRT's recipe):
    QuantizeAndDequantizeV4 on [-128, 127] * max/127, in training as in the exported ONNX."""
    import keras
    from keras import ops

    value = ops.cast(x, "float32")
    if symmetric:
        out = _symmetric_quantize_dequantize(value, high, bits)
    else:
        out = keras.quantizers.fake_quant_with_min_max_vars(value, low, high, num_bits=bits)
    return ops.cast(out, x.dtype)


def _symmetric_quantize_dequantize(x, high, bits):
    """QuantizeAndDequantizeV4 on [-2^(b-1), 2^(b-1) - 1] * high / (2^(b-1) - 1), with its straight-through
    gradient (1 inside the range, 0 outside): TensorFlow's op there, Keras ops on JAX and torch."""
    from keras import ops

    from kerasdist.plugin_tools import keras_backend

    if keras_backend() == "tensorflow":
        import tensorflow as tf

        return tf.quantization.quantize_and_dequantize_v2(x, -high, high, signed_input=True, num_bits=bits,
                                                         range_given=True, narrow_range=False)
    levels = 2.0 ** (bits - 1)
    scale = ops.maximum(high, 1e-12) / (levels - 1.0)
    clipped = ops.clip(x, -levels * scale, (levels - 1.0) * scale)
    rounded = ops.round(clipped / scale) * scale
    return clipped + ops.stop_gradient(rounded - clipped)
