"""Export from the JAX or torch backend (the backend of this process): the digits net trained on
scikit-learn's bundled digits, then exported to each format with ``verify_with=``; one JSON line per
case, for tests/test_export_backends.py.

    KERAS_BACKEND=jax python tests/workers/export_backends.py out.json [case ...]
"""

import collections
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import qat_digits  # noqa: E402

FOLDER = tempfile.mkdtemp(prefix="export-backends-")


def trained(distribute=None, epochs=3):
    x, y, x_test, y_test = qat_digits.digits()
    model = qat_digits.conv_net()
    qat_digits.compile_model(model, 0.05, distribute)
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    return model, (x, y, x_test, y_test)


def onnx_accuracy(path, x, y):
    from kerasdist_plugins.export.onnx import run_onnxruntime

    return qat_digits.accuracy(run_onnxruntime(path, x), y)


def case_float_onnx(model, data):
    import kerasdist

    x, y, x_test, y_test = data
    result = kerasdist.export(model, os.path.join(FOLDER, "float.onnx"), format="onnx", verify_with=x_test)
    return {"max_abs_diff": result.max_abs_diff, "agreement": result.argmax_agreement,
            "keras": qat_digits.accuracy(model.predict(x_test, verbose=0), y_test),
            "onnx": onnx_accuracy(result.path, x_test, y_test)}


def case_onnx_int8_calibrated(model, data):
    import kerasdist

    x, y, x_test, y_test = data
    result = kerasdist.export(model, os.path.join(FOLDER, "ptq.onnx"), format="onnx-int8",
                              representative_data=x[:200], verify_with=x_test,
                              verify_tolerance=0.2)  # torch's file quantizes coarser: max |d| 1.28 of max |y| 9.96
    return {"max_abs_diff": result.max_abs_diff, "agreement": result.argmax_agreement,
            "keras": qat_digits.accuracy(model.predict(x_test, verbose=0), y_test),
            "onnx_int8": onnx_accuracy(result.path, x_test, y_test)}


def case_litert(model, data):
    import kerasdist

    x, y, x_test, y_test = data
    result = kerasdist.export(model, os.path.join(FOLDER, "float.tflite"), format="litert", verify_with=x_test[:64])
    return {"max_abs_diff": result.max_abs_diff, "agreement": result.argmax_agreement}


def case_generator_data_is_refused(model, data):
    import kerasdist

    x = data[0]
    try:
        kerasdist.export(model, os.path.join(FOLDER, "gen.tflite"), format="litert-int8",
                         representative_data=lambda: ([x[i:i + 1]] for i in range(10)))
    except kerasdist.KerasdistError as exc:
        return {"error": str(exc)}
    return {"error": None}


def case_qat_onnx(model, data):
    """Last: quantization-aware training changes ``model`` in place (its layers become QAT layers)."""
    import kerasdist

    x, y, x_test, y_test = data
    float_accuracy = qat_digits.accuracy(model.predict(x_test, verbose=0), y_test)
    distribute = os.environ.get("EXPORT_BACKENDS_DISTRIBUTE")
    qat_digits.compile_model(model, 0.01, ([distribute] if distribute else []) + [kerasdist.quantize()])
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    result = kerasdist.export(model, os.path.join(FOLDER, "qat.onnx"), format="onnx", verify_with=x_test)
    import onnx

    ops = collections.Counter(node.op_type for node in onnx.load(result.path).graph.node)
    return {"float": float_accuracy, "qat_keras": qat_digits.accuracy(model.predict(x_test, verbose=0), y_test),
            "qat_onnx": onnx_accuracy(result.path, x_test, y_test), "agreement": result.argmax_agreement,
            "max_abs_diff": result.max_abs_diff, "quantize_linear": ops["QuantizeLinear"],
            "dequantize_linear": ops["DequantizeLinear"],
            "ranges": {k: v for k, v in kerasdist.exporting.quantization_aware_layers(model)[0]
                       .kerasdist_quantization_ranges().items()}}


CASES = {name[5:]: value for name, value in globals().items() if name.startswith("case_")}


def main():
    out, names = sys.argv[1], sys.argv[2:] or list(CASES)
    started = time.perf_counter()
    model, data = trained()
    results = {"backend": __import__("keras").backend.backend(), "train_seconds": time.perf_counter() - started}
    for name in names:
        started = time.perf_counter()
        try:
            results[name] = CASES[name](model, data)
        except Exception as exc:  # noqa: BLE001 (the test reports each case's failure)
            results[name] = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - started
        print(name, json.dumps(results[name])[:400], flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
