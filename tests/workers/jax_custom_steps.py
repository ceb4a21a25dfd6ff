"""keras.io's "Customizing what happens in fit() with JAX" models and other user patterns under
``data_parallel`` on JAX, each against the same script in plain Keras in this same process (no
distribution: one device): ``jax_custom_steps.py OUT_JSON``. Run as one process of N host devices, or under
``kerasdist launch -n 2``; every process writes ``OUT_JSON.<process index>``.

Per case: max |dw| vs plain (SGD), the fit history, evaluate's result, and the error if one was raised."""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import kerasdist  # noqa: E402
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

ROWS, BATCH = 239, 32  # the last batch (15 rows) does not split over 2 or 4 devices
rng = np.random.default_rng(0)
X = rng.normal(size=(ROWS, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1))).astype("float32")
LABELS = (Y > 0).astype("float32")


class FirstGuideModel(keras.Model):
    """The guide's first example: compute_loss, every metric in self.metrics."""

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)


class LowerLevelGuideModel(FirstGuideModel):
    """The guide's "lower-level" example: trackers made in __init__, its own loss, no compiled loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=training)
        return self.loss_fn(y, y_pred), (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        loss_tracker_vars = metrics_variables[:len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(loss_tracker_vars, loss)
        mae_metric_vars = self.mae_metric.stateless_update_state(mae_metric_vars, y, y_pred)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars)}
        new_metrics_vars = loss_tracker_vars + mae_metric_vars
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class TestStepGuideModel(FirstGuideModel):
    """The guide's test_step example (its logs: a dict of every metric here, the guide keeps the last)."""

    def test_step(self, state, data):
        x, y = data
        trainable_variables, non_trainable_variables, metrics_variables = state
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x,
                                                              training=False)
        loss = self.compute_loss(x, y, y_pred)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)


def functional(cls, activation=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(1, activation=activation)(hidden))


def arrays(y=Y, batch_size=BATCH, rows=ROWS):
    return {"x": X[:rows], "y": y[:rows], "batch_size": batch_size}


def dataset(y=Y, seed=None, batch_size=BATCH):
    ds = tf.data.Dataset.from_tensor_slices((X, y))
    if seed is not None:  # seeded: every process yields the same global batches
        ds = ds.shuffle(ROWS, seed=seed)
    return ds.batch(batch_size)


def plain_model(activation=None):
    return functional(keras.Model, activation)


class AddedLosses(keras.layers.Layer):
    """add_loss of a mean over rows, of a keras.losses.Loss and of a sum over rows (docs/equivalence.md)."""

    def call(self, x):
        self.add_loss(keras.ops.mean(keras.ops.square(x)) * 0.1)
        self.add_loss(keras.losses.MeanSquaredError()(keras.ops.zeros_like(x), x))
        self.add_loss(keras.ops.sum(x) * 0.01)
        return x


def unbuilt_model():
    """TensorFlow's "Load and preprocess images" shape: a Sequential with no Input, built by the first fit."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


def added_losses_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05))(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(AddedLosses()(hidden)))


def frozen_base_model():
    """keras.io's transfer-learning shape: a base (with BatchNormalization) frozen, called with training=False."""
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.BatchNormalization()], name="base")
    base.trainable = False
    inputs = keras.Input((8,))
    hidden = keras.layers.Dropout(0.2)(base(inputs, training=False))
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))


