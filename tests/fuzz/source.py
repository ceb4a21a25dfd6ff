"""``script(job, word)``: a job as one standalone Python script (plain Keras + ``import kerasdist`` + the word). The
fuzzer runs this very text (``train(distribute)`` from it, by exec), so a defect's script is what was run.

The script defines ``make_data()``, ``make_model()``, ``train(distribute)`` (returns weights, history, evaluate and
predict) and, run as ``python script.py [WORD]``, trains once without and once with the word and prints the worst
difference.
"""

import inspect
import json

from .compare import FLOOR_JIT_COMPILE, worst_difference
from .source_model import SET_START_WEIGHTS, custom_step_source, input_shape, model_source, output_units

LOSSES = {"mse": '"mse"', "mae": '"mae"', "huber": "keras.losses.Huber()",
          "sparse_categorical_crossentropy": "keras.losses.SparseCategoricalCrossentropy(from_logits=True)",
          "binary_crossentropy": "keras.losses.BinaryCrossentropy(from_logits=True)"}
METRICS = {"regression": '["mae"]', "sparse": '["accuracy"]', "binary": '["accuracy"]'}
#: words whose BatchNormalization is per replica unless asked (kerasdist.spec(word, sync_batch_norm=True))
SYNC_BN_WORDS = ("mirrored", "central_storage", "multiworker", "horovod", "data_parallel")


def word_source(word, job):
    """The ``distribute=`` value for ``word`` in ``job``'s script: a BatchNormalization asks for synchronized
    statistics where the word has the option (one process normalises over the global batch)."""
    if word is None:
        return "None"
    if job["model"]["norm"] == "batch" and word in SYNC_BN_WORDS:
        return f"kerasdist.spec({word!r}, sync_batch_norm=True)"
    return repr(word)


