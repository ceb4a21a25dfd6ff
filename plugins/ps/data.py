"""What each worker reads: a dataset, a dataset function, or NumPy input embedded in the pipeline."""

import inspect
import math

from kerasdist import KerasdistError
from kerasdist.plugin_tools import check_number, is_dataset

#: NumPy input is embedded in the input pipeline sent to every worker; beyond this, use a dataset function.
MAX_NUMPY_BYTES = 256 << 20


def _takes_input_context(fn):
    try:
        parameters = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(parameters) >= 1


def call_dataset_fn(fn):
    import tensorflow as tf

    dataset = fn(tf.distribute.InputContext()) if _takes_input_context(fn) else fn()
    if not is_dataset(dataset):
        raise KerasdistError(f"ps: the dataset function {fn!r} returned {type(dataset).__name__}, not a "
                             "tf.data.Dataset.")
    return dataset


def training_input(strategy, x, y, sample_weight, batch_size, shuffle):
    """``(what create_per_worker_dataset takes, element_spec, default steps_per_epoch or None)``."""
    import numpy as np
    import tensorflow as tf

    if is_dataset(x) or callable(x):
        extra = [name for name, value in (("y", y), ("sample_weight", sample_weight), ("batch_size", batch_size))
                 if value is not None]
        if extra:
            raise KerasdistError(f"distribute='ps': fit() got {', '.join(extra)} with a dataset input; put "
                                 "labels and weights in the dataset's elements and batch the dataset.")
    if is_dataset(x):
        if x.cardinality() >= 0:  # finite: every worker needs an endless stream
            x = x.repeat()
        return x, x.element_spec, None
    if callable(x):
        sample = call_dataset_fn(x)
        source = strategy.distribute_datasets_from_function(x) if _takes_input_context(x) else x
        return source, sample.element_spec, None
    arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
    try:
        flat = [np.asarray(a) for a in tf.nest.flatten(arrays)]
    except Exception:
        flat = None
    if x is None or flat is None or any(a.dtype == object for a in flat) or not flat:
        raise KerasdistError(
            f"distribute='ps': fit() cannot feed x of type {type(x).__name__} to the workers. Pass a "
            "tf.data.Dataset, a function returning one (called on each worker, optionally with a "
            "tf.distribute.InputContext), or NumPy arrays. Python generators and keras.utils.PyDataset "
            "live in this process and cannot be sent to the workers.")
    size = sum(a.nbytes for a in flat)
    if size > MAX_NUMPY_BYTES:
        raise KerasdistError(
            f"distribute='ps': the NumPy input is {size / 2**20:.0f} MiB; above {MAX_NUMPY_BYTES >> 20} MiB "
            "it cannot be embedded in the input pipeline sent to every worker. Pass a function that builds "
            "a tf.data.Dataset from files (e.g. TFRecord) instead.")
    count = len(flat[0])
    batch_size = 32 if batch_size is None else batch_size
    check_number(batch_size, "fit(batch_size=...)", "distribute='ps'", minimum=1, integer=True)
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if shuffle:
        dataset = dataset.shuffle(count, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size).repeat()
    return dataset, dataset.element_spec, math.ceil(count / batch_size)
