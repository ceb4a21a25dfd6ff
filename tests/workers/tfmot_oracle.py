"""TFMOT's own 8-bit QAT on a Dense and a Conv2D layer (tf_keras), for tests/test_qat.py's oracle test.

Runs in its own process: importing tensorflow_model_optimization switches tf.keras to Keras 2
(TF_USE_LEGACY_KERAS). Reads weights, ranges and inputs from an .npz, writes TFMOT's outputs (inference
and training mode) and its ranges after one training call.

    TF_USE_LEGACY_KERAS=1 python tests/workers/tfmot_oracle.py in.npz out.npz
"""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tf_keras  # noqa: E402
import tensorflow_model_optimization as tfmot  # noqa: E402


def layer_for(kind):
    if kind == "dense":
        return tf_keras.layers.Dense(6, activation="relu", name="layer")
    return tf_keras.layers.Conv2D(4, 3, activation="relu", name="layer")


def set_variable(model, suffix, value):
    found = [v for v in model.weights
             if v.name.split("/")[-1].split(":")[0].replace("quantize_layer_1", "quantize_layer") == suffix]
    assert len(found) == 1, (suffix, [v.name for v in model.weights])
    (variable,) = found
    variable.assign(value)


def main(source, target):
    data = dict(np.load(source))
    out = {}
    for kind in ("dense", "conv"):
        x = data[f"{kind}_x"]
        model = tf_keras.Sequential([tf_keras.Input(x.shape[1:]), layer_for(kind)])
        quantized = tfmot.quantization.keras.quantize_model(model)
        set_variable(quantized, "kernel", data[f"{kind}_kernel"])
        set_variable(quantized, "bias", data[f"{kind}_bias"])
        set_variable(quantized, "quantize_layer_min", data[f"{kind}_input_min"])
        set_variable(quantized, "quantize_layer_max", data[f"{kind}_input_max"])
        set_variable(quantized, "post_activation_min", data[f"{kind}_output_min"])
        set_variable(quantized, "post_activation_max", data[f"{kind}_output_max"])
        # training first: TFMOT's weight quantizer (LastValueQuantizer) reads the kernel's range only in
        # training; before that, inference uses its initial [-6, 6]
        out[f"{kind}_training"] = quantized(x, training=True).numpy()
        out[f"{kind}_inference"] = quantized(x, training=False).numpy()
        for name in ("post_activation_min", "post_activation_max", "quantize_layer_min", "quantize_layer_max"):
            (variable,) = [v for v in quantized.weights if name in v.name.replace("quantize_layer_1", "quantize_layer")]
            out[f"{kind}_{name}"] = variable.numpy()
        out[f"{kind}_per_channel_kernel_range"] = np.array(
            [v.numpy().size for v in quantized.weights if "kernel_min" in v.name])
    np.savez(target, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
