"""Private Keras internals for changing a built layer in place (part of kerasdist._keras_internals)."""

import contextlib
import inspect


def refresh_call_signature(layer):
    """Make Keras re-read ``layer.call``'s signature (after its class changed): ``Layer.__init__`` records
    which call-context arguments (``training``, ``mask``) ``call`` takes in ``_call_signature``,
    ``call_signature_parameters``, ``_call_has_training_arg``, ``_call_has_mask_arg`` and
    ``_call_has_context_arg``; ``Layer.__call__`` passes ``training`` only when recorded."""
    signature = inspect.signature(layer.call)
    parameters = [p.name for p in signature.parameters.values()]
    layer._call_signature = signature
    layer.call_signature_parameters = parameters
    layer._call_has_training_arg = "training" in parameters
    layer._call_has_mask_arg = "mask" in parameters
    layer._call_has_context_arg = {arg: arg in parameters for arg in layer._call_context_args}


@contextlib.contextmanager
def state_unlocked(layer):
    """Let a built layer add variables (Keras locks a layer's ``_tracker`` when ``build`` returns)."""
    locked = layer._tracker.locked
    layer._tracker.unlock()
    try:
        yield
    finally:
        if locked:
            layer._tracker.lock()


def disable_per_channel_quantization(converter):
    """Post-training quantization with one scale per weight tensor: ``TFLiteConverter``'s
    ``_experimental_disable_per_channel`` (private; checked with TensorFlow 2.21)."""
    if not hasattr(converter, "_experimental_disable_per_channel"):
        raise AttributeError("TFLiteConverter has no _experimental_disable_per_channel: re-check "
                             "kerasdist/_keras_internals/layers.py against this TensorFlow")
    converter._experimental_disable_per_channel = True

