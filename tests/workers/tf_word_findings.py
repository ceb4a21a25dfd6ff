"""Jobs the differential fuzzer found (seeds 2000-2005, 4002), each trained with and without the word in one run.

    python tf_word_findings.py WORD[,WORD...]   (under the launcher the word needs: kerasdist launch, horovodrun)

- ``output-losses``: a loss per output, fit with validation and evaluate, every last batch split unevenly. Keras's
  per-output trackers (``out_loss``, ``aux_loss``) weigh each step of a dataset without a static batch size alike;
  each replica's or process's part of a step counted as a step (mirrored 0.077 off at ``val_aux_loss``,
  central_storage, multiworker and horovod 0.165 at ``val_out_loss``; weights exact). Compares history and evaluate.
- ``sparse-clip``: an Embedding over repeated ids, Adam with clipvalue (mirrored and central_storage clipped the
  replicas' summed gradient and handed each replica half of it; sparse slices are summed by concatenation, so each
  slice reached the optimizer twice at half its value, and Adam squares each slice: 0.178 off). Compares weights.
- ``sync-bn``: synchronized BatchNormalization, a last batch split 5 + 4 (horovod weighted each rank's gradient by
  its rows after the backward pass, through the statistics' all-reduce too: 1.7e-3 off). Compares weights.
- ``own-step``: keras.io's lower-level custom ``train_step`` (an ``ops.mean`` loss; 40 rows in batches of 6) under
  MultiWorkerMirroredStrategy's step (``KERASDIST_STRATEGY_FREE=off``): each worker's gradient of its own mean was
  summed, a step twice one process's (this job with SGD: 0.238 off; seeds 2000, 2003, 2004: 5.7e-3 off, NaN
  losses). Compares history and weights.
- ``muon``: Keras's Muon (its own weight decay writes the model's variables inside the replicas) under
  central_storage: a raw ``ValueError: You must specify an aggregation method to update a AggregatingVariable``.
- ``sparse-loss-scale``: the Embedding model under mixed_float16 with Adam, batches that split evenly: on
  MultiWorkerMirroredStrategy's step the LossScaleOptimizer's unscaling made the sparse gradient dense after the
  dense ones were summed, and it was never summed: each worker applied its own (seed 4002: 0.12 off).
  ``sparse-loss-scale-uneven``: the same on a last batch split 5 + 4, which that step refuses (a KerasdistError:
  any model under a LossScaleOptimizer on uneven shares there, 6.0e-3 off with Dense layers only).
- ``nadam``: Keras's Nadam (its step writes its ``_u_product`` inside the replicas, before the strategy's update)
  under central_storage: the same raw ValueError (seed 4002).

Prints ``CASE <case> <word> <worst relative difference> <where>``."""

import kerasdist  # noqa: I001  first: joins a multi-worker cluster before any framework op

import sys

import keras
import numpy as np
from keras import layers

rng = np.random.default_rng(2001)


def split(rows):
    return (rng.normal(size=(rows, 5)).astype("float32"),
            {"out": rng.integers(0, 4, size=(rows,)).astype("int32"), "aux": rng.normal(size=(rows, 1)).astype("float32")})


(x, y), (xv, yv), (xe, ye) = split(40), split(13), split(11)
sample_weight = rng.uniform(0.5, 1.5, size=(40,)).astype("float32")
ids, labels = rng.integers(0, 4, size=(45, 5)).astype("int32"), rng.integers(0, 4, size=(45,)).astype("int32")


def output_losses(distribute):
    a = keras.Input(shape=(5,))
    h = layers.Dense(4, activation="relu")(a)
    model = keras.Model(a, {"out": layers.Dense(4, name="out")(h), "aux": layers.Dense(1, name="aux")(h)})
    model.compile(optimizer=keras.optimizers.SGD(0.05), metrics={"out": ["accuracy"]}, distribute=distribute,
                  loss={"out": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "aux": "mse"})
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=6, epochs=2, shuffle=False,
                        validation_data=(xv, yv), validation_batch_size=6, verbose=0).history
    return dict(history, **{f"evaluate_{k}": [v] for k, v in
                            model.evaluate(xe, ye, batch_size=6, verbose=0, return_dict=True).items()})


