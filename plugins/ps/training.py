"""``fit`` through a ClusterCoordinator, and evaluate/predict on the coordinator."""

import keras

from kerasdist import KerasdistError
from kerasdist.plugin_tools import check_number, is_dataset, symbolic_build, unbound_from_strategy

from .data import call_dataset_fn, training_input

_FIT_UNSUPPORTED = {"class_weight": None, "validation_split": 0.0}


def run_on_coordinator(call, call_kwargs, model):
    """Keras's own evaluate/predict in this process, reading the variables from the parameter servers.

    Exact (every sample once, in order), not distributed: Keras's loop cannot schedule on workers, and
    a worker-side evaluation would read a copy of the data per worker.
    """
    import tensorflow as tf

    if tf.distribute.has_strategy():
        raise KerasdistError("ps: call evaluate/predict outside `with strategy.scope():` (it runs on the "
                             "coordinator, outside the parameter-server strategy).")
    kwargs = dict(call_kwargs)
    if callable(kwargs.get("x")) and not is_dataset(kwargs["x"]):
        kwargs["x"] = call_dataset_fn(kwargs["x"])
    with unbound_from_strategy(model):
        return call(**kwargs)


def fit(model, strategy, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None, sample_weight=None,
        initial_epoch=0, steps_per_epoch=None, validation_steps=None, validation_batch_size=None,
        validation_freq=1):
    """``model.fit`` through a ClusterCoordinator; returns the ``keras.callbacks.History``."""
    import tensorflow as tf

    given = {"class_weight": class_weight, "validation_split": validation_split}
    for name, default in _FIT_UNSUPPORTED.items():
        if given[name] not in (default, None):
            raise KerasdistError(
                f"distribute='ps': fit({name}={given[name]!r}) is not supported. "
                + ("Weight samples in the dataset instead (x, y, sample_weight)." if name == "class_weight"
                   else "Pass validation_data= (evaluated on the coordinator after each epoch)."))
    check_count("epochs", epochs, minimum=1)
    check_count("initial_epoch", initial_epoch, minimum=0)
    check_count("validation_freq", validation_freq, minimum=1)
    source, element_spec, default_steps = training_input(strategy, x, y, sample_weight, batch_size, shuffle)
    if steps_per_epoch is None:
        steps_per_epoch = default_steps
    if steps_per_epoch is None:
        raise KerasdistError(
            "distribute='ps': fit() needs steps_per_epoch=N (a whole number > 0) with a dataset input: each "
            "worker reads its own copy of the dataset, repeated without end, so only a step count can end an "
            "epoch. Example: model.fit(dataset, epochs=3, steps_per_epoch=100). (NumPy input defaults to "
            "one pass over the data.)")
    check_count("steps_per_epoch", steps_per_epoch, minimum=1)
    verbose = 1 if verbose == "auto" else verbose

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        symbolic_build(model, element_spec)
    iterator = iter(coordinator.create_per_worker_dataset(source))
    train_function = _train_function(model, strategy)

    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
        steps=steps_per_epoch, model=model)
    history = next(c for c in callback_list.callbacks if isinstance(c, keras.callbacks.History))
    model.stop_training = False
    callback_list.on_train_begin()
    logs = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        for step in range(steps_per_epoch):
            # Batch callbacks run as steps are scheduled; their logs are empty (fetching a step's
            # result would make training synchronous).
            callback_list.on_train_batch_begin(step)
            coordinator.schedule(train_function, args=(iterator,))
            callback_list.on_train_batch_end(step, {})
            if model.stop_training:
                break
        _join(coordinator)
        logs = _metrics(model)
        if validation_data is not None and (epoch + 1) % validation_freq == 0:
            val_logs = evaluate_for_fit(model, validation_data, validation_steps,
                                        validation_batch_size or batch_size)
            logs.update({"val_" + name: value for name, value in val_logs.items()})
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return history


def _train_function(model, strategy):
    import tensorflow as tf

    @tf.function
    def train_function(iterator):
        strategy.run(model.train_step, args=(next(iterator),))

    return train_function


def _join(coordinator):
    import tensorflow as tf

    try:
        coordinator.join()
    except tf.errors.OutOfRangeError as exc:
        raise KerasdistError(
            "distribute='ps': a worker's dataset ran out of data during fit. Each worker needs an endless "
            "stream: make the dataset function return dataset.repeat() (steps_per_epoch ends each epoch).") from exc


def _metrics(model):
    import numpy as np

    return {name: float(np.asarray(value)) for name, value in model.get_metrics_result().items()}


def evaluate_for_fit(model, validation_data, steps, batch_size):
    if isinstance(validation_data, tuple) and not is_dataset(validation_data):
        x, y, *rest = validation_data + ((None,) if len(validation_data) == 2 else ())
        kwargs = {"x": x, "y": y, "sample_weight": rest[0] if rest else None, "batch_size": batch_size}
    else:
        kwargs = {"x": validation_data}
    return model.evaluate(steps=steps, verbose=0, return_dict=True, **kwargs)


def check_count(name, value, minimum):
    return check_number(value, f"fit({name}=...)", "distribute='ps'", minimum=minimum, integer=True)
