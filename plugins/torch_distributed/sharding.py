"""distribute="fsdp" on PyTorch: every weight and every optimizer slot sharded across the processes
(ZeRO-3 / FSDP semantics), on a model built anywhere, with Keras's own ``fit`` and optimizer.

How, on Keras 3.15 (measured: torch FSDP2's ``fully_shard`` cannot do it, see docs/torch.md): each Keras
variable's tensor becomes a ``torch.distributed.tensor.DTensor`` on a one-axis device mesh of all the
processes, ``Shard(0)`` (a vector or matrix whose first axis divides by the world size, else ``Replicate()``:
DTensor's convolution backward fails on a sharded kernel of 3+ axes); the optimizer's
slots are sharded like their variable once built. Every rank iterates the same global batch; the model's
``call`` takes this rank's rows as a ``Shard(0)`` DTensor, so DTensor all-gathers each weight for the
matmul and reduce-scatters its gradient, and gathers the outputs: the loss and metrics are those of the
global batch, identical in every rank, and the optimizer updates only this rank's shard.
"""

import contextlib
import dataclasses
from typing import Optional

import kerasdist
from kerasdist import KerasdistError

from .group import TORCH_BACKENDS, TorchDataParallel, join


@dataclasses.dataclass
class FullySharded(kerasdist.StrategySpec):
    """Weights and optimizer state sharded over the processes (torch DTensor), data parallel compute.

    :param backend: torch.distributed backend (default: gloo on CPU, NCCL with CUDA).
    :param timeout_s: how long a rank waits for the others to join.
    """

    backend: Optional[str] = None
    timeout_s: float = 300.0

    def __post_init__(self):
        from kerasdist.plugin_tools import check_choice, check_number

        self.backend = check_choice(self.backend, "backend", "fsdp", TORCH_BACKENDS, allow_none=True)
        check_number(self.timeout_s, "timeout_s", "fsdp", minimum=0, inclusive_minimum=False)


class ShardedGroup(TorchDataParallel):
    """The strategy object of "fsdp": the process group (as data_parallel's) and its one-axis device mesh.
    The data_parallel hooks leave it alone: they act only on a ``TorchDataParallelSpec``."""

    def __init__(self, group):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(group.rank, group.world_size, group.local_rank, group.backend, group.device)
        self.mesh = init_device_mesh(group.device, (group.world_size,)) if group.world_size > 1 else None

    def __repr__(self):
        return f"ShardedGroup(rank={self.rank}, world_size={self.world_size})"


@kerasdist.hookimpl(specname="kerasdist_register_strategies")
def register_fsdp(register):
    register("fsdp", FullySharded, aliases=("fully_sharded", "zero3"), backends=("torch",), requires=("torch",),
             extra="torch", description="Weights and optimizer state sharded over the processes (torch DTensor, "
                                        "ZeRO-3), data-parallel compute; a model built anywhere.")


@kerasdist.hookimpl(specname="kerasdist_create_strategy")
def create_fsdp_group(spec, cluster):
    if not isinstance(spec, FullySharded):
        return None
    check_trainer_leaves_distribution_to_us()  # before any rendezvous
    return ShardedGroup(join(cluster, spec.backend, spec.timeout_s))


@kerasdist.hookimpl(specname="kerasdist_prepare_model")
def shard_model(model, strategy, spec):
    if not isinstance(spec, FullySharded) or strategy.mesh is None or "_kerasdist_fsdp" in model.__dict__:
        return
    if not model.built or not model.weights:
        raise KerasdistError(f"fsdp: model {model.name!r} has no weights yet; build it before compile (give it a "
                             "keras.Input, or call model.build(input_shape)), so that its weights can be sharded.")
    for variable in model.weights:
        shard_variable(variable, strategy.mesh)
    model._kerasdist_fsdp = strategy
    model.call = _sharded_call(model.call, strategy, model)
    # the backward pass too: a plain tensor the forward mixed with a DTensor (an LSTM's zero initial state times a
    # sharded gate) is saved plain, and its gradient's product is mixed again (the fuzzer's seed 3004)
    model.train_step = _replicating(model.train_step)
    # values written whole (EarlyStopping's restore_best_weights, a user's): each rank keeps its shard of them
    model.set_weights = _replicating(model.set_weights)
    model.load_weights = _replicating(model.load_weights)
    model.save = _saved_by_rank0(model, model.save, strategy)
    model.save_weights = _saved_by_rank0(model, model.save_weights, strategy)
    model.get_weights = _gathered(model, model.get_weights)


