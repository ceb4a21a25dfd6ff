"""The strategy-free step's gather of sparse gradients (plugins/multiworker/sparse_slices.py, issue 35 item 1) over a
real two-rank TCP ring in threads: every rank ends with every rank's slices, rank 0's first, uneven and empty shares
included. Training against one process: test_multiworker_strategy_free::test_custom_train_steps_equal_one_process_*."""

import threading

import numpy as np
import pytest


def two_rings():
    """A real two-rank TCP ring on 127.0.0.1, connected in threads: each rank's TcpRing."""
    from kerasdist_plugins.multiworker import ring as tcp_ring

    listeners = [tcp_ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [address for _, address in listeners]
    rings = [None, None]

    def connect(rank):
        rings[rank] = tcp_ring.TcpRing.connect(listeners[rank][0], addresses, rank, timeout=30, secret=b"s")

    _in_threads(connect)
    return rings


def _in_threads(work):
    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows", [(3, 2), (0, 2), (2, 0)], ids=["uneven", "rank0-empty", "rank1-empty"])
def test_every_rank_gets_every_ranks_slices_in_rank_order(rows):
    import tensorflow as tf

    from kerasdist_plugins.multiworker.sparse_slices import gather_slices, slice_counts

    rings, got = two_rings(), [None, None]
    slices = [tf.IndexedSlices(tf.constant(np.arange(n * 2, dtype="float32").reshape(n, 2) + 10 * rank),
                               tf.constant(np.arange(n, dtype="int32") % 2 + rank), tf.constant([4, 2]))
              for rank, n in enumerate(rows)]

    def each(rank):
        @tf.function  # as in the train step
        def gather(piece):
            has_rows = tf.constant(rows[rank] > 0)
            counts = rings[rank].sum_tensors([slice_counts([piece], [0], rings[rank], has_rows)])[0]
            return gather_slices([piece], counts, rings[rank], has_rows)[0]

        got[rank] = gather(slices[rank])

    try:
        _in_threads(each)
    finally:
        [ring.close() for ring in rings]
    want_values = np.concatenate([s.values.numpy() for s in slices])
    want_indices = np.concatenate([s.indices.numpy() for s in slices])
    for rank in (0, 1):
        assert got[rank].indices.dtype == tf.int32 and got[rank].dense_shape.numpy().tolist() == [4, 2]
        np.testing.assert_array_equal(got[rank].values.numpy(), want_values)
        np.testing.assert_array_equal(got[rank].indices.numpy(), want_indices)