def data_source(job):
    data, loss = job["data"], job["loss"]
    shape, ids = input_shape(job)
    vocab = job["model"]["vocab"]
    row = (lambda n: f"rng.integers(0, {vocab}, size=({n}, *{shape!r})).astype(\"int32\")") if ids else \
        (lambda n: f"rng.normal(size=({n}, *{shape!r})).astype(\"float32\")")
    units = output_units(job)
    target = {"regression": lambda n: f'rng.normal(size=({n}, {units})).astype("float32")',
              "sparse": lambda n: f'rng.integers(0, {units}, size=({n},)).astype("int32")',
              "binary": lambda n: f'rng.integers(0, 2, size=({n}, 1)).astype("float32")'}[data["task"]]

    def part(n):
        x = row(n) if not data["second_input"] else \
            f'{{"a": {row(n)}, "b": rng.normal(size=({n}, 3)).astype("float32")}}'
        y = target(n) if not data["aux_output"] else \
            f'{{"out": {target(n)}, "aux": rng.normal(size=({n}, 1)).astype("float32")}}'
        return x, y

    rows, val_rows, eval_rows = data["rows"], max(4, data["rows"] // 3), data["eval_rows"]
    (x, y), (xv, yv), (xe, ye) = part(rows), part(val_rows), part(eval_rows)
    weights = f'rng.uniform(0.5, 1.5, size=({rows},)).astype("float32")' if loss["sample_weight"] else "None"
    return (f"def make_data():\n    rng = np.random.default_rng({job['seed']})\n"
            f"    x, y = {x}, {y}\n    sw = {weights}\n    xv, yv = {xv}, {yv}\n    xe, ye = {xe}, {ye}\n"
            "    return x, y, sw, xv, yv, xe, ye\n")


INPUT_HELPERS = '''def take(t, s):
    return {k: v[s] for k, v in t.items()} if isinstance(t, dict) else t[s]


def batches(x, y, sw, batch):
    n = len(next(iter(x.values()))) if isinstance(x, dict) else len(x)
    for i in range(0, n, batch):
        s = slice(i, i + batch)
        yield (take(x, s), take(y, s)) if sw is None else (take(x, s), take(y, s), sw[s])
'''

PY_DATASET = '''class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, sw, batch):
        super().__init__()
        self.parts = list(batches(x, y, sw, batch))

    def __len__(self):
        return len(self.parts)

    def __getitem__(self, index):
        return self.parts[index]
'''

GENERATOR = '''def endless(x, y, sw, batch):
    while True:
        yield from batches(x, y, sw, batch)
'''


def fit_source(job):
    """``def fit_arguments(x, y, sw, xv, yv):`` returning fit's input keywords for the job's input kind."""
    data, fit, loss = job["data"], job["fit"], job["loss"]
    batch, rows, kind = data["batch"], data["rows"], fit["input"]
    steps = -(-rows // batch)
    val_steps = -(-max(4, rows // 3) // batch)
    lines = []
    if kind == "numpy":
        lines.append(f"args = dict(x=x, y=y, batch_size={batch}, shuffle={fit['shuffle']})")
        lines.append("if sw is not None:\n        args['sample_weight'] = sw")
        validation = "(xv, yv)"
    elif kind == "tf_data":
        lines.append("ds = tf.data.Dataset.from_tensor_slices((x, y) if sw is None else (x, y, sw))")
        if fit["shuffle"]:
            lines.append(f"ds = ds.shuffle({rows}, seed={job['seed']}, reshuffle_each_iteration=True)")
        lines.append(f"args = dict(x=ds.batch({batch}))")
        validation = f"tf.data.Dataset.from_tensor_slices((xv, yv)).batch({batch})"
    elif kind == "py_dataset":
        lines.append(f"args = dict(x=Batches(x, y, sw, {batch}), shuffle={fit['shuffle']})")
        validation = f"Batches(xv, yv, None, {batch})"
    elif kind == "generator":
        lines.append(f"args = dict(x=endless(x, y, sw, {batch}), steps_per_epoch={steps})")
        validation = f"endless(xv, yv, None, {batch})"
        if fit["validation"]:
            lines.append(f"args['validation_steps'] = {val_steps}")
    else:  # dataloader
        lines.append("tensors = [torch.from_numpy(x), torch.from_numpy(y)] + ([] if sw is None else "
                     "[torch.from_numpy(sw)])")
        lines.append(f"args = dict(x=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*tensors), "
                     f"batch_size={batch}, shuffle={fit['shuffle']}, "
                     f"generator=torch.Generator().manual_seed({job['seed']})))")
        validation = ("torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(xv), "
                      f"torch.from_numpy(yv)), batch_size={batch})")
    if fit["validation"] == "split":
        lines.append("args['validation_split'] = 0.25")
    elif fit["validation"] == "data":
        lines.append(f"args['validation_data'] = {validation}")
    if fit["steps_per_epoch"]:
        lines.append(f"args['steps_per_epoch'] = {max(1, steps - 1)}")
    if loss["class_weight"]:
        classes = output_units(job) if data["task"] == "sparse" else 2
        lines.append(f"args['class_weight'] = {({i: 0.5 + 0.5 * i for i in range(classes)})!r}")
    return "def fit_arguments(x, y, sw, xv, yv):\n" + "".join(f"    {line}\n" for line in lines) + "    return args\n"


def optimizer_source(job):
    opt = job["optimizer"]
    options = "".join(f", {k}={v!r}" for k, v in sorted(opt["options"].items()))
    text = f"keras.optimizers.{opt['name']}(learning_rate={opt['learning_rate']!r}{options})"
    return f"keras.optimizers.LossScaleOptimizer({text})" if opt["loss_scale"] else text


def callbacks_source(job):
    made = []
    for c in job["callbacks"]:
        if c["name"] == "EarlyStopping":
            made.append(f'keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta={c["min_delta"]!r}, '
                        f'restore_best_weights={c["restore_best_weights"]})')
        elif c["name"] == "ReduceLROnPlateau":
            made.append(f'keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, '
                        f'min_delta={c["min_delta"]!r})')
        else:
            made.append('keras.callbacks.ModelCheckpoint(os.path.join(tempfile.mkdtemp(), "best.weights.h5"), '
                        f'monitor="loss", save_weights_only=True, save_best_only={c["save_best_only"]})')
    return "[" + ", ".join(made) + "]"


def compile_source(job):
    data, loss = job["data"], job["loss"]
    if job["step"]["custom"]:
        return "model.compile(optimizer=optimizer, jit_compile=jit_compile, distribute=distribute)"
    main = LOSSES[loss["name"]]
    metrics = METRICS[data["task"]]
    if data["aux_output"]:
        return (f'model.compile(optimizer=optimizer, loss={{"out": {main}, "aux": "mse"}}, '
                f'metrics={{"out": {metrics}}}, jit_compile=jit_compile, distribute=distribute)')
    return (f"model.compile(optimizer=optimizer, loss={main}, metrics={metrics}, jit_compile=jit_compile, "
            "distribute=distribute)")


TRAIN = '''def train(distribute, jit_compile="auto"):
    """Weights, history, evaluate and predict of the job trained with ``distribute=`` (None: plain Keras)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed({seed})
    keras.mixed_precision.set_global_policy({policy!r})
    try:
        x, y, sw, xv, yv, xe, ye = make_data()
        model = make_model()
        optimizer = {optimizer}
        {compile}
        history = model.fit(**fit_arguments(x, y, sw, xv, yv), epochs={epochs}, initial_epoch={initial},
                            callbacks={callbacks}, verbose=0)
        evaluate = model.evaluate(xe, ye, batch_size={batch}, verbose=0, return_dict=True)
        try:
            predict = model.predict(xe, batch_size={batch}, verbose=0)
        except kerasdist.KerasdistError as error:  # a documented refusal (JAX processes): fit and evaluate still count
            predict = f"refused: {{error}}"
        return dict(weights=[np.asarray(w, dtype="float64") for w in model.get_weights()],
                    history=history.history, evaluate=evaluate, predict=predict)
    finally:
        keras.mixed_precision.set_global_policy("float32")
'''

FOOTER = '''

if __name__ == "__main__":
    word = sys.argv[1] if len(sys.argv) > 1 else {default_word!r}
    distribute = kerasdist.spec(word, sync_batch_norm=True) if {sync_bn} and word in {sync_words!r} else word
    reference = train(None)
    worst, where = worst_difference(train(distribute), reference)
    print(f"{{word}}: worst difference from one process {{worst:.3g}} at {{where}} (tolerance {tolerance:g})",
          flush=True)
    if {floor_jit!r} is not None:  # a 16-bit job: one process's own rounding with other kernels (compare.py)
        floor, at = worst_difference(train(None, jit_compile={floor_jit!r}), reference)
        print(f"one process with jit_compile={floor_jit!r}: {{floor:.3g}} at {{at}} from its default kernels", flush=True)
'''


def script(job, word=None, tolerance=1e-5, launcher=""):
    """The standalone script of ``job``; ``word`` is the default word of its ``__main__``."""
    fit = job["fit"]
    imports = ["import os", "import sys", "import tempfile", "", "import keras", "import numpy as np",
               "from keras import layers, ops"]
    if fit["input"] == "tf_data" or (job["step"]["custom"] and job["backend"] == "tensorflow"):
        imports.append("import tensorflow as tf")
    if fit["input"] == "dataloader" or (job["step"]["custom"] and job["backend"] == "torch"):
        imports.append("import torch")
    if job["step"]["custom"] and job["backend"] == "jax":
        imports.append("import jax")
    header = (f'"""kerasdist fuzz job: seed {job["seed"]} on {job["backend"]} (tests/fuzz, docs/fuzzing.md).\n\n'
              f"    KERAS_BACKEND={job['backend']} {launcher}python THIS_FILE {word or 'WORD'}\n\n"
              "trains the job once in plain Keras and once with the word, and prints the worst difference.\n\n"
              "The job: " + json.dumps(job, sort_keys=True) + '\n"""\n\n')
    helpers = INPUT_HELPERS + "\n\n" + {"py_dataset": PY_DATASET, "generator": GENERATOR}.get(fit["input"], "")
    train = TRAIN.format(seed=job["seed"], policy=job["policy"], optimizer=optimizer_source(job),
                         compile=compile_source(job), epochs=fit["initial_epoch"] + fit["epochs"],
                         initial=fit["initial_epoch"], callbacks=callbacks_source(job), batch=job["data"]["batch"])
    footer = FOOTER.format(sync_bn=job["model"]["norm"] == "batch", sync_words=SYNC_BN_WORDS,
                           default_word=word, tolerance=tolerance,
                           floor_jit=None if job["policy"] == "float32" else FLOOR_JIT_COMPILE.get(job["backend"]))
    parts = ["import kerasdist  # noqa: I001  first: joins a multi-worker cluster before any framework op\n\n" +
             "\n".join(imports) + "\n", data_source(job), SET_START_WEIGHTS, custom_step_source(job),
             model_source(job), helpers, fit_source(job), train, inspect.getsource(worst_difference)]
    return header + "\n\n".join(p.rstrip("\n") + "\n" for p in parts if p.strip()) + footer