def embedding_model(case, distribute):
    a = keras.Input(shape=(5,), dtype="int32")
    h = layers.GlobalAveragePooling1D()(layers.Embedding(4, 4)(a))
    h = layers.Dense(4, activation="tanh", use_bias=case != "sync-bn")(h)
    if case == "sync-bn":
        h = layers.BatchNormalization()(h)
    model = keras.Model(a, layers.Dense(4)(layers.Dense(4, activation="tanh")(h)))
    start = np.random.default_rng(2006)
    model.set_weights([w if any(k in v.path for k in ("gamma", "beta", "mean", "variance"))
                       else start.normal(0, 0.3, w.shape).astype("float32")
                       for v, w in zip(model.weights, model.get_weights())])
    optimizer = (keras.optimizers.Adam(0.05, clipvalue=0.5) if case == "sparse-clip" else
                 keras.optimizers.Adam(0.05) if case.startswith("sparse-loss-scale") else keras.optimizers.SGD(0.05))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distribute=distribute)
    rows = 36 if case == "sparse-loss-scale" else 45  # 36: even shares; 45: 12, 12, 12, 9 (5 + 4)
    model.fit(ids[:rows], labels[:rows], batch_size=12, epochs=2, shuffle=False, verbose=0)
    return {f"weights[{i}]": np.ravel(w) for i, w in enumerate(model.get_weights())}


class OwnStep(keras.Model):
    """keras.io's lower-level custom step: its own ``ops.mean`` loss and tracker."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        import tensorflow as tf

        features, target = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(target - self(features, training=True)))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


def own_step_or_optimizer(case, distribute):
    a = keras.Input(shape=(5,))
    h = layers.Dense(6, activation="tanh")(a)
    model = (OwnStep if case == "own-step" else keras.Model)(a, layers.Dense(1)(h))
    optimizer = {"muon": keras.optimizers.Muon(0.02), "nadam": keras.optimizers.Nadam(0.02)}.get(case)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss="mse", distribute=distribute)
    history = model.fit(x, y["aux"], batch_size=6, epochs=2, shuffle=False, verbose=0).history
    return dict(history, **{f"weights[{i}]": np.ravel(w) for i, w in enumerate(model.get_weights())})


def trained(case, distribute):
    keras.utils.set_random_seed(0)
    if case == "output-losses":
        return output_losses(distribute)
    keras.mixed_precision.set_global_policy("mixed_float16" if case.startswith("sparse-loss-scale") else "float32")
    try:
        return (own_step_or_optimizer if case in ("own-step", "muon", "nadam") else embedding_model)(case, distribute)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def worst_difference(got, want):
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max((float(np.max(np.abs(np.subtract(got[k], want[k])) / np.maximum(1.0, np.abs(want[k])))), k)
               for k in want)


CASES = ("output-losses", "sparse-clip", "sync-bn", "own-step", "muon", "nadam", "sparse-loss-scale",
         "sparse-loss-scale-uneven")
#: jobs of one step only: the loss scaling of MultiWorkerMirroredStrategy's step (mirrored's is the strategy's own)
ONLY_UNDER = {"sparse-loss-scale": ("multiworker", "horovod"), "sparse-loss-scale-uneven": ("multiworker", "horovod")}


def cases_of(word):
    return [case for case in CASES if word in ONLY_UNDER.get(case, (word,))]


words = sys.argv[1].split(",")
references = {case: trained(case, None) for case in CASES if any(case in cases_of(word) for word in words)}
for word in words:
    for case in cases_of(word):
        spec = kerasdist.spec(word, sync_batch_norm=True) if case == "sync-bn" else word
        try:
            worst, where = worst_difference(trained(case, spec), references[case])
        except kerasdist.KerasdistError as error:
            print(f"REFUSED {case} {word}: {error}", flush=True)
            worst, where = float("nan"), "refused"
        print(f"CASE {case} {word} {worst:.3g} {where}", flush=True)
