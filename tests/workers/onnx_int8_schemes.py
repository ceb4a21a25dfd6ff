"""Measure each onnx-int8 scheme on this CPU and on an emulated AVX2 CPU (no AVX-512, no VNNI).

    .venv/bin/python tests/workers/onnx_int8_schemes.py     # needs qemu-user (qemu-x86_64 >= 7.2)

The model and data are those of tests/test_tensorrt.py. Prints one row per (path, scheme): max |diff|
from Keras and argmax agreement on 64 examples, onnxruntime with its default session settings."""

import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist  # noqa: E402
from kerasdist_plugins.export import onnx as onnx_exporter  # noqa: E402

RUN_ONNX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onnxruntime_run.py")


def build_test_model():
    data = np.random.default_rng(0).normal(size=(128, 10, 10, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10, 10, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(loss="mse", optimizer="sgd", distribute="mirrored")
    model.fit(data, np.zeros((128, 10), "float32"), batch_size=32, epochs=1, verbose=0)
    return model, data


def on_avx2_cpu(path, x, folder):
    np.save(os.path.join(folder, "x.npy"), x)
    subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, RUN_ONNX, path, os.path.join(folder, "x.npy"),
                    os.path.join(folder, "y.npy")], check=True, capture_output=True, timeout=300)
    return np.load(os.path.join(folder, "y.npy"))


def main():
    model, data = build_test_model()
    x = data[64:]
    expected = model(x).numpy()
    print(f"auto here: {onnx_exporter.auto_int8_scheme()}; max|y| {np.max(np.abs(expected)):.3g}")
    print(f"{'path':<22} {'scheme':<10} {'max|diff|':>9} {'argmax':>7}")
    with tempfile.TemporaryDirectory() as folder:
        for scheme in onnx_exporter.INT8_SCHEMES:
            path = os.path.join(folder, f"{scheme}.onnx")
            kerasdist.export(model, path, format="onnx-int8", representative_data=data[:64], int8_scheme=scheme)
            for where, got in (("native (this CPU)", onnx_exporter.run_onnxruntime(path, x)),
                               ("AVX2 (qemu Haswell)", on_avx2_cpu(path, x, folder))):
                agreement = np.mean(got.argmax(-1) == expected.argmax(-1))
                print(f"{where:<22} {scheme:<10} {np.max(np.abs(got - expected)):>9.4f} {agreement:>7.4f}")


if __name__ == "__main__":
    main()