@kerasdist.hookimpl(specname="kerasdist_adjust_call")
def adjust_fsdp_call(method, call_kwargs, model, strategy, spec):
    """Writing callbacks: every rank gathers the full weights, rank 0 writes them (callbacks.fsdp_callbacks)."""
    if not isinstance(spec, FullySharded) or strategy.mesh is None:
        return
    from . import callbacks

    callbacks.fsdp_callbacks(call_kwargs, strategy.rank, lambda model: unsharded(_held_variables(model)))


@kerasdist.hookimpl(specname="kerasdist_run_call")
def run_fsdp_call(method, call, call_kwargs, model, strategy, spec):
    """Keras's own fit/evaluate/predict with plain tensors treated as replicated, callbacks included: a callback
    writing whole values into sharded variables (EarlyStopping's restore_best_weights: the fuzzer's seed 5008,
    DTensor's raw "aten.copy_.default got mixed torch.Tensor and DTensor" at the end of fit) keeps each rank's
    shard of them."""
    if not isinstance(spec, FullySharded) or strategy.mesh is None:
        return None
    from kerasdist.plugin_tools import implicitly_replicated

    with implicitly_replicated():
        return call(**call_kwargs)


@kerasdist.hookimpl(specname="kerasdist_adjust_compile")
def shard_optimizer(compile_kwargs, model, strategy, spec):
    if not isinstance(spec, FullySharded) or strategy.mesh is None:
        return
    optimizer = compile_kwargs.get("optimizer")
    if optimizer is None or "_kerasdist_fsdp" in optimizer.__dict__:
        return
    optimizer._kerasdist_fsdp = strategy
    optimizer.build = _sharded_build(optimizer, optimizer.build, strategy)
    if optimizer.built:  # built before compile: its slots are full copies until sharded here
        _shard_slots(optimizer, strategy)
    optimizer.apply = _replicating(optimizer.apply)


def check_trainer_leaves_distribution_to_us():
    """A Keras whose torch trainer wraps the model in DistributedDataParallel and sums every metric over the
    ranks by itself (3.16, keras-team/keras#23316) would fight fsdp's sharded weights: one clear error."""
    from kerasdist.plugin_tools import keras_wraps_ddp

    if keras_wraps_ddp():
        import keras

        raise KerasdistError(
            f"fsdp: Keras {keras.__version__}'s torch trainer wraps the model in DistributedDataParallel and "
            "all-reduces its metrics by itself, which DTensor-sharded weights do not support; on this Keras use "
            "distribute=\"data_parallel\" (or keras.distribution.ModelParallel), or install Keras 3.15 "
            "(pip install 'keras>=3.15,<3.16') for fsdp.")


