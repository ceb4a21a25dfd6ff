"""Every strategy word given, on the Keras this process imports (the keras-nightly check of ``make test``):
compile with the word, fit one epoch, evaluate, ``model.save`` + ``keras.models.load_model`` (kerasdist restores
the word), predict. The weights after the epoch must equal plain Keras's on the same global batches (SGD, same
seed). Prints ``WORD OK <word> <max weight difference>`` per word, then ``KERAS <version>``.

    python keras_words.py OUT_DIR EXPECTED_KERAS_VERSION word[,word...]

A word may carry options (``multiworker:sync_batch_norm=True``: ``kerasdist.spec(name, **options)``, values read
as Python literals); ``refused:<word>`` must be one KerasdistError naming the word, at compile. ``custom:<word>``
(torch): keras.io's lower-level custom ``train_step`` (tests/workers/torch_guides.py ``LowerLevel``: its own loss
and trackers) with a BatchNormalization, fit on 9 rows in batches of 4 (the last batch's one row leaves a rank's
share empty), its weights equal to plain Keras's; prints ``WORD OK custom:<word> <difference>``.
"""

import kerasdist  # noqa: I001  first: joins a multi-worker cluster before any TensorFlow op

import ast
import os
import sys

import keras
import numpy as np

out_dir, expected_version, words = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
if keras.__version__ != expected_version:
    sys.exit(f"this process imported Keras {keras.__version__} from {keras.__file__}, not {expected_version}")

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")


def trained(distribute):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], distribute=distribute)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model


def spec(word):
    name, _, options = word.partition(":")
    if not options:
        return name
    return kerasdist.spec(name, **{k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in options.split(";"))})


def custom_trained(distribute):
    from torch_guides import LowerLevel, _functional  # torch only: the step calls loss.backward()

    data = np.random.default_rng(1).random((9, 33)).astype("float32")
    model = _functional(LowerLevel, 0, bn=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05), distribute=distribute)
    model.fit(data[:, :32], data[:, 32:], batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def max_difference(got, want):
    return max(float(np.abs(a - b).max()) for a, b in zip(got, want))


expected = trained(None).get_weights()
for word in words:
    if word.startswith("custom:"):
        want = custom_trained(None)
        difference = max_difference(custom_trained(spec(word.split(":", 1)[1])), want)
        assert difference <= 1e-5, f"{word}: weights differ from one process by {difference}"
        print("WORD OK", word, f"{difference:.2g}", flush=True)
        continue
    if word.startswith("refused:"):
        try:
            trained(spec(word.split(":", 1)[1]))
        except kerasdist.KerasdistError as error:
            assert word.split(":")[1] in str(error), error
            print("WORD REFUSED", word, str(error)[:200], flush=True)
            continue
        raise AssertionError(f"{word}: compile and fit ran")
    model = trained(spec(word))
    difference = max_difference(model.get_weights(), expected)
    assert difference <= 1e-5, f"{word}: weights differ from one process by {difference}"
    loss, mae = model.evaluate(x, y, batch_size=16, verbose=0)
    assert np.isfinite(loss) and np.isfinite(mae), (word, loss, mae)
    path = os.path.join(out_dir, f"{word.replace(':', '-')}-{os.getpid()}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert kerasdist.strategy_of(loaded) is not None, f"{word}: load_model did not restore the word"
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0), model.predict(x, batch_size=16, verbose=0),
                               atol=1e-5, err_msg=word)
    print("WORD OK", word, f"{difference:.2g}", flush=True)
print("KERAS", keras.__version__, keras.backend.backend(), flush=True)