def named_model():
    """Layers with their own names (a LayoutMap's rules match the variable paths)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))


def gemma_like_model_parallel():
    """The user's own ModelParallel as the Gemma distributed-tuning guide builds it (GemmaBackbone.get_layout_map):
    a LayoutMap of regex keys sharding weights over the model and the batch axes, the batch on "batch"."""
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, len(devices) // 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*hidden.*kernel"] = ("model", "batch")
    layout_map[r".*hidden.*bias"] = ("batch",)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def weather_callbacks(folder, resumed=False):
    """keras.io's weather example's callbacks and the other built-in writers and state changers."""
    return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True),
            keras.callbacks.ModelCheckpoint(os.path.join(folder, "best-{epoch}.weights.h5"), monitor="val_loss",
                                            save_best_only=True, save_weights_only=True),
            keras.callbacks.ModelCheckpoint(os.path.join(folder, "model.keras")),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
            keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"), delete_checkpoint=False),
            keras.callbacks.TensorBoard(os.path.join(folder, "logs")),
            keras.callbacks.CSVLogger(os.path.join(folder, "history.csv"), append=resumed)]


CASES = {  # name: model, compile, fit and evaluate arguments (evaluate None: not evaluated)
    # the first two guide models cannot evaluate (Keras's test_step calls their compute_loss_and_updates)
    "first_guide": dict(model=lambda: functional(FirstGuideModel), compile=dict(loss="mse", metrics=["mae"]),
                        fit=arrays, evaluate=None),
    "lower_level_guide": dict(model=lambda: functional(LowerLevelGuideModel), compile={},
                              fit=lambda: {"x": dataset()}, evaluate=None),
    "test_step_guide": dict(model=lambda: functional(TestStepGuideModel), compile=dict(loss="mae", metrics=["mae"]),
                            fit=lambda: {"x": dataset()}, evaluate=lambda: {"x": dataset()}),
    # keras.io's transfer-learning compile; a shuffled tf.data; the weather example's one batch of 239 rows
    "compiled_user_metric": dict(
        model=lambda: plain_model("sigmoid"),
        compile=dict(loss="binary_crossentropy", metrics=[keras.metrics.BinaryAccuracy(name="acc")]),
        fit=lambda: {"x": dataset(LABELS, seed=7), "validation_data": dataset(LABELS, batch_size=256)},
        evaluate=lambda: arrays(LABELS, rows=224), predict=True),  # even batches: evaluate alone over processes
    # freeze, compile, fit, unfreeze, compile again, fit: the base moves in phase 2 as on one device
    "transfer_learning": dict(
        model=frozen_base_model, unfreeze="base",
        compile=dict(loss="binary_crossentropy", metrics=[keras.metrics.BinaryAccuracy(name="acc")]),
        fit=lambda: arrays(LABELS), evaluate=None),
    # not built at compile: its variables are made, replicated, when fit builds it (as under set_distribution)
    "unbuilt_sequential": dict(model=unbuilt_model, compile=dict(loss="mse"), fit=arrays,
                               evaluate=lambda: arrays(rows=224)),
    # a regularizer and add_loss of a mean, a Loss and a sum: one program over the global batch, all exact
    "added_losses": dict(model=added_losses_model, compile=dict(loss="mse"), fit=arrays, evaluate=None),
    # the batch not split (a batch axis of 1): over two processes both feed every row
    "model_parallel_guide": dict(model=lambda: functional(FirstGuideModel), compile=dict(loss="mse", metrics=["mae"]),
                                 fit=arrays, evaluate=None,
                                 distribute=lambda: kerasdist.hybrid(mesh={"model": jax.device_count()}, min_shard_size=0)),
    # NumPy's random state differs per process (no set_random_seed): every process draws process 0's permutation
    "unseeded_shuffled_arrays": dict(model=plain_model, compile=dict(loss="mse"), fit=lambda: {**arrays(), "shuffle": True},
                                     evaluate=None, before_fit=lambda: np.random.seed(100 + jax.process_index()),
                                     several_processes_only=True),
    # the user's own keras.distribution objects as distribute=: an uneven last batch as the equivalent spec
    "own_data_parallel_object": dict(model=named_model, compile=dict(loss="mse"), fit=arrays,
                                     evaluate=lambda: arrays(rows=224),
                                     distribute=lambda: keras.distribution.DataParallel()),
    "own_model_parallel_object": dict(model=named_model, compile=dict(loss="mse"), fit=arrays,
                                      evaluate=lambda: arrays(rows=224), distribute=gemma_like_model_parallel),
    # the weather example's tf.data and writing callbacks (process 0 writes, every process runs them), then a
    # third epoch resumed from the BackupAndRestore backup (every process reads process 0's)
    "weather_callbacks": dict(model=named_model, compile=dict(loss="mse", metrics=["mae"]),
                              fit=lambda: {"x": dataset(), "validation_data": dataset(batch_size=64)},
                              callbacks=weather_callbacks, resume=True, evaluate=lambda: arrays(rows=224)),
    # each process its own shuffle: over several processes one clear error, never process 0's batches alone
    "per_process_shuffle": dict(model=plain_model, compile=dict(loss="mse"), several_processes_only=True,
                                fit=lambda: {"x": dataset(seed=jax.process_index())}, evaluate=None),
}


def fresh(compile_kwargs):
    """``compile_kwargs`` with a new object for each metric object (one per compile, as a script makes them)."""
    return {k: [type(m).from_config(m.get_config()) if isinstance(m, keras.metrics.Metric) else m for m in v]
            if k == "metrics" else v for k, v in compile_kwargs.items()}


class CaseFailed(Exception):
    """fit and/or evaluate raised (each one's error in the message)."""


def trained(case, distribute):
    spec = CASES[case]
    model = spec["model"]()
    model.compile(optimizer=keras.optimizers.SGD(0.1), distribute=distribute, **fresh(spec["compile"]))
    spec.get("before_fit", lambda: None)()
    history, evaluated, errors = {}, {}, []
    folder = writes_folder(case, distribute)
    callbacks = spec.get("callbacks", lambda folder, resumed=False: [])
    try:
        history = model.fit(**{"shuffle": False, **spec["fit"]()}, epochs=2, verbose=0,
                            callbacks=callbacks(folder)).history
        if spec.get("resume"):
            again = model.fit(**{"shuffle": False, **spec["fit"]()}, epochs=3, verbose=0,
                              callbacks=callbacks(folder, resumed=True)).history
            history = {k: history[k] + again[k] for k in history}
        if spec.get("unfreeze"):
            base = model.get_layer(spec["unfreeze"])
            before = [np.asarray(w) for w in base.get_weights()]
            base.trainable = True
            model.compile(optimizer=keras.optimizers.SGD(0.05), distribute=distribute, **fresh(spec["compile"]))
            again = model.fit(**{"shuffle": False, **spec["fit"]()}, epochs=2, verbose=0).history
            history = {k: history[k] + again[k] for k in history}
            history["base_moved"] = [max(float(np.max(np.abs(a - b))) for a, b in zip(base.get_weights(), before))]
    except Exception as exc:  # noqa: BLE001
        errors.append(f"fit: {type(exc).__name__}: {exc}"[:2000])
    try:  # also after a failed fit
        if spec["evaluate"] is not None:
            evaluated = model.evaluate(**spec["evaluate"](), verbose=0, return_dict=True)
    except Exception as exc:  # noqa: BLE001
        errors.append(f"evaluate: {type(exc).__name__}: {exc}"[:2000])
    if errors:
        raise CaseFailed(" | ".join(errors))
    return model, {k: [float(v) for v in vs] for k, vs in history.items()}, {
        k: float(v) for k, v in evaluated.items()}


def writes_folder(case, distribute):
    """Where a case's callbacks write: one folder for the distributed run (process 0 alone writes there), one per
    process for the plain run."""
    run = "plain" + str(jax.process_index()) if distribute is None else "distributed"
    return f"{sys.argv[1]}.{case}.{run}"


def written(folder):
    """The files under ``folder``, TensorBoard's event files by their folder only (their names hold the host)."""
    found = []
    for parent, _, files in os.walk(folder):
        where = os.path.relpath(parent, folder)
        found += [where + "/events" if name.startswith("events.") else os.path.join(where, name) for name in files]
    return sorted(set(found))


def gathered(variable):
    """A variable's whole value (a sharded one spans other processes' devices: every process gathers)."""
    if jax.process_count() == 1:
        return np.asarray(variable.value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(variable.value, tiled=True))


results = {"processes": jax.process_count(), "devices": jax.device_count()}
for case in CASES:
    if CASES[case].get("several_processes_only") and jax.process_count() == 1:
        continue
    print("CASE", case, flush=True)
    try:
        model, history, evaluated = trained(case, CASES[case].get("distribute", lambda: "data_parallel")())
    except CaseFailed as exc:
        results[case] = {"error": str(exc)}
        continue
    plain, plain_history, plain_evaluated = trained(case, None)
    results[case] = {
        "max_dw": max(float(np.max(np.abs(gathered(a) - np.asarray(b.value))))
                      for a, b in zip(model.weights, plain.weights)),
        "history": history, "plain_history": plain_history,
        "evaluated": evaluated, "plain_evaluated": plain_evaluated,
        "kernel_spec": str(model.weights[0].value.sharding.spec),  # the first Dense kernel
    }
    if CASES[case].get("callbacks"):
        results[case]["written"] = written(writes_folder(case, "distributed"))
        results[case]["plain_written"] = written(writes_folder(case, None))
    if CASES[case].get("predict") and jax.process_count() == 1:  # 239 rows in batches of 32: uneven last batch
        results[case]["predict_diff"] = float(np.max(np.abs(model.predict(X, batch_size=BATCH, verbose=0)
                                                            - plain.predict(X, batch_size=BATCH, verbose=0))))


def diverged():
    """Issue 35 item 2, as KerasTuner does it (over several processes; the last case: the processes' counts of calls
    differ after it): a trial's fit fails on process 1 only (its checkpoint write), which goes on to the next trial's
    model, of the same shapes (both compiled before: compiling lays variables out on the mesh), while process 0 still
    trains the first. Before: process 1 waited in trial 2's first collective (NumPy's random state shared) while
    process 0 trained on: a hang (killed after 240 s). Now every process raises one error naming both sides (2.6 s).
    Returns each one's errors."""
    rank = jax.process_index()

    class FailsOnProcessOne(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if rank == 1:
                raise OSError("unable to lock file (simulated)")

    models = []
    for trial in (1, 2):
        keras.utils.set_random_seed(trial)
        models.append(keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)], name=f"trial_{trial}"))
        models[-1].compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", distribute="data_parallel")
    errors = []
    for model in models:
        try:
            model.fit(**arrays(rows=128), epochs=3, shuffle=False, verbose=0, callbacks=[FailsOnProcessOne()])
        except OSError as exc:  # KerasTuner marks the trial failed and goes on
            errors.append(f"{type(exc).__name__}: {exc}")
        except kerasdist.KerasdistError as exc:  # the processes are out of step for good
            errors.append(f"{type(exc).__name__}: {exc}")
            break
    return errors


if jax.process_count() > 1:
    print("CASE diverged", flush=True)
    results["diverged"] = {"errors": diverged()}
with open(f"{sys.argv[1]}.{jax.process_index()}", "w") as f:
    json.dump(results, f, indent=1)
if jax.process_count() > 1:  # tests/test_jax_custom_steps.py reads the cases above; this one checks itself
    WANT = ("KerasdistError: distribute='data_parallel': the ranks are not in the same call: ",
            "rank 1 is in fit #1 of model 'trial_2' (its start)", "rank 0 in fit #1 of model 'trial_1' (epoch 1)")
    last = (results["diverged"]["errors"] or [""])[-1]
    if not (last.startswith(WANT[0]) and all(w in last for w in WANT[1:])):
        print(f"FAILED diverged (issue 35 item 2): process {jax.process_index()} got {results['diverged']}",
              flush=True)
        sys.exit(1)
print("DONE", flush=True)