def shard_variable(variable, mesh):
    """The variable's tensor becomes this rank's shard (rank 0's values are scattered: every rank starts equal)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from kerasdist.plugin_tools import replace_variable_tensor

    value = variable.value
    if isinstance(value, DTensor):
        return
    shape = tuple(value.shape)
    placement = Shard(0) if 1 <= len(shape) <= 2 and shape[0] % mesh.size() == 0 else Replicate()
    tensor = distribute_tensor(value.detach(), mesh, [placement])
    replace_variable_tensor(variable, torch.nn.Parameter(tensor, requires_grad=bool(value.requires_grad)))


def _replicating(function):
    """Run ``function`` with plain tensors treated as replicated DTensors (learning rate, step counter)."""
    def run(*args, **kwargs):
        from kerasdist.plugin_tools import implicitly_replicated

        with implicitly_replicated():
            return function(*args, **kwargs)

    return run


def _sharded_call(call, strategy, model):
    """This rank's rows of the global batch in (a ``Shard(0)`` DTensor), the global batch's outputs out; the
    trainable weights gathered for the call, as FSDP does (below)."""
    import keras

    def sharded_call(inputs, *args, **kwargs):
        from torch.distributed.tensor import DTensor, Shard
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from kerasdist.plugin_tools import implicitly_replicated

        def mine(tensor):
            if not hasattr(tensor, "shape") or not len(tensor.shape) or isinstance(tensor, DTensor):
                return tensor
            rows = tensor.shape[0]
            per = -(-rows // strategy.world_size)  # torch.chunk's split, which Shard(0) uses
            start, stop = min(rows, strategy.rank * per), min(rows, (strategy.rank + 1) * per)
            return DTensor.from_local(tensor[start:stop], strategy.mesh, [Shard(0)], run_check=False,
                                      shape=tensor.shape, stride=tensor.stride())

        # attention as plain matmul/softmax ops: DTensor has no sharding strategy for the backward of CPU flash
        # attention (the fuzzer's seed 2002: a raw NotImplementedError at the first step)
        with implicitly_replicated(), sdpa_kernel([SDPBackend.MATH]), _gathered_for_the_call(model, strategy):
            try:
                outputs = call(keras.tree.map_structure(mine, inputs), *args, **kwargs)
            except RuntimeError as error:
                uneven = (_rows(inputs) or 0) % strategy.world_size
                if not uneven or not any(text in str(error) for text in ("unevenly", "reshape sharded dimension")):
                    raise
                raise KerasdistError(
                    f"distribute='fsdp' cannot run this model on a batch of {_rows(inputs)} rows over "
                    f"{strategy.world_size} ranks: a layer reshapes the rows (an EinsumDense, e.g. in "
                    "MultiHeadAttention, or a recurrent layer), which torch's DTensor cannot do with rows sharded "
                    "unevenly. Use batch sizes "
                    f"(fit's, evaluate's, predict's) and row counts divisible by {strategy.world_size}, or "
                    "distribute='data_parallel'.") from error
        return keras.tree.map_structure(
            lambda t: t.full_tensor() if isinstance(t, DTensor) else t, outputs)

    return sharded_call


@contextlib.contextmanager
def _gathered_for_the_call(model, strategy):
    """Each trainable weight's shard all-gathered (a ``Replicate()`` DTensor, through autograd) while the model runs:
    every layer computes its rows with whole weights, and each gradient is reduce-scattered back onto the shard.
    Left to DTensor, a matmul with a row-sharded kernel shards its input's features instead, and the backward pass
    then reshapes feature-sharded gradients (Flatten after a Conv2D: DTensor's raw "Cannot unflatten unevenly
    sharded tensor", the fuzzer's seed 4000)."""
    from torch.distributed.tensor import DTensor, Replicate

    from kerasdist.plugin_tools import replace_variable_tensor, variable_tensor

    shards = [(variable, variable_tensor(variable)) for variable in model.trainable_variables]
    shards = [(variable, shard) for variable, shard in shards
              if isinstance(shard, DTensor) and not all(p.is_replicate() for p in shard.placements)]
    try:
        for variable, shard in shards:
            replace_variable_tensor(variable, shard.redistribute(strategy.mesh, [Replicate()]))
        yield
    finally:
        for variable, shard in shards:
            replace_variable_tensor(variable, shard)


def _rows(inputs):
    import keras

    leaf = next((t for t in keras.tree.flatten(inputs) if hasattr(t, "shape") and len(t.shape)), None)
    return None if leaf is None else leaf.shape[0]


def _sharded_build(optimizer, build, strategy):
    def sharded_build(variables):
        build(variables)
        _shard_slots(optimizer, strategy)

    return sharded_build


def _shard_slots(optimizer, strategy):
    for slot in optimizer.variables:
        if len(slot.shape):  # the step counter and other scalars stay plain (implicitly replicated)
            shard_variable(slot, strategy.mesh)


def _held_variables(model):
    optimizer = getattr(model, "optimizer", None)
    return list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])


@contextlib.contextmanager
def unsharded(variables):
    """Inside, the variables hold their full tensors (gathered: every rank must enter); their shards after."""
    import torch
    from torch.distributed.tensor import DTensor

    from kerasdist.plugin_tools import replace_variable_tensor

    shards = [(variable, variable.value) for variable in variables if isinstance(variable.value, DTensor)]
    try:
        with torch.no_grad():
            for variable, shard in shards:
                replace_variable_tensor(variable, torch.nn.Parameter(shard.full_tensor(),
                                                                     requires_grad=shard.requires_grad))
        yield
    finally:
        for variable, shard in shards:
            replace_variable_tensor(variable, shard)


def _gathered(model, read):
    """``read`` (``model.get_weights``) on every rank with the full weights: a collective, as ``full_tensor``."""
    def gathered(*args, **kwargs):
        with unsharded(_held_variables(model)):
            return read(*args, **kwargs)

    return gathered


def _saved_by_rank0(model, save, strategy):
    """``model.save``/``save_weights`` called on every rank: all gather, rank 0 writes, all wait for the file.
    Called with the weights already gathered (a ModelCheckpoint on rank 0), it just writes."""
    def saved_by_rank0(*args, **kwargs):
        from torch.distributed.tensor import DTensor

        variables = _held_variables(model)
        if not any(isinstance(variable.value, DTensor) for variable in variables):
            return save(*args, **kwargs)
        import torch.distributed as dist

        with unsharded(variables):
            result = save(*args, **kwargs) if strategy.rank == 0 else None
        dist.barrier()
        return result

    return saved_by_rank0
