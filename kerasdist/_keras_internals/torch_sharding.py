"""The private Keras and torch pieces sharding on the PyTorch backend needs (part of kerasdist._keras_internals).

A Keras variable on torch holds its tensor in ``Variable._value`` (private; ``variable.value`` reads it, and
``assign`` copies into it): "fsdp" replaces that tensor by a ``torch.distributed.tensor.DTensor`` parameter
holding this process's shard. tests/test_torch_sharding.py checks that ``value`` returns what was set here.

torch's ``implicit_replication()`` sets DTensor's dispatcher flag ``_allow_implicit_replication`` (private) on,
and off on its exit, even inside another one; :func:`implicitly_replicated` restores the flag it found.
tests/test_keras_internals_strategies.py checks the flag and the nesting.
"""

import contextlib


def variable_tensor(variable):
    """The tensor the Keras ``variable`` stores (``variable.value`` casts it inside an autocast scope)."""
    if "_value" not in variable.__dict__:
        replace_variable_tensor(variable, None)  # the clear error
    return variable._value


def replace_variable_tensor(variable, tensor):
    """Make ``tensor`` (a torch Parameter, e.g. a DTensor) the storage of the Keras ``variable``."""
    if "_value" not in variable.__dict__:
        from ..errors import KerasdistError

        raise KerasdistError(f"{type(variable).__name__} {getattr(variable, 'path', variable)!r} has no _value "
                             "tensor: this Keras version stores torch variables differently; fsdp needs Keras "
                             "3.15 (pip install 'keras>=3.15,<3.16').")
    variable._value = tensor


@contextlib.contextmanager
def implicitly_replicated():
    """Plain tensors treated as replicated DTensors inside (torch's ``implicit_replication()``), nestable: the
    flag is what it was after, so an outer one (a whole train step, whose backward pass needs it) stays on."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    if not hasattr(type(dispatcher), "_allow_implicit_replication"):
        from ..errors import KerasdistError

        import torch
        raise KerasdistError(f"torch {torch.__version__} has no DTensor._op_dispatcher._allow_implicit_replication, "
                             "which fsdp needs; install a torch kerasdist supports (pip install 'torch>=2.13,<2.15').")
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before
