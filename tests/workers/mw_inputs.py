"""Inputs and losses the strategy-free multiworker step must split and combine like one process on the global batch.

    python mw_inputs.py CASE[,CASE...] multiworker|none

Cases: ``py_dataset`` (a keras.utils.PyDataset of global batches, one as validation_data too; ``py_dataset_shuffled``:
fit shuffles their order), ``generator`` (a generator of global batches, an endless one as validation_data),
``sparse_dataset`` (a tf.data.Dataset of SparseTensor inputs; validation_data a scipy sparse matrix), ``sum_loss`` (MeanSquaredError(reduction="sum")), ``empty_share`` (BatchNormalization, and a last batch of 1 row:
one worker's share is empty), ``shuffled_dataset`` (``ds.shuffle(n, seed)``, reshuffled each epoch; also counts the
elements its pipeline made), ``py_dataset_threaded`` (PyDataset(workers=4)), ``arrays_shuffled`` (numpy, fit's
shuffle=True), ``transfer`` (keras.io's transfer learning flow: frozen base, compile, fit, unfreeze, compile, fit),
``added_losses`` (a kernel regularizer, and add_loss of a mean over rows and of a keras.losses.Loss),
``data_loader`` (torch DataLoaders: x with shuffle=True and one loader worker process, one process seeding its
sampler as multiworker does from shuffle_seed 1337; validation_data in order), ``tensors`` (x a torch tensor, y a
tf.Tensor, sample_weight a JAX array, validation_split, shuffle), ``dict_inputs`` (a dict of a tf.Tensor and an
array, class_weight, validation_data a list [dict, y]), ``jit_compile`` (compile with jit_compile=True: refused on CPU
workers), ``diverged`` (rank 1 leaves a fit for the next model: the last case). Every model but transfer's logs ``rows`` (summed over the
workers: twice one process's count where every worker trained every row). Each trained in turn in this process. Prints RESULT <case> {"w": all weights, and the history}.
"""
import kerasdist  # noqa: F401, I001  first: joins a multi-worker cluster before any TensorFlow op

import itertools
import json
import os
import sys

import keras
import numpy as np

cases, word = sys.argv[1].split(","), sys.argv[2]
if os.environ.get("TEST_STRATEGY_FREE_BY_WORKER"):  # a bad set-up: each worker its own KERASDIST_STRATEGY_FREE
    os.environ["KERASDIST_STRATEGY_FREE"] = \
        os.environ["TEST_STRATEGY_FREE_BY_WORKER"].split(",")[kerasdist.detect_cluster().task_index]
BATCH, STEPS = 16, 4


class AddedLosses(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(keras.ops.square(x)) * 0.1)
        self.add_loss(keras.losses.MeanSquaredError()(keras.ops.zeros_like(x), x))
        return x


def train(case):
    if case == "transfer":
        return transfer()
    if case == "diverged":
        return diverged()
    if case == "jit_compile":
        return jit_compile()
    if case in INPUT_KINDS:
        return other_kinds(case)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(3)
    x = rng.random((65 if case == "empty_share" else 64, 5)).astype("float32")
    y = rng.random((len(x), 1)).astype("float32")

    class Batches(keras.utils.PyDataset):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)

        def __len__(self):
            return STEPS

        def __getitem__(self, index):
            return x[index * BATCH:(index + 1) * BATCH], y[index * BATCH:(index + 1) * BATCH]

    if case == "sparse_dataset":
        x = np.where(x > 0.6, x, 0.0).astype("float32")
    layers = [keras.Input((5,), sparse=case == "sparse_dataset"), keras.layers.Dense(4, activation="tanh")]
    if case == "empty_share":
        layers.append(keras.layers.BatchNormalization())
    if case == "added_losses":  # docs/equivalence.md "add_loss": means and row-independent losses are exact
        layers[1] = keras.layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05))
        layers.append(AddedLosses())
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    loss = keras.losses.MeanSquaredError(reduction="sum") if case == "sum_loss" else "mse"
    model.compile(optimizer=keras.optimizers.SGD(0.01 if case == "sum_loss" else 0.1), loss=loss,
                  metrics=["mae", Rows()], distribute=None if word == "none" else word)
    made = {}
    if case == "py_dataset_threaded":  # its enqueuer's threads: an extra iterator left batches queued (rotated)
        history = model.fit(Batches(workers=4, use_multiprocessing=False), epochs=3, verbose=0, shuffle=False)
    elif case.startswith("py_dataset"):  # Keras shuffles a PyDataset's batch order: the same order everywhere
        validation = Batches() if case == "py_dataset" else None  # before: unpacked as (x, y, sample_weight)
        history = model.fit(Batches(), epochs=2, verbose=0, shuffle=case == "py_dataset_shuffled",
                            validation_data=validation)
    elif case == "shuffled_dataset":  # each iterator reshuffles: an extra one before epoch 1 shifts every epoch
        import tensorflow as tf

        counter = tf.Variable(0, dtype=tf.int64)
        batches = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=5).map(
            lambda a, b: (a + tf.cast(counter.assign_add(1) * 0, a.dtype), b)).batch(BATCH)
        history = model.fit(batches, epochs=3, verbose=0)
        made = {"elements_made": [int(counter.numpy())]}  # one process: 3 epochs x 64
    elif case.startswith("arrays_shuffled"):  # every worker draws one process's permutation and takes its share
        if case == "arrays_shuffled_rank_seeds" and word != "none":  # TF seeds differ (3.16: epoch-keyed order)
            keras.utils.set_random_seed(100 + kerasdist.detect_cluster().task_index)
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=True, verbose=0)
    elif case == "generator":
        def batches(passes):
            for _ in passes:
                yield from (Batches()[i] for i in range(STEPS))

        history = model.fit(batches(range(2)), steps_per_epoch=STEPS, epochs=2, verbose=0,
                            validation_data=batches(itertools.count()), validation_steps=2)  # endless
    elif case == "sparse_dataset":  # rows of SparseTensors are cut with tf.sparse.slice
        import tensorflow as tf

        import scipy.sparse

        batches = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(x), y)).batch(BATCH)
        history = model.fit(batches, epochs=2, verbose=0, validation_data=(scipy.sparse.csr_matrix(x[40:]), y[40:]))
    else:
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    w = np.concatenate([np.ravel(v) for v in model.get_weights()])
    print(f"RESULT {case} " + json.dumps({"w": w.tolist(), **history.history, **made}), flush=True)


