"""Pruning on the JAX or PyTorch backend, on the digits set (tests/workers/qat_digits.py): one process start
runs every scenario named on the command line, in turn, and writes OUT-SCENARIO-rank{r}.npz (full weights, the
masks this process holds) and .json (test accuracy, logs["sparsity"], pruning.sparsity).

    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=2 python prune_digits.py OUT SCENARIO...
    KERAS_BACKEND=jax kerasdist launch -n 2 prune_digits.py OUT SCENARIO...   (one device per process)
    KERAS_BACKEND=torch kerasdist launch -n 2 prune_digits.py OUT SCENARIO...

SCENARIO is STRATEGY-PRUNING: STRATEGY one, own_step (JAX: one device, a train_step that skips the optimizer),
data_parallel, hybrid (JAX: mesh batch 1 x model 2, every kernel
sharded) or fsdp (torch: every kernel sharded), PRUNING dense, prune80 (polynomial 0 -> 80 %) or 2of4
(pattern="2:4"). A scenario that raises is recorded in OUT-SCENARIO.error-rank{r}.txt and the next one runs.
"""

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kerasdist  # noqa: E402
from process_ranks import process_count, rank, run_scenarios  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import qat_digits  # noqa: E402
from kerasdist_plugins import pruning  # noqa: E402
from kerasdist_plugins.pruning.host_masks import full_kernel  # noqa: E402
from kerasdist_plugins.pruning.state import state_of  # noqa: E402

BATCH = 50  # 28 steps an epoch
#: name -> (prune's arguments, epochs, SGD's learning rate and momentum). dense/prune80/2of4: 20 epochs to full
#: accuracy (one process and a distributed one drift apart in the last bits over 560 momentum steps, as they do
#: unpruned; 10 epochs left 80 % 1.5 pt below dense; 2:4 from step 56 ended 2.8 pt below, from step 0 0.75 pt
#: on JAX); short80/short2of4: 4 epochs of plain SGD, short enough that they stay
#: within 1e-5 and masks can be compared.
PRUNINGS = {
    "dense": (None, 20, 0.1, 0.9),
    "prune80": (dict(target_sparsity=0.8, begin_step=56, end_step=336, frequency=28), 20, 0.1, 0.9),
    "2of4": (dict(pattern="2:4", schedule="constant", begin_step=0, frequency=28), 20, 0.1, 0.9),
    "short80": (dict(target_sparsity=0.8, begin_step=0, end_step=84, frequency=14), 4, 0.05, 0.0),
    "short2of4": (dict(pattern="2:4", schedule="constant", begin_step=0, frequency=14), 4, 0.05, 0.0),
}


def mlp(kind=keras.Sequential):
    keras.utils.set_random_seed(0)
    return kind([keras.Input((64,)), keras.layers.Dense(128, activation="relu", name="d1"),
                 keras.layers.Dense(64, activation="relu", name="d2"), keras.layers.Dense(10, name="d3")])


class OwnSGDStep(keras.Sequential):
    """JAX: a user's train_step that updates the weights itself (plain SGD), never calling the optimizer, so no
    constraint (and no pruning mask) is applied: pruning must say so rather than leave the kernels dense."""

    def train_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data[0], data[1]

        def loss_of(values):
            y_pred, new_non_trainable = self.stateless_call(values, non_trainable, x, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
            return keras.ops.mean(loss), new_non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        trainable = [v - 0.05 * g for v, g in zip(trainable, grads)]
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


def distribute(strategy, prune):
    words = {"one": None, "own_step": None, "data_parallel": "data_parallel", "fsdp": "fsdp",
             "hybrid": kerasdist.hybrid(mesh={"batch": 1, "model": 2}, min_shard_size=0)}[strategy]
    if prune is None:
        return words
    spec = kerasdist.prune(**prune)
    return spec if words is None else [words, spec]


def numpy_accuracy(weights, x, y):
    h = x
    for i in range(0, len(weights), 2):
        h = h @ weights[i] + weights[i + 1]
        if i + 2 < len(weights):
            h = np.maximum(h, 0)
    return float(np.mean(np.argmax(h, -1) == y))


def run(out, scenario):
    strategy, pruning_name = scenario.split("-")
    x, y, x_test, y_test = qat_digits.digits()
    x, x_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    prune, epochs, learning_rate, momentum = PRUNINGS[pruning_name]
    started = time.monotonic()
    model = mlp(OwnSGDStep if strategy == "own_step" else keras.Sequential)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute=distribute(strategy, prune))
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    weights = [full_kernel(v) for v in model.weights]  # every process takes part in the gathers
    state = state_of(model)
    masks = [m.array for m in state.masks] if state is not None else []
    info = {"accuracy": numpy_accuracy(weights, x_test, y_test), "loss": history.history["loss"],
            "sparsity_log": history.history.get("sparsity"),
            "sparsity": pruning.sparsity(model) if state is not None else None,
            "processes": process_count(), "seconds": time.monotonic() - started}
    name = f"{out}-{scenario}-rank{rank()}"
    np.savez(name + ".npz", *weights, **{f"mask{i}": m for i, m in enumerate(masks)})
    with open(name + ".json", "w") as f:
        json.dump(info, f)


def main(argv):
    """``OUT SCENARIO...`` (also torch_cases.py's entry)."""
    out, scenarios = argv[0], argv[1:]
    return run_scenarios(out, scenarios, lambda scenario: run(out, scenario))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
