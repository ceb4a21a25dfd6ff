"""Trains with ``distribute="data_parallel"`` (``sync_batch_norm=True``) on PyTorch and records every
DistributedDataParallel that wraps a module, to check that on a Keras whose torch trainer wraps the model in DDP
itself (3.16) kerasdist turns that off and averages the gradients once, itself: each rank weighted by its rows
(57 rows in batches of 16: a last batch of 9, shares of 5 and 4), BatchNormalization's statistics over both
ranks, the metrics (a count among them) summed once, also through a user's ``get_metrics_result`` calling
``super()``.

    KERAS_BACKEND=torch python torch_nightly_ddp.py OUT WORD    (WORD "none": one process, plain Keras)

Writes OUT-rank{r}.npz: the weights, ``wrapped`` (how many DDPs wrapped each wrapped module, one entry per
module; [0]: none), ``ddp_of_ddp`` (1 if a DDP wrapped a DDP), ``kerasdist_averages`` (1 if kerasdist installed
its own gradient averaging on the optimizer), ``logs`` (the last fit's epoch logs, then evaluate's, sorted keys).
"""

import collections
import os
import sys

import kerasdist  # noqa: I001

import keras
import numpy as np
import torch

WRAPS = collections.Counter()
NESTED = []


def record_ddp():
    original = torch.nn.parallel.DistributedDataParallel.__init__

    def __init__(self, module, *args, **kwargs):
        WRAPS[id(module)] += 1
        NESTED.append(isinstance(module, torch.nn.parallel.DistributedDataParallel))
        original(self, module, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel.__init__ = __init__


class OwnResults(keras.Sequential):
    """A model class of the user's that overrides ``get_metrics_result`` and calls ``super()``: on 3.16 that is the
    torch trainer's, which sums every metric state over the ranks (kerasdist then summed them again)."""

    def get_metrics_result(self):
        return dict(super().get_metrics_result())


def main(out, word):
    torch.set_num_threads(1)
    record_ddp()
    keras.utils.set_random_seed(0)
    model = OwnResults([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                        keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(57, 6)).astype("float32")
    y = (x[:, :3] > 0).astype("float32")
    distribute = None if word == "none" else kerasdist.spec(word, sync_batch_norm=True)

    def compiled():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute=distribute,
                      metrics=["mae", keras.metrics.TruePositives(name="tp")])  # tp: a count, not a ratio

    compiled()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    compiled()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # a re-compile must not wrap
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    logs = [history.history[k][-1] for k in sorted(history.history)] + [evaluated[k] for k in sorted(evaluated)]
    rank = int(os.environ.get("RANK", "0"))
    np.savez(f"{out}-rank{rank}.npz", wrapped=np.array(sorted(WRAPS.values()) or [0]),
             ddp_of_ddp=np.array(int(any(NESTED))),
             kerasdist_averages=np.array(int("_kerasdist_torch" in model.optimizer.__dict__)),
             logs=np.array(logs, dtype="float64"),
             **{f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
