"""Trains one small model with ``distribute=`` WORD on PyTorch (run it as 1 process or under torchrun's
variables) and writes, per rank, OUT-rank{r}.npz: the full weights, the losses, evaluate and predict
results, and the bytes of weights + optimizer state this process holds.

    KERAS_BACKEND=torch python torch_fsdp_train.py OUT WORD [--unbuilt] [--save] [--lstm | --conv | --bn]

--save: ModelCheckpoint (weights only, best only) to OUT-best.weights.h5 and (whole model) to OUT.keras and
EarlyStopping(restore_best_weights=True) during fit, then ``model.save_weights(OUT-final.weights.h5)`` and
``model.load_weights`` of that file on every rank. --lstm: an LSTM before the last Dense (its zero
initial state meets the sharded gates in the forward and the backward pass). --conv: Conv2D, Flatten (100 features
of a 5 x 5 x 4 map) and Dense. --bn: the same with a BatchNormalization after the (bias-free) Conv2D.
"""

import os
import sys

import kerasdist  # noqa: I001

import keras
import numpy as np
import torch


def local_bytes(variables):
    from torch.distributed.tensor import DTensor

    total = 0
    for variable in variables:
        value = variable.value
        value = value.to_local() if isinstance(value, DTensor) else value
        total += value.numel() * value.element_size()
    return total


def full(variable):
    from torch.distributed.tensor import DTensor

    value = variable.value
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().numpy()


def main(argv):
    out, word, unbuilt, save = argv[0], argv[1], "--unbuilt" in argv, "--save" in argv
    lstm, conv, bn = "--lstm" in argv, "--conv" in argv, "--bn" in argv
    torch.set_num_threads(1)
    keras.utils.set_random_seed(0)
    if lstm:
        model = keras.Sequential([keras.Input((4, 4)), keras.layers.LSTM(8), keras.layers.Dense(6)])
    elif conv or bn:
        # with --bn no bias before the normalization (whose mean removes it): that bias's gradient is 0 up to
        # rounding, which Adam turns into steps of its learning rate (3e-3 off one process; 2e-7 with epsilon 1e-3)
        model = keras.Sequential([keras.Input((5, 5, 1)), keras.layers.Conv2D(4, 2, padding="same", use_bias=not bn),
                                  *([keras.layers.BatchNormalization()] if bn else []),
                                  keras.layers.Flatten(), keras.layers.Dense(6)])
    elif unbuilt:
        model = keras.Sequential([keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(6)])
    else:
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(6)])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(65, 16)).astype("float32")  # 4 batches of 16 and one of 1
    y = np.tanh(x[:, :6] + rng.normal(0.0, 0.1, size=(65, 6))).astype("float32")
    if lstm or conv or bn:  # 4 batches of 16: a reshape cannot take 1 row over 2 ranks under fsdp (one KerasdistError)
        x, y = (x[:64].reshape(64, 4, 4) if lstm else rng.normal(size=(64, 5, 5, 1)).astype("float32")), y[:64]
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  distribute=None if word == "none" else word)
    checkpoints = [keras.callbacks.ModelCheckpoint(f"{out}-best.weights.h5", save_best_only=True,
                                                   save_weights_only=True, monitor="loss"),
                   keras.callbacks.ModelCheckpoint(f"{out}.keras"),
                   keras.callbacks.EarlyStopping(monitor="loss", restore_best_weights=True)] if save else []
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False, callbacks=checkpoints)
    if save:
        model.save_weights(f"{out}-final.weights.h5")
        model.load_weights(f"{out}-final.weights.h5")
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0)
    prediction = np.asarray(model.predict(x[:20], batch_size=8, verbose=0))
    rank = int(os.environ.get("RANK", "0"))
    np.savez(f"{out}-rank{rank}.npz", loss=np.array(history.history["loss"]), evaluation=np.array(evaluation),
             prediction=prediction, bytes=np.array(local_bytes(model.weights) + local_bytes(model.optimizer.variables)),
             **{f"w{i}": full(v) for i, v in enumerate(model.weights)})


if __name__ == "__main__":
    main(sys.argv[1:])
