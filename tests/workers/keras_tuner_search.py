"""KerasTuner's getting-started RandomSearch (two trials of a small model, val_loss, its best model back) under a
word, or in one plain process: ``keras_tuner_search.py WORD DIR`` (WORD: none or a distribute= word).

Prints one line (each rank's, under a launcher): ``RESULT {"trials": {id: [units, lr, score, status]}, "best": [weights...],
"evaluate": loss}``. Every trial's SaveBestEpoch checkpoint and the oracle's files go to DIR/kt."""

import json
import sys

import kerasdist  # noqa: F401  first: joins the cluster
import keras
import keras_tuner
import numpy as np


def build_model(hp, word):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(hp.Int("units", 8, 32, step=8), activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(hp.Choice("lr", [1e-2, 1e-3])), loss="mse",
                  distribute=None if word == "none" else word)
    return model


def main(word, folder):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(1)
    tuner = keras_tuner.RandomSearch(lambda hp: build_model(hp, word), objective="val_loss", max_trials=2, seed=1,
                                     directory=folder, project_name="kt", max_consecutive_failed_trials=1)
    tuner.search(x[:192], y[:192], epochs=2, batch_size=32, validation_data=(x[192:], y[192:]), verbose=0)
    trials = {t.trial_id: [t.hyperparameters.values["units"], t.hyperparameters.values["lr"], t.score, t.status]
              for t in tuner.oracle.trials.values()}
    (best,) = tuner.get_best_models(1)
    result = {"trials": trials, "best": [float(np.sum(np.abs(w))) for w in best.get_weights()],
              "evaluate": float(best.evaluate(x[192:], y[192:], verbose=0))}
    print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
