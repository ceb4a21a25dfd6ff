"""Pruning masks: unstructured magnitude, N:M (e.g. 2:4 for sparse tensor cores) and block sparsity."""

import math

import kerasdist

PATTERNS = {"2:4": (2, 4)}


def parse_pattern(pattern):
    """``"2:4"`` -> ``(2, 4)``; other patterns are refused with the supported ones."""
    if pattern is None:
        return None
    if pattern not in PATTERNS:
        raise kerasdist.KerasdistError(
            f"prune: pattern={pattern!r} is not supported; use pattern='2:4' (at most 2 non-zeros in every 4 "
            "consecutive input weights: the structure NVIDIA sparse tensor cores run, TFMOT's m_by_n), or block=.")
    return PATTERNS[pattern]


def check_block(block):
    if block is None:
        return None
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise kerasdist.KerasdistError(
            f"prune: block={block!r} is not valid; give two positive integers (input, output), e.g. block=(1, 4).")
    return tuple(block)


def check_kernel_fits(layer, pattern=None, block=None):
    """A structured mask needs kernel dimensions that its blocks divide."""
    shape = tuple(layer.kernel.shape)
    if len(shape) < 2:
        raise kerasdist.KerasdistError(f"prune: layer {layer.name!r} has a {len(shape)}-d kernel; structured "
                                       "sparsity needs an (input, output) kernel.")
    if pattern is not None and shape[-2] % pattern[1]:
        raise kerasdist.KerasdistError(
            f"prune: pattern='{pattern[0]}:{pattern[1]}' needs layer {layer.name!r}'s input dimension to be a "
            f"multiple of {pattern[1]}; its kernel has shape {shape} (input {shape[-2]}). Leave it out with "
            "prune(layers=[...]).")
    if block is not None and (shape[-2] % block[0] or shape[-1] % block[1]):
        raise kerasdist.KerasdistError(
            f"prune: block={block} does not divide layer {layer.name!r}'s kernel {shape} (input x output = "
            f"{shape[-2]} x {shape[-1]}); choose a block that divides it, or leave the layer out with "
            "prune(layers=[...]).")


def magnitude_mask(kernel, sparsity):
    """A 0/1 mask of ``kernel``'s shape keeping its ``n - round(sparsity * n)`` largest |weights|."""
    from keras import ops

    size = math.prod(kernel.shape)
    keep = size - int(round(sparsity * size))
    if keep >= size:
        return ops.ones(kernel.shape, kernel.dtype)
    flat = ops.abs(ops.reshape(ops.convert_to_tensor(kernel), (-1,)))
    _, kept = ops.top_k(flat, keep, sorted=False)
    mask = ops.scatter(ops.expand_dims(kept, -1), ops.ones((keep,), kernel.dtype), (size,))
    return ops.reshape(mask, kernel.shape)


def n_of_m_mask(kernel, n, m):
    """Keep the ``n`` largest |weights| of every ``m`` consecutive weights along the input axis (-2)."""
    from keras import ops

    moved = ops.moveaxis(ops.abs(ops.convert_to_tensor(kernel)), -2, -1)  # (..., output, input)
    groups = ops.reshape(moved, tuple(moved.shape[:-1]) + (moved.shape[-1] // m, m))
    rank = ops.argsort(ops.argsort(groups, axis=-1), axis=-1)  # 0 = smallest in its group
    keep = ops.cast(rank >= m - n, kernel.dtype)
    return ops.moveaxis(ops.reshape(keep, moved.shape), -1, -2)


def block_mask(kernel, block, sparsity):
    """Zero whole (input x output) blocks: those with the smallest mean |weight|, ``sparsity`` of them."""
    from keras import ops

    shape = tuple(kernel.shape)
    rows, cols = shape[-2] // block[0], shape[-1] // block[1]
    blocks = ops.reshape(ops.abs(ops.convert_to_tensor(kernel)), shape[:-2] + (rows, block[0], cols, block[1]))
    scores = ops.mean(blocks, axis=(-3, -1))  # (..., rows, cols)
    kept = magnitude_mask(scores, sparsity)
    return ops.repeat(ops.repeat(kept, block[0], axis=-2), block[1], axis=-1)


def mask_for(kernel, sparsity, pattern=None, block=None):
    if pattern is not None:
        return n_of_m_mask(kernel, *pattern)
    if block is not None:
        return block_mask(kernel, block, sparsity)
    return magnitude_mask(kernel, sparsity)


class MaskConstraint:
    """``kernel * mask`` after the layer's own constraint; Keras applies it after each update."""

    def __init__(self, mask, inner=None):
        self.mask, self.inner = mask, inner

    def __call__(self, weight):
        factor = self.mask.factor() if hasattr(self.mask, "factor") else self.mask  # a HostMask off TensorFlow
        return (self.inner(weight) if self.inner is not None else weight) * factor
