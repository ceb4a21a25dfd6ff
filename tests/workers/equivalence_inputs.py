"""The input kinds of the equivalence matrix (tests/workers/equivalence_script.py ``--input KIND``): the same rows
and global batches handed to ``fit`` as ``x`` and as ``validation_data`` in each of the ways a Keras user writes
them. Every kind but ``numpy`` shuffles or leaves an uneven last batch (or both), so a wrong order or a lost row
moves the weights.

``fit_arguments(kind, x, y, xv, yv, batch)`` returns the keyword arguments of ``fit``.
"""

#: kind -> what it feeds (docs/equivalence.md lists them)
KINDS = {
    "numpy": "NumPy arrays, fit(shuffle=False)",
    "numpy_shuffled": "NumPy arrays, fit(shuffle=True) after keras.utils.set_random_seed",
    "tf_tensor": "tf.Tensor x and y, fit(shuffle=True)",
    "tf_data": "tf.data.Dataset.shuffle(n, seed, reshuffle_each_iteration=True).batch(B): an uneven last batch",
    "py_dataset": "keras.utils.PyDataset(workers=4) of global batches, shuffled by fit, an uneven last batch",
    "generator": "a Python generator of global batches (steps_per_epoch, validation_steps)",
    "dataloader": "torch.utils.data.DataLoader(shuffle=True, seeded generator): an uneven last batch",
}
#: kinds only one backend reads
BACKEND_ONLY = {"dataloader": "torch"}


def batches_of(x, y, batch):
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]


def py_dataset(x, y, batch):
    import keras

    class GlobalBatches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=4, use_multiprocessing=False)
            self.batches = batches_of(x, y, batch)

        def __len__(self):
            return len(self.batches)

        def __getitem__(self, index):
            return self.batches[index]

    return GlobalBatches()


def endless(x, y, batch):
    """A generator of global batches, epoch after epoch (fit reads ``steps`` of them per epoch)."""
    while True:
        yield from batches_of(x, y, batch)


def tf_data(x, y, batch, seed):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed,
                                                               reshuffle_each_iteration=True).batch(batch)


def dataloader(x, y, batch, seed):
    import torch

    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


def fit_arguments(kind, x, y, xv, yv, batch):
    """``fit``'s input keywords for ``kind``: training on (x, y) and validating on (xv, yv) (None: no validation)."""
    steps = -(-len(x) // batch)
    validate = xv is not None
    if kind in ("numpy", "numpy_shuffled", "tf_tensor"):
        if kind == "tf_tensor":
            import tensorflow as tf

            x, y = tf.constant(x), tf.constant(y)
            xv, yv = (tf.constant(xv), tf.constant(yv)) if validate else (xv, yv)
        arguments = dict(x=x, y=y, batch_size=batch, shuffle=kind != "numpy")
        return {**arguments, **(dict(validation_data=(xv, yv), validation_batch_size=batch) if validate else {})}
    if kind == "tf_data":
        make = lambda a, b, seed: tf_data(a, b, batch, seed)  # noqa: E731
    elif kind == "py_dataset":
        make = lambda a, b, seed: py_dataset(a, b, batch)  # noqa: E731
    elif kind == "dataloader":
        make = lambda a, b, seed: dataloader(a, b, batch, seed)  # noqa: E731
    elif kind == "generator":
        arguments = dict(x=endless(x, y, batch), steps_per_epoch=steps)
        if validate:
            arguments.update(validation_data=endless(xv, yv, batch), validation_steps=-(-len(xv) // batch))
        return arguments
    else:
        raise ValueError(f"--input {kind!r}: not one of {sorted(KINDS)}")
    arguments = dict(x=make(x, y, 5), shuffle=kind == "py_dataset")
    return {**arguments, **(dict(validation_data=make(xv, yv, 6)) if validate else {})}
