"""Masks on the JAX and PyTorch backends: computed once on the host from the WHOLE kernel (gathered across
devices, processes and shards), identical in every process, and applied by the kernel's constraint.

- A kernel's full value comes from every shard: ``process_allgather`` for a JAX array spanning processes,
  ``DTensor.full_tensor()`` for an fsdp shard; every process takes part, in the same order.
- The mask is computed by the same Keras-ops code as on TensorFlow (:mod:`.masks`) from that full value, so
  every replica, rank and shard holds the same mask, bit for bit, as one process pruning the same kernel.
- JAX: the constraint multiplies by a NumPy constant inside the jitted step, so the train function is
  re-traced after the masks change. PyTorch: one mask tensor per kernel, updated in place (eager steps and
  ``torch.compile`` both read it live); an fsdp shard multiplies by it as a replicated tensor.
"""

from kerasdist.plugin_tools import keras_backend

from .masks import mask_for


def full_kernel(variable):
    """The variable's whole value as a NumPy array (a collective where it is sharded over processes)."""
    import numpy as np

    value = variable.value
    if keras_backend() == "jax":
        if not value.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(value, tiled=True))
        return np.asarray(value)
    if keras_backend() == "torch":
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.detach().cpu().numpy()
    from keras import ops

    return ops.convert_to_numpy(value)


def host_mask(full, sparsity, pattern=None, block=None):
    """The 0/1 mask (NumPy, the kernel's dtype) of a whole kernel: the Keras-ops mask math, run on this host."""
    from keras import ops

    return ops.convert_to_numpy(mask_for(ops.convert_to_tensor(full), sparsity, pattern, block)).astype(full.dtype)


class HostMask:
    """One kernel's mask as its constraint reads it on JAX (NumPy constant) or PyTorch (a tensor kept in place)."""

    def __init__(self, variable):
        import numpy as np

        self.shape, self.dtype = tuple(variable.shape), np.dtype(str(variable.dtype))
        self.array = np.ones(self.shape, self.dtype)
        self.tensor = None
        if keras_backend() == "torch":
            import torch

            device = _local(variable.value).device
            self.tensor = torch.ones(self.shape, dtype=_local(variable.value).dtype, device=device)

    def set(self, array):
        """Take the new mask; whether it differs from the one held."""
        import numpy as np

        if np.array_equal(array, self.array):
            return False
        self.array = array
        if self.tensor is not None:
            import torch

            self.tensor.copy_(torch.as_tensor(array))
        return True

    def factor(self):
        """What the constraint multiplies by."""
        return self.tensor if self.tensor is not None else self.array

    def kept(self):
        return float(self.array.sum())


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def assign_masked(variable, full, mask):
    """Set the variable to ``full * mask`` on every device and shard (each process holds the same ``full``)."""
    masked = full * mask.array
    if keras_backend() == "jax":
        import jax

        sharding = variable.value.sharding
        variable.assign(jax.make_array_from_callback(masked.shape, sharding, lambda index: masked[index]))
    elif keras_backend() == "torch":
        from torch.distributed.tensor import DTensor

        value = variable.value
        if isinstance(value, DTensor):
            from torch.distributed.tensor import distribute_tensor

            import torch

            local = torch.as_tensor(masked, device=_local(value).device)
            variable.assign(distribute_tensor(local, value.device_mesh, value.placements))
        else:
            variable.assign(masked)
    else:
        variable.assign(masked)


def pruned_weights_moved(full, mask):
    """Whether weights the mask zeroes are non-zero (a train step that skipped the optimizer's constraints)."""
    import numpy as np

    return bool(np.any(full[mask.array == 0] != 0))
