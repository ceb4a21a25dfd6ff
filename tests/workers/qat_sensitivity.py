"""How far quantization-aware training carries a last-digit change of its starting weights, in ONE process: the
digits net (qat_digits.py) trained 3 float epochs, then 2 more epochs twice, from those weights and from the same
weights plus uniform noise of a given size, with ``kerasdist.quantize()`` and, as the control, without it.

    KERAS_BACKEND=torch|jax|tensorflow python tests/workers/qat_sensitivity.py [PERTURBATION ...]

Prints max |w_a - w_b| after the 2 epochs for each. The QAT runs of 2 processes end a few 1e-3 from one process
although their float phase is within 1.2e-5 (tests/test_qat_processes.py): the int8 rounding of fake quantization
turns last-digit differences into whole quantization steps, as this shows within one process.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402

import kerasdist  # noqa: E402
import qat_digits  # noqa: E402


def trained(start, perturbation, quantize, data):
    x, y = data
    model = qat_digits.conv_net()
    rng = np.random.default_rng(1)
    model.set_weights([w + perturbation * rng.uniform(-1, 1, w.shape).astype(w.dtype) for w in start])
    qat_digits.compile_model(model, 0.01, [kerasdist.quantize()] if quantize else None)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    return [np.asarray(w) for w in model.get_weights()]


def main(perturbations):
    x, y, _, _ = qat_digits.digits()
    model = qat_digits.conv_net()
    qat_digits.compile_model(model, 0.05, None)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    start = [np.asarray(w) for w in model.get_weights()]
    for quantize in (True, False):
        reference = trained(start, 0.0, quantize, (x, y))
        for perturbation in perturbations:
            other = trained(start, perturbation, quantize, (x, y))
            difference = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, other))
            print(f"{keras.backend.backend()}: {'QAT' if quantize else 'float'} epochs from weights changed by "
                  f"{perturbation:g}: max |dw| = {difference:.3g}", flush=True)


if __name__ == "__main__":
    main([float(p) for p in sys.argv[1:]] or [1e-6])
