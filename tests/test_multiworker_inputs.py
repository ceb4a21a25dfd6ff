"""distribute="multiworker" strategy-free inputs, in this process (no worker started): what each worker takes of
every input kind, what is refused, and when Keras's own shuffle is kept (issue 29 item 4). The launched cases are in
tests/test_multiworker_strategy_free.py."""

import numpy as np
import pytest


def test_split_batches_cuts_sparse_rows_keeping_their_static_shape():
    """tf.data, generator: each rank its rows of a SparseTensor batch (an empty share included), with the batch's
    inner shape kept (an unbuilt model builds from it)."""
    import tensorflow as tf

    from kerasdist.plugin_tools import split_batches

    x = np.arange(25, dtype="float32").reshape(5, 5)
    x[x % 3 == 0] = 0
    y = np.arange(5.0)
    dataset = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(x), y)).batch(5)
    for rank, rows in ((0, slice(0, 2)), (1, slice(2, 5))):
        part = split_batches(dataset, rank, 2)
        assert part.element_spec[0].shape.as_list() == [None, 5]
        (features, labels), = list(part)
        np.testing.assert_array_equal(tf.sparse.to_dense(features).numpy(), x[rows])
        np.testing.assert_array_equal(labels.numpy(), y[rows])
    (features, labels), = list(split_batches(((tf.sparse.from_dense(x), y) for _ in range(1)), 1, 2))
    np.testing.assert_array_equal(tf.sparse.to_dense(features).numpy(), x[2:])
    one_row = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(x), y)).batch(1).take(1)
    (features, labels), = list(split_batches(one_row, 0, 2))
    assert features.dense_shape.numpy().tolist() == [0, 5] and labels.shape == (0,)


def test_workers_seeds_differing_only_below_float64_precision_are_not_the_same_seed():
    """Seeds were compared as float64 sums: 2**60 and 2**60 + 1 counted as one seed, and the workers shuffled
    arrays in different orders, silently. Checked without processes: the pieces two workers send, summed."""
    from kerasdist.plugin_tools import int_pieces, same_everywhere

    def same(*seeds):
        pieces = [int_pieces(s) for s in seeds]
        return same_everywhere(pieces[0], lambda *_: (sum(pieces), sum(p ** 2 for p in pieces)), len(seeds))

    for seed in (2 ** 60, 2 ** 63 - 1, -(2 ** 62), 12345, 0):
        assert same(seed, seed, seed)
        assert not same(seed, seed + 1) and not same(seed + 1, seed)
    assert not same(2 ** 60, 2 ** 60 + 2 ** 20, 2 ** 60 + 2 ** 21)
    assert not same(None, None) and not same(7, None)


class _TwoRanks:
    """A stand-in for the ring where no message is sent: rank 0 of 2."""
    rank, size = 0, 2


@pytest.mark.parametrize("case", ["python-numbers", "unknown-object", "jax-sparse", "validation-object",
                                  "validation-four-parts"])
def test_an_input_multiworker_cannot_split_is_refused_naming_it(case):
    """Issue 29 item 4: an input that is neither in-memory arrays nor batches kerasdist splits was left to Keras in
    every worker (each trained all of it, or, a grain dataset, a DistributedDataset); now one KerasdistError names
    the argument and its type, and what can be split."""
    import kerasdist
    from kerasdist_plugins.multiworker.inputs import split_call_data

    def jax_sparse():
        import jax.experimental.sparse
        import jax.numpy as jnp

        return jax.experimental.sparse.BCOO.fromdense(jnp.eye(8))

    arrays = np.ones((8, 2), "float32")
    call = {"python-numbers": dict(x=[1.0, 2.0, 3.0]), "unknown-object": dict(x=object()),
            "jax-sparse": dict(x=jax_sparse() if case == "jax-sparse" else None, y=arrays),
            "validation-object": dict(x=arrays, y=arrays, validation_data=object()),
            "validation-four-parts": dict(x=arrays, y=arrays, validation_data=(arrays,) * 4)}[case]
    with pytest.raises(kerasdist.KerasdistError) as info:
        split_call_data(dict(call, batch_size=4, shuffle=False), _TwoRanks(), "fit", None)
    message = str(info.value)
    words = {"python-numbers": ["fit's x (list holding float)", "cannot be split", "KERASDIST_STRATEGY_FREE=off"],
             "unknown-object": ["fit's x (object)", "torch DataLoader"], "jax-sparse": ["BCOO", "tf.SparseTensor"],
             "validation-object": ["validation_data (object)", "(x, y[, sample_weight])"],
             "validation-four-parts": ["validation_data (tuple holding ndarray)"]}[case]
    assert all(word in message for word in words), message


