"""Run an ONNX file in onnxruntime (CPU, default session settings, as a user would) on saved inputs.

    python onnxruntime_run.py model.onnx inputs.npy outputs.npy

Started by tests under ``qemu-x86_64 -cpu Haswell`` to run onnxruntime's AVX2 kernels (no AVX-512,
no VNNI) on any x86 host. Prints, as its last line, the CPU features numpy sees (JSON), so the test
can check that the emulated CPU model is the one in effect."""

import json
import sys

import numpy as np
import onnxruntime

path, inputs, outputs = sys.argv[1:4]
session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
(source,) = session.get_inputs()
np.save(outputs, session.run(None, {source.name: np.load(inputs).astype(np.float32)})[0])
try:
    from numpy._core._multiarray_umath import __cpu_features__ as features  # numpy's own cpuid reading
except ImportError:
    features = {}
print(json.dumps({name: bool(features.get(name)) for name in ("AVX2", "FMA3", "AVX512F", "AVX512_VNNI")}))
