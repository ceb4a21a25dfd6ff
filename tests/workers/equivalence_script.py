"""One training script for the equivalence matrix: only the ``distribute=`` word changes.

    python tests/workers/equivalence_script.py --out FILE.npz [--distribute WORD] [--options JSON]
        [--precision float32|mixed_float16|mixed_bfloat16] [--accumulation N]
        [--batchnorm none|local|sync] [--small-last-batch] [--examples N] [--batch B] [--epochs E]
        [--input KIND] [--validate] [--custom-step]

``--distribute`` defaults to ``$KERASDIST_EQUIVALENCE_DISTRIBUTE`` or "none" (plain Keras, no
``distribute=``). ``--batch`` is the global batch: the same number for every word. ``--options`` is
a JSON object of strategy options (``kerasdist.spec(word, **options)``). The chief (rank 0, or the
only process) writes FILE.npz: ``steps`` (steps in each epoch), ``w0, w1, ...`` (final weights,
float32) and, with ``--validate``, ``val_loss`` (each epoch's), and prints ``EQUIVALENCE steps=[...]``.
``--input KIND`` feeds the rows as one of tests/workers/equivalence_inputs.py's kinds; ``--custom-step`` trains
with the model's own ``train_step`` as keras.io's guide for the backend writes it (equivalence_steps.py).
``main(argv)`` may run many times in one process (tests/workers/torch_cases.py): each run starts from a cleared
session, the same seed and the float32 policy unless told otherwise.
"""

import kerasdist  # noqa: I001  first: joins a multi-worker cluster before any TensorFlow op

import argparse
import json
import os

import keras
import numpy as np

from equivalence_inputs import KINDS, fit_arguments
from equivalence_steps import custom_step_model

FEATURES, HIDDEN, CLASSES = 6, 8, 3


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--distribute", default=os.environ.get("KERASDIST_EQUIVALENCE_DISTRIBUTE", "none"))
    parser.add_argument("--options", default="{}", help="JSON object of strategy options (plain Keras: ignored)")
    parser.add_argument("--precision", default="float32",
                        choices=("float32", "mixed_float16", "mixed_bfloat16"))
    parser.add_argument("--accumulation", type=int, default=1, help="optimizer gradient_accumulation_steps")
    parser.add_argument("--batchnorm", default="none", choices=("none", "local", "sync"),
                        help="add a BatchNormalization layer (sync: synchronized=True)")
    parser.add_argument("--small-last-batch", action="store_true",
                        help="feed a tf.data.Dataset of --examples rounded to whole batches plus one "
                             "example: its last batch has 1 example, fewer than the replicas")
    parser.add_argument("--quantize", action="store_true", help="add kerasdist.quantize() (QAT) to the plan")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--input", default="numpy", choices=sorted(KINDS), help="how fit is given the rows")
    parser.add_argument("--validate", action="store_true", help="validation_data of the same kind (22 rows)")
    parser.add_argument("--custom-step", action="store_true", help="the model's own train_step (keras.io's guide)")
    parser.add_argument("--job-tag", default="", help="ignored: lets a test find this job's processes")
    return parser.parse_args(argv)


def data(examples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, FEATURES)).astype("float32")
    y = np.tanh(x[:, :CLASSES] * 1.5 + rng.normal(0.0, 0.1, size=(examples, CLASSES))).astype("float32")
    return x, y


def build_model(batchnorm, custom_step=False):
    layers = [keras.layers.Dense(HIDDEN, activation="tanh")]
    if batchnorm != "none":
        layers.append(keras.layers.BatchNormalization(synchronized=batchnorm == "sync"))
    layers.append(keras.layers.Dense(CLASSES))
    if custom_step:  # as the guides build theirs: functional, the subclass holding train_step
        inputs = outputs = keras.Input((FEATURES,))
        for layer in layers:
            outputs = layer(outputs)
        model = custom_step_model(keras.backend.backend())(inputs, outputs)
    else:
        model = keras.Sequential([keras.Input((FEATURES,)), *layers])
    rng = np.random.default_rng(1)  # the same start everywhere, independent of Keras's seeding
    model.set_weights([rng.normal(0.0, 0.5, size=w.shape).astype(w.dtype) if "gamma" not in w.path
                       and "variance" not in w.path else np.ones(w.shape, w.dtype) for w in model.weights])
    return model


class CountSteps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


def main(argv=None):
    args = parse(argv)
    keras.backend.clear_session()
    keras.utils.set_random_seed(7)
    keras.mixed_precision.set_global_policy(args.precision)
    examples = args.examples // args.batch * args.batch + 1 if args.small_last_batch else args.examples
    x, y = data(examples)
    model = build_model(args.batchnorm, args.custom_step)
    word = None if args.distribute == "none" else args.distribute
    options = json.loads(args.options)
    distribute = kerasdist.spec(word, **options) if word and options else word
    if args.quantize:
        distribute = ([distribute] if distribute else []) + [kerasdist.quantize()]
    optimizer = keras.optimizers.SGD(args.lr, gradient_accumulation_steps=args.accumulation
                                     if args.accumulation > 1 else None)
    model.compile(optimizer=optimizer, loss="mse", distribute=distribute)
    counter = CountSteps()
    if args.small_last_batch:
        import tensorflow as tf

        fit_data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch))
    else:
        xv, yv = data(22, seed=2) if args.validate else (None, None)
        fit_data = fit_arguments(args.input, x, y, xv, yv, args.batch)
    history = model.fit(**fit_data, epochs=args.epochs, verbose=0, callbacks=[counter])
    keras.mixed_precision.set_global_policy("float32")
    cluster = kerasdist.detect_cluster()
    weights = {f"w{i}": np.asarray(w, dtype="float32") for i, w in enumerate(model.get_weights())}
    if cluster.is_local or cluster.is_chief:
        validation = {"val_loss": np.array(history.history["val_loss"])} if "val_loss" in history.history else {}
        np.savez(args.out, steps=np.array(counter.steps), **validation, **weights)
        print(f"EQUIVALENCE steps={counter.steps}", flush=True)
        if keras.backend.backend() == "tensorflow":  # multiworker: 1 strategy-free, 2 under MultiWorkerMirroredStrategy
            print(f"REPLICAS {model.distribute_strategy.num_replicas_in_sync}", flush=True)
    elif args.quantize:  # every worker's weights and int8 ranges, to compare the replicas
        np.savez(args.out.replace(".npz", f"-task{cluster.task_index}.npz"), steps=np.array(counter.steps), **weights)


if __name__ == "__main__":
    main()
