"""Quantization-aware training on scikit-learn's bundled handwritten digits (1797 real 8x8 images, no
download): float, post-training int8 and QAT int8 accuracies of a small conv net, each int8 number from
the exported LiteRT file run in the LiteRT interpreter. Used by tests/test_qat.py and bench/bench_qat.py.

    python tests/workers/qat_digits.py [--weights per_tensor] [--distribute mirrored] [--json out.json]
"""

import argparse
import json
import os
import sys
import tempfile
import time

LOSS = dict(from_logits=True)


#: scikit-learn's wheel, installed beside the venv by the set-up (requirements/test-data.in)
DIGITS_CSV = os.path.join(sys.prefix, "test-data", "sklearn", "datasets", "data", "digits.csv.gz")


def digits():
    """(x_train, y_train, x_test, y_test): a fixed shuffle, 1400 training and 397 test images in [0, 1].

    The rows of sklearn.datasets.load_digits() (64 pixels 0-16, then the label), read from its file without
    importing scikit-learn."""
    import numpy as np

    if not os.path.exists(DIGITS_CSV):
        raise FileNotFoundError(f"{DIGITS_CSV} is missing: `make venv` installs it (requirements/test-data.txt)")
    data = np.loadtxt(DIGITS_CSV, delimiter=",")
    x = (data[:, :-1].reshape(-1, 8, 8, 1) / 16.0).astype("float32")
    y = data[:, -1].astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def conv_net(seed=1, imbalanced=False):
    """Conv-BN-ReLU, depthwise conv-BN-ReLU, max-pool, conv, dense: 5.9k parameters (with ``imbalanced``,
    the depthwise convolution has a bias and no BatchNormalization: see :func:`imbalance`)."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=imbalanced, name="depthwise")(h)
    if not imbalanced:
        h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(24, 3, activation="relu", name="conv_after")(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(10)(h)
    return keras.Model(inputs, outputs, name="digits_net")


def imbalance(model, spread=1000.0):
    """Scale depthwise channel c by s_c (spread over ``spread``x) and the next convolution's input channel c
    by 1/s_c. ReLU and max-pooling commute with positive scales, so the float function is unchanged, but
    the channels' ranges now differ as they do after folding BatchNormalizations with small variances (the
    MobileNet case of Nagel et al., "Data-Free Quantization", 2019): one scale per tensor rounds the small
    channels away."""
    import numpy as np

    scales = np.logspace(-0.5, 0.5, 16).astype("float32") ** np.log10(spread)
    depthwise, after = model.get_layer("depthwise"), model.get_layer("conv_after")
    depthwise.kernel.assign(depthwise.kernel.numpy() * scales.reshape(1, 1, 16, 1))
    depthwise.bias.assign(depthwise.bias.numpy() * scales)
    after.kernel.assign(after.kernel.numpy() / scales.reshape(1, 1, 16, 1))


def compile_model(model, learning_rate, distribute=None):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(**LOSS), metrics=["accuracy"],
                  **({"distribute": distribute} if distribute is not None else {}))


def accuracy(predictions, labels):
    import numpy as np

    return float(np.mean(np.argmax(predictions, -1) == labels))


def run(weights="per_channel", distribute=None, float_epochs=20, qat_epochs=4, folder=None, ptq_per_channel=None,
        imbalanced=False, qat_learning_rate=0.01, seed=1):
    """The accuracy table of one configuration (a dict)."""
    import keras

    import kerasdist
    from kerasdist_plugins.export.litert import run_litert

    folder = folder or tempfile.mkdtemp()
    x, y, x_test, y_test = digits()
    model = conv_net(seed=seed, imbalanced=imbalanced)
    compile_model(model, 0.05, distribute)
    model.fit(x, y, batch_size=32, epochs=float_epochs, verbose=0)
    if imbalanced:
        imbalance(model)
    result = {"weights": weights, "distribute": distribute, "imbalanced": imbalanced, "seed": seed, "float": accuracy(model.predict(x_test, verbose=0), y_test)}

    ptq = kerasdist.export(model, os.path.join(folder, "ptq.tflite"), format="litert-int8", representative_data=x[:200],
                           per_channel=weights == "per_channel" if ptq_per_channel is None else ptq_per_channel)
    result["ptq_int8"] = accuracy(run_litert(ptq.path, x_test), y_test)

    plan = [distribute] if isinstance(distribute, str) else list(distribute or [])
    compile_model(model, qat_learning_rate, plan + [kerasdist.quantize(weights=weights)])
    started = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=qat_epochs, verbose=0)
    result["qat_seconds"] = time.perf_counter() - started
    keras_predictions = model.predict(x_test, verbose=0)
    result["qat_keras"] = accuracy(keras_predictions, y_test)
    qat = kerasdist.export(model, os.path.join(folder, "qat.tflite"), format="litert-int8", verify_with=x_test)
    result["qat_int8"] = accuracy(run_litert(qat.path, x_test), y_test)
    result["qat_agreement"] = qat.argmax_agreement
    result["sizes"] = {"ptq_int8": ptq.size_bytes, "qat_int8": qat.size_bytes,
                       "float": kerasdist.export(model, os.path.join(folder, "float.tflite"), format="litert").size_bytes}
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", default="per_channel")
    parser.add_argument("--distribute", default=None)
    parser.add_argument("--imbalanced", action="store_true")
    parser.add_argument("--qat-epochs", type=int, default=4)
    parser.add_argument("--qat-learning-rate", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report(run(args.weights, args.distribute, imbalanced=args.imbalanced, qat_epochs=args.qat_epochs,
               qat_learning_rate=args.qat_learning_rate, seed=args.seed), args.json)


def report(result, path=None):
    """Print ``result`` as JSON, and write it to ``path`` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