def test_tensors_and_nested_inputs_become_arrays_and_ragged_rows_split():
    """Issue 29 item 2: dense tensors of every framework (and pandas) are arrays, nested structures too; a
    RaggedTensor's and a scipy sparse matrix's rows split like a dense one's."""
    import pandas
    import scipy.sparse
    import tensorflow as tf
    import torch

    from kerasdist.plugin_tools import arrays_as_dataset, as_arrays, split_batches

    values = np.arange(6, dtype="float32").reshape(3, 2)
    nested = as_arrays({"a": [torch.tensor(values, requires_grad=True), tf.Variable(values)],
                        "b": pandas.DataFrame(values)})
    for leaf in (nested["a"][0], nested["a"][1], nested["b"]):
        assert isinstance(leaf, np.ndarray)
        np.testing.assert_array_equal(leaf, values)
    assert as_arrays([1.0, 2.0]) is None and as_arrays([values, None]) is None and as_arrays({}) is None
    ragged = tf.ragged.constant([[1.0], [2.0, 3.0], [4.0], [5.0, 6.0, 7.0]])
    kwargs = dict(x=ragged, y=tf.constant([1.0, 2.0, 3.0, 4.0]), batch_size=4)
    assert arrays_as_dataset(kwargs, method="evaluate")
    parts = [list(split_batches(kwargs["x"], rank, 2))[0] for rank in (0, 1)]
    assert [p[0].to_list() for p in parts] == [[[1.0], [2.0, 3.0]], [[4.0], [5.0, 6.0, 7.0]]]
    assert [p[1].numpy().tolist() for p in parts] == [[1.0, 2.0], [3.0, 4.0]]
    kwargs = dict(x=scipy.sparse.csr_matrix(np.eye(4, 3, dtype="float32")), y=np.arange(4.0), batch_size=4)
    assert arrays_as_dataset(kwargs, method="evaluate")  # a scipy matrix: the SparseTensor Keras makes of it
    (features, labels), = list(split_batches(kwargs["x"], 1, 2))
    np.testing.assert_array_equal(tf.sparse.to_dense(features).numpy(), np.eye(4, 3)[2:])


def test_a_data_loaders_batches_split_keeping_its_sampler_and_worker_processes():
    """Issue 29 item 3: each rank's part of a torch DataLoader is a DataLoader over the same batch sampler and
    worker settings whose collate keeps its rows; a shuffling sampler is seeded alike on every rank (the ranks'
    parts together are the batches of one loader whose sampler has that generator); iterable datasets and
    batch_size=None."""
    import torch

    from kerasdist.plugin_tools import seed_shuffling_samplers, split_batches

    data = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10.0) * 10)

    def loader(**kwargs):
        return torch.utils.data.DataLoader(data, batch_size=4, **kwargs)

    with_workers = loader(num_workers=2, persistent_workers=True)
    part = split_batches(with_workers, 1, 2)
    assert part.num_workers == 2 and part.persistent_workers and part.batch_sampler is with_workers.batch_sampler
    parts = []
    for rank in (0, 1):
        shuffled = loader(shuffle=True)
        assert seed_shuffling_samplers(shuffled, 7) and not seed_shuffling_samplers(shuffled, 8)
        parts.append([x.tolist() for x, _ in split_batches(shuffled, rank, 2)])
    one = loader(shuffle=True)
    one.sampler.generator = torch.Generator().manual_seed(7)
    whole = [x.tolist() for x, _ in one]
    assert [a + b for a, b in zip(*parts)] == whole and len(whole) == 3

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    stream = torch.utils.data.DataLoader(Stream(), batch_size=4)
    assert [b.tolist() for b in split_batches(stream, 1, 2)] == [[2, 3], [4]]
    batches = torch.utils.data.DataLoader([torch.arange(4)], batch_size=None)
    assert [b.tolist() for b in split_batches(batches, 0, 2)] == [[0, 1]]


class _RingOfStates:
    """A stand-in for the ring of 2 workers: the other worker sends the digest of ``other_state``."""
    rank, size = 0, 2

    def __init__(self, other_state):
        from kerasdist.plugin_tools import digest_pieces

        self.other = digest_pieces(other_state)

    def sum_arrays(self, mine, squares):
        return mine + self.other, squares + self.other ** 2


@pytest.mark.parametrize("same", [True, False])
def test_a_shuffled_py_dataset_keeps_keras_shuffle_only_when_every_python_random_state_is_the_same(same):
    """Issue 29: fit(shuffle=True) of a PyDataset trained in kerasdist's shared-seed order (equivalence cell
    input_py_dataset x multiworker: max |dw| 0.0166), though Keras shuffles it with Python's random, the same on
    every worker after keras.utils.set_random_seed. Now Keras's own shuffle stays where every worker's state is the
    same (one process's order), and the shared order is kept where it is not."""
    import random

    import keras

    from kerasdist.plugin_tools import keras_shuffles_by_epoch
    from kerasdist_plugins.multiworker.inputs import split_call_data

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return np.full((2, 1), index, "float32"), np.zeros((2, 1), "float32")

    random.seed(5)
    state = random.getstate()
    other = state if same else (random.random(), random.getstate())[1]
    random.setstate(state)
    data = Batches()
    call = dict(x=data, shuffle=True)
    split_call_data(call, _RingOfStates(other), "fit", seed=7)
    assert random.getstate() == state  # the check draws nothing
    keras_draws_alike = same or keras_shuffles_by_epoch()  # 3.16: random.Random(epoch), whatever the states
    assert (call["x"] is data and call["shuffle"] is True) if keras_draws_alike else call["shuffle"] is False
