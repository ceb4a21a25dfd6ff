"""Sparse gradients (``tf.IndexedSlices``: an Embedding's, one slice per lookup, repeated ids included) over the TCP
ring, kept sparse: every worker ends with every worker's slices, rank 0's first, as one process holds them for the
global batch (each worker's share is the next rows of it). Keras's adaptive optimizers update their slots slice by
slice (Adam's second moment takes the sum of each slice's square, not the square of the summed rows), so summing the
slices into a dense gradient would train another model than one process does.

The gather runs as a ring sum: each worker places its slices at its offset in a buffer of every worker's slices,
zeros elsewhere (a float plus zero is that float, so the sum is the gather, bit for bit)."""


def slice_counts(grads, sparse, ring, has_rows):
    """This worker's slice count of each sparse gradient, in its rank's column of a ``[len(sparse), size]`` float32
    table (zeros elsewhere): summed over the ring, every worker's counts (exact up to 2**24 slices)."""
    import tensorflow as tf

    counts = [tf.where(has_rows, tf.shape(grads[i].indices)[0], 0) for i in sparse]
    column = tf.one_hot(ring.rank, ring.size, dtype=tf.float32)
    return tf.cast(tf.stack(counts), tf.float32)[:, None] * column[None, :]


def gather_slices(slices, counts, ring, has_rows):
    """Every worker's ``slices`` (one ``tf.IndexedSlices`` per sparse gradient, this worker's, already weighted),
    concatenated in rank order, given ``counts`` (:func:`slice_counts` summed over the ring). Two ring messages in
    all: the values (float32 on the wire) and the indices (int64)."""
    import tensorflow as tf

    counts = tf.cast(counts, tf.int32)
    values, indices = [], []
    for piece, row in zip(slices, tf.unstack(counts) if slices else []):
        before, total = tf.reduce_sum(row[:ring.rank]), tf.reduce_sum(row)
        own = tf.where(has_rows, tf.shape(piece.indices)[0], 0)
        own_values = piece.values[:own]
        values.append(_placed(tf.where(has_rows, own_values, tf.zeros_like(own_values)), before, total))
        indices.append(_placed(tf.cast(piece.indices[:own], tf.int64), before, total))
    gathered = ring.sum_tensors(values + indices)
    return [tf.IndexedSlices(v, tf.cast(i, piece.indices.dtype), piece.dense_shape)
            for v, i, piece in zip(gathered[:len(slices)], gathered[len(slices):], slices)]


def _placed(part, before, total):
    """``part`` at rows ``[before, before + len(part))`` of ``total`` rows of zeros."""
    import tensorflow as tf

    after = total - before - tf.shape(part)[0]
    shape = tf.shape(part)[1:]
    return tf.concat([tf.zeros(tf.concat([[before], shape], 0), part.dtype), part,
                      tf.zeros(tf.concat([[after], shape], 0), part.dtype)], 0)
