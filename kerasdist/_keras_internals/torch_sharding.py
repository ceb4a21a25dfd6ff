"""The private Keras piece sharding on the PyTorch backend needs (part of kerasdist._keras_internals).

A Keras variable on torch holds its tensor in ``Variable._value`` (private; ``variable.value`` reads it, and
``assign`` copies into it): "fsdp" replaces that tensor by a ``torch.distributed.tensor.DTensor`` parameter
holding this process's shard. tests/test_torch_sharding.py checks that ``value`` returns what was set here.
"""


def replace_variable_tensor(variable, tensor):
    """Make ``tensor`` (a torch Parameter, e.g. a DTensor) the storage of the Keras ``variable``."""
    if "_value" not in variable.__dict__:
        from ..errors import KerasdistError

        raise KerasdistError(f"{type(variable).__name__} {getattr(variable, 'path', variable)!r} has no _value "
                             "tensor: this Keras version stores torch variables differently; fsdp needs Keras "
                             "3.15 (pip install 'keras>=3.15,<3.16').")
    variable._value = tensor