INPUT_KINDS = ("data_loader", "tensors", "dict_inputs")


class Rows(keras.metrics.Metric):
    """The rows the step saw (summed over the workers: one process's count only when each took its share)."""

    def __init__(self, name="rows", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.cast(keras.ops.shape(y_pred)[0], "float32"))

    def result(self):
        return self.total


def other_kinds(case):
    """Issue 29 items 2-4: inputs Keras takes that multiworker once left unsplit (every worker trained all rows: the
    ``rows`` metric counted them twice; a shuffling DataLoader in each worker's own order)."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(5)
    x, y = rng.random((80, 5)).astype("float32"), rng.random((80, 1)).astype("float32")
    x_val, y_val, x, y = x[64:], y[64:], x[:64], y[:64]
    if case == "dict_inputs":
        inputs = {"a": keras.Input((2,), name="a"), "b": keras.Input((3,), name="b")}
        hidden = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([inputs["a"], inputs["b"]]))
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    else:
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae", Rows()],
                  distribute=None if word == "none" else word)
    fit = dict(epochs=2, verbose=0, shuffle=False)
    if case == "data_loader":
        import torch

        def loader(a, b, shuffle=False, workers=0):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(a), torch.tensor(b)),
                                               batch_size=BATCH, shuffle=shuffle, num_workers=workers)

        torch.manual_seed(0)  # issue 35 item 10: one process's order (before: each worker seeded kerasdist's own)
        train = loader(x, y, shuffle=True, workers=1)
        history = model.fit(train, validation_data=loader(x_val, y_val), **fit)
    elif case == "tensors":
        import jax.numpy as jnp
        import torch

        history = model.fit(torch.tensor(x), tf.constant(y), sample_weight=jnp.asarray(np.linspace(0.5, 1.5, 64)),
                            batch_size=BATCH, validation_split=0.25, epochs=2, verbose=0, shuffle=True)
    else:
        x_dict = {"a": tf.constant(x[:, :2]), "b": x[:, 2:]}
        history = model.fit(x_dict, (y > 0.5).astype("float32"), batch_size=BATCH, class_weight={0: 1.0, 1: 3.0},
                            validation_data=[{"a": x_val[:, :2], "b": tf.constant(x_val[:, 2:])}, y_val], **fit)
    w = np.concatenate([np.ravel(v) for v in model.get_weights()])
    print(f"RESULT {case} " + json.dumps({"w": w.tolist(), **history.history}), flush=True)


def transfer():
    """keras.io "Transfer learning & fine-tuning", end to end: a base frozen at the first compile, trained in the
    second after ``base.trainable = True``."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(4)
    x, y = rng.random((64, 5)).astype("float32"), rng.random((64, 1)).astype("float32")
    base = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh")], name="base")
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(1)(base(inputs, training=False)))
    histories = {}
    for phase, trainable in (("frozen", False), ("unfrozen", True)):
        base.trainable = trainable
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute=None if word == "none" else word)
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        histories.update({f"{phase}_{key}": value for key, value in history.history.items()})
        histories[f"{phase}_base"] = np.concatenate([np.ravel(v) for v in base.get_weights()]).tolist()
    w = np.concatenate([np.ravel(v) for v in model.get_weights()])
    print("RESULT transfer " + json.dumps({"w": w.tolist(), **histories}), flush=True)


def jit_compile():
    """Neither multiworker step can run XLA across CPU workers: compile refuses in every worker, before any step."""
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    try:
        model.compile(optimizer="sgd", loss="mse", jit_compile=True, distribute=None if word == "none" else word)
        error = ""
    except kerasdist.KerasdistError as exc:
        error = f"{type(exc).__name__}: {exc}"
    print("RESULT jit_compile " + json.dumps({"error": error}), flush=True)


def diverged():
    """Issue 35 item 2, as KerasTuner does it: a trial's fit fails on rank 1 only (its checkpoint write), which goes
    on to the next trial's model, of the same shapes, while rank 0 still trains the first (before: their steps
    paired, the two models' gradients averaged, then a hang). Every rank raises one error naming both sides."""
    rank = kerasdist.detect_cluster().task_index if word != "none" else 0
    rng = np.random.default_rng(6)
    x, y = rng.random((64, 5)).astype("float32"), rng.random((64, 1)).astype("float32")

    class FailsOnRankOne(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if rank == 1:
                raise OSError("unable to lock file (simulated)")

    errors = []
    for trial in (1, 2):
        keras.utils.set_random_seed(trial)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)], name=f"trial_{trial}")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute=None if word == "none" else word)
        try:
            model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[FailsOnRankOne()])
        except OSError as exc:  # KerasTuner marks the trial failed and goes on
            errors.append(f"{type(exc).__name__}: {exc}")
        except kerasdist.KerasdistError as exc:  # the ranks are out of step for good: the last case
            errors.append(f"{type(exc).__name__}: {exc}")
            break
    print("RESULT diverged " + json.dumps({"errors": errors}), flush=True)


for case in cases:  # several models in one process, one after the other
    train(case)
