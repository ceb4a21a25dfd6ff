"""Embedding models whose gradients are ``tf.IndexedSlices`` (one slice per lookup, repeated ids included), for
mw_custom_step.py's launch (issue 35 item 1): ``sparse_<optimizer>`` trains Embedding -> Dense under that optimizer
on an uneven last batch (2 epochs of 4 batches of 12 and one of 5 rows; 5 rows give the workers 2 and 3); Keras's
adaptive optimizers update slot variables slice by slice, so only the same slices in the same order as one process
train the same weights. AdamW clips by global_clipnorm, Adagrad by clipnorm (the norm of the slices, repeated ids
apart, as tf.clip_by_norm takes it); ``sparse_shared`` looks one Embedding up twice (two inputs), ``sparse_mixed``
trains under mixed_float16 (a LossScaleOptimizer). (gradient_accumulation_steps adds the slices into a dense
accumulator, in one process too: exact before and after, not repeated here.)"""

import json

import keras
import numpy as np

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.01, global_clipnorm=0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5, clipnorm=0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "shared": lambda: keras.optimizers.Adam(0.05),
    "mixed": lambda: keras.optimizers.Adam(0.05),
}
VARIANTS = tuple(f"sparse_{name}" for name in OPTIMIZERS)
VOCABULARY, LOOKUPS, ROWS, BATCH = 7, 6, 53, 12


def train(variant, distribute):
    name = variant[len("sparse_"):]
    keras.utils.set_random_seed(0)
    if name == "mixed":
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model(name == "shared")
        model.compile(optimizer=OPTIMIZERS[name](), loss="mse", metrics=["mae"], distribute=distribute)
        rng = np.random.default_rng(5)  # few ids, many lookups: every batch repeats ids within and across rows
        ids = rng.integers(0, VOCABULARY, (ROWS, LOOKUPS))
        x = [ids, rng.integers(0, VOCABULARY, (ROWS, 2))] if name == "shared" else ids
        y = rng.random((ROWS, 1)).astype("float32")
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    finally:
        keras.mixed_precision.set_global_policy("float32")
    w = np.concatenate([np.asarray(v.numpy(), "float64").ravel() for v in model.trainable_variables])
    print(f"RESULT {variant} " + json.dumps({"w": w.tolist(), **history}), flush=True)


def _model(shared):
    embedding = keras.layers.Embedding(VOCABULARY, 4)
    ids = keras.Input((LOOKUPS,), dtype="int32")
    features = keras.layers.Flatten()(embedding(ids))
    inputs = [ids]
    if shared:  # the same table looked up again: one process's slices are the first input's, then the second's
        more = keras.Input((2,), dtype="int32")
        inputs.append(more)
        features = keras.layers.Concatenate()([features, keras.layers.Flatten()(embedding(more))])
    outputs = keras.layers.Dense(1, dtype="float32")(features)
    return keras.Model(inputs if shared else ids, outputs)
