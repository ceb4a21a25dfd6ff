"""Export from the JAX or torch backend (the backend of this process): the digits net trained on
scikit-learn's bundled digits, then exported to each format with ``verify_with=``; one JSON line per
case, for tests/test_export_backends.py.

    KERAS_BACKEND=jax python tests/workers/export_backends.py out.json [case ...]

Several processes (tests/test_qat_processes.py): float and quantization-aware training under each WORD (one,
data_parallel, data_parallel_sync, fsdp), every rank exporting to the same paths:

    KERAS_BACKEND=torch OMP_NUM_THREADS=1 kerasdist launch -n 2 -- tests/workers/export_backends.py --ranks OUT WORD...
    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=1 kerasdist launch -n 2 -- \
        tests/workers/export_backends.py --ranks OUT data_parallel

EXPORT_RANKS_EPOCHS=F,Q sets the float and QAT epochs (default 3,2).
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
from process_ranks import rank as process_rank  # noqa: E402

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


# -- several processes: kerasdist launch -n 2 -- export_backends.py --ranks OUT WORD --------------------------------

def _strategy(word):
    """one (no strategy), data_parallel, data_parallel_sync (torch: BatchNormalization over the global batch), fsdp,
    hybrid (JAX: each kernel sharded over a "model" axis of every device)."""
    import kerasdist

    return {"one": None, "data_parallel": "data_parallel", "fsdp": "fsdp",
            "data_parallel_sync": kerasdist.data_parallel(sync_batch_norm=True),
            "hybrid": kerasdist.hybrid(mesh={"model": 2}) if word == "hybrid" else None}[word]


def keras_accuracy(model, x, y):
    """The model's test accuracy in this process: ``predict``, or on several JAX processes (where kerasdist refuses
    predict) a plain copy's, saved and loaded in this process."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        if jax.process_count() > 1:
            path = os.path.join(tempfile.mkdtemp(prefix=f"rank{jax.process_index()}-"), "copy.keras")
            model.save(path)
            model = keras.saving.load_model(path, compile=False)
    return qat_digits.accuracy(model.predict(x, verbose=0), y)


def _written(path):
    """(inode, mtime in ns, size) of the file export returned: the same in every rank when one rank wrote it."""
    stat = os.stat(path)
    return [stat.st_ino, stat.st_mtime_ns, stat.st_size]


def ranks(out, word):
    """The digits net trained 3 float epochs and 2 QAT epochs under ``word`` in every process of the job; every rank
    exports to the SAME paths (kerasdist.export called in every rank, as a torch/Lightning script does), and writes
    OUT-WORD-rank{r}.npz (its weights and ranges after float and after QAT training) and .json (its figures)."""
    import keras

    import kerasdist

    started = time.perf_counter()
    rank = process_rank()
    x, y, x_test, y_test = qat_digits.digits()
    model = qat_digits.conv_net()
    strategy = _strategy(word)
    plan = [] if strategy is None else [strategy]
    float_epochs, qat_epochs = map(int, os.environ.get("EXPORT_RANKS_EPOCHS", "3,2").split(","))
    qat_digits.compile_model(model, 0.05, strategy)
    if float_epochs:
        model.fit(x, y, batch_size=32, epochs=float_epochs, verbose=0)
    float_weights = [np.asarray(w) for w in model.get_weights()]
    info = {"backend": keras.backend.backend(), "rank": rank, "word": word,
            "float": keras_accuracy(model, x_test, y_test)}
    result = kerasdist.export(model, f"{out}-{word}-float.onnx", format="onnx", verify_with=x_test)
    info["float_onnx"] = {"max_abs_diff": result.max_abs_diff, "agreement": result.argmax_agreement,
                          "accuracy": onnx_accuracy(result.path, x_test, y_test), "path": result.path,
                          "written": _written(result.path)}
    try:  # rank 0's error, in every rank
        kerasdist.export(model, os.path.join(FOLDER, "no-such-folder", "m.onnx"), format="onnx")
        info["error_in_every_rank"] = None
    except kerasdist.KerasdistError as exc:
        info["error_in_every_rank"] = str(exc)
    qat_digits.compile_model(model, 0.01, plan + [kerasdist.quantize()])
    model.fit(x, y, batch_size=32, epochs=qat_epochs, verbose=0)
    qat_weights = [np.asarray(w) for w in model.get_weights()]
    info["qat_keras"] = keras_accuracy(model, x_test, y_test)
    result = kerasdist.export(model, f"{out}-{word}-qat.onnx", format="onnx", verify_with=x_test)
    import onnx

    ops = collections.Counter(node.op_type for node in onnx.load(result.path).graph.node)
    info["qat_onnx"] = {"max_abs_diff": result.max_abs_diff, "agreement": result.argmax_agreement,
                        "accuracy": onnx_accuracy(result.path, x_test, y_test), "path": result.path,
                        "quantize_linear": ops["QuantizeLinear"], "dequantize_linear": ops["DequantizeLinear"],
                        "written": _written(result.path)}
    try:
        info["ranges"] = {layer.name: layer.kerasdist_quantization_ranges()
                          for layer in kerasdist.exporting.quantization_aware_layers(model)}
    except Exception as exc:  # noqa: BLE001 (the ranges are in the npz too, from get_weights)
        info["ranges"] = f"{type(exc).__name__}: {exc}"
    info["seconds"] = time.perf_counter() - started
    name = f"{out}-{word}-rank{rank}"
    np.savez(name + ".npz", **{f"float{i}": w for i, w in enumerate(float_weights)},
             **{f"qat{i}": w for i, w in enumerate(qat_weights)})
    with open(name + ".json", "w") as f:
        json.dump(info, f, indent=1)
    print(f"[{word} rank {rank}]", json.dumps({k: v for k, v in info.items() if k != "ranges"}), flush=True)


def main():
    if sys.argv[1] == "--ranks":
        out, words = sys.argv[2], sys.argv[3:]
        failed = 0
        for word in words:
            try:
                ranks(out, word)
            except Exception as exc:  # noqa: BLE001 (recorded for the test of that word; the next one runs)
                failed += 1
                traceback.print_exc()
                with open(f"{out}-{word}.error-rank{process_rank()}.txt", "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}")
        sys.exit(1 if failed else 0)
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
