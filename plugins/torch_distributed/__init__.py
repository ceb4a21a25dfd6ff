"""distribute="data_parallel" (also "ddp") on the PyTorch backend: one process per device, gradients averaged
through torch.distributed (gloo on CPU, NCCL on GPUs), ``batch_size`` the global batch.

Launch with ``kerasdist launch -n N train.py`` or ``torchrun --nproc-per-node N train.py``; a TF_CONFIG or
Slurm cluster works too. The word is the same as on TensorFlow and JAX (plugin keras_distribution): the
registry picks this implementation when Keras runs on torch.

On a Keras whose torch trainer wraps the model in DistributedDataParallel itself (3.16, keras-team/keras#23316)
kerasdist turns that off for the models it distributes and averages as on 3.15: DDP weighs every rank's
gradient equally (wrong for an uneven last batch or an empty share), averages only steps that call the model
through it (not a custom ``train_step``, which calls ``self``), and the 3.16 trainer's metrics sum would sum
kerasdist's already summed states again. A model is never reduced twice.
"""

import dataclasses
import weakref
from typing import Optional

import kerasdist
from kerasdist.plugin_tools import (check_choice, check_number, keep_keras_from_wrapping_ddp, keras_backend,
                                    optimizers_held_by)

from . import group, launching  # the modules that use Keras are imported by the hooks (none at plugin loading)
from .sharding import (adjust_fsdp_call, create_fsdp_group, register_fsdp, run_fsdp_call, shard_model,  # noqa: F401
                       shard_optimizer)  # distribute="fsdp"

__all__ = ["TorchDataParallelSpec"]

NAME = "data_parallel"


@dataclasses.dataclass
class TorchDataParallelSpec(kerasdist.StrategySpec):
    """Every process holds every weight; each global batch is split across the processes.

    :param sync_batch_norm: BatchNormalization statistics over the whole global batch (one all-reduce per
        layer and step, and one in its backward pass).
    :param backend: the torch.distributed backend; None: gloo on CPU, NCCL when CUDA is available.
    :param timeout_s: how long a collective waits for the other ranks before failing (a hung rank).
    :param backup: keep kerasdist's private BackupAndRestore backup of each ``fit`` (rank 0 writes it), so
        that the job relaunched after a failure resumes at the epoch it was in.
    :param backup_dir: where (visible to every rank); default: one folder per job under
        KERASDIST_BACKUP_DIR, else ``~/.cache/kerasdist/backups``.
    :param keep_freed_memory: on CPU, set glibc's allocator to keep freed host memory for reuse (up to
        512 MiB; process-wide) instead of taking fresh pages from the kernel every step; False leaves it as is.
        Skipped when ``LD_PRELOAD``, ``GLIBC_TUNABLES`` or glibc's ``MALLOC_*_THRESHOLD_``/``MALLOC_TOP_PAD_``/
        ``MALLOC_MMAP_MAX_`` are set. Applied at every compile that asks for it (the first one sets it).
    """

    sync_batch_norm: bool = False
    backend: Optional[str] = None
    timeout_s: float = 300.0
    backup: bool = True
    backup_dir: Optional[str] = None
    keep_freed_memory: bool = True

    def __post_init__(self):
        self.backend = check_choice(self.backend, "backend", "data_parallel (torch)", group.TORCH_BACKENDS,
                                    allow_none=True)
        check_number(self.timeout_s, "timeout_s", "data_parallel (torch)", minimum=0, inclusive_minimum=False)

    def identity(self):
        return ("torch", self.backend, self.timeout_s)  # one process group per process


# -- registration, resolution, launch ---------------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register(NAME, TorchDataParallelSpec, aliases=("ddp", "data-parallel", "dataparallel"), backends=("torch",),
             requires=("torch",), extra="torch",
             description="Replicated weights, one process per device, the global batch split across the "
                         "processes; gradients averaged through torch.distributed (gloo on CPU, NCCL on GPUs).")


@kerasdist.hookimpl(tryfirst=True)
def kerasdist_auto_strategy(cluster):
    return NAME if keras_backend() == "torch" else None


@kerasdist.hookimpl
def kerasdist_detect_cluster(environ):
    return launching.detect(environ)


@kerasdist.hookimpl(trylast=True)
def kerasdist_launch_environment(worker, environ):
    launching.launch_environment(worker, environ)


# -- compile ------------------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_create_strategy(spec, cluster):
    if not isinstance(spec, TorchDataParallelSpec):
        return None
    return group.join(cluster, spec.backend, spec.timeout_s)


def _own(spec, strategy):
    return isinstance(spec, TorchDataParallelSpec) and isinstance(strategy, group.TorchDataParallel)


@kerasdist.hookimpl
def kerasdist_prepare_model(model, strategy, spec):
    if not _own(spec, strategy):
        return
    import keras

    if keras.distribution.distribution() is not None:
        raise kerasdist.KerasdistError(
            f"distribute={NAME!r} and keras.distribution.set_distribution({type(keras.distribution.distribution()).__name__}"
            "(...)) were both given; on torch kerasdist distributes the model itself: remove the "
            "set_distribution call (or pass that distribution as distribute= on JAX).")
    if strategy.world_size > 1:  # rank 0's values reach every rank at the next call, after its agreement check:
        _FROM_RANK0.add(model)     # a collective here would pair with another rank's call (a tuner's next trial)


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    if not _own(spec, strategy) or strategy.world_size < 2:
        return
    other = sorted(_loss_reductions(compile_kwargs.get("loss")) - set(MEAN_REDUCTIONS))
    if other:  # each rank's gradient is weighted as that of a mean over its rows
        raise kerasdist.KerasdistError(
            f"distribute={NAME!r} (torch) averages the ranks' gradients of a loss that is a mean over rows; a loss "
            f"with reduction {', '.join(map(repr, other))} would train other weights than one process: give every "
            f"loss a mean reduction ({', '.join(MEAN_REDUCTIONS)}; Keras's default) and scale the learning rate "
            "by the global batch size if you need a sum.")
    if spec.keep_freed_memory and strategy.device == "cpu":  # per compile: the strategy is shared by identity
        from . import allocator

        allocator.keep_freed_memory()
    if spec.sync_batch_norm:
        from . import training

        training.synchronize_batch_norm(model)


#: the loss reductions that average over rows (Keras's default "sum_over_batch_size" among them)
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _loss_reductions(loss):
    """The reductions of compile's losses: a ``keras.losses.Loss``'s own, Keras's default for names/functions."""
    import keras

    return {str(getattr(item, "reduction", "sum_over_batch_size")) for item in keras.tree.flatten(loss)
            if item is not None}


#: models compiled since their last call: every rank takes rank 0's values at the start of the next one
_FROM_RANK0 = weakref.WeakSet()


# -- fit / evaluate / predict -----------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, strategy, spec):
    if not _own(spec, strategy):
        return
    from . import callbacks, data

    if strategy.world_size > 1 and method != "predict":  # before rank 0's writers are dropped (a tuner's trial)
        from kerasdist.plugin_tools import check_agreement

        from .keras_order import _sum_arrays
        check_agreement(method, model, call_kwargs, rank=strategy.rank, size=strategy.world_size,
                        sum_arrays=_sum_arrays, word=getattr(spec, "name", NAME))
    callbacks.only_rank0_writes(call_kwargs, strategy.rank)
    if strategy.world_size < 2 or method == "predict":
        return
    if method == "fit":
        callbacks.add_backup(call_kwargs, spec, model, strategy)
    name = f"{NAME} (torch)"
    validation_batch = call_kwargs.get("validation_batch_size") or call_kwargs.get("batch_size") or 32  # Keras's
    if method == "fit":
        data.split_validation(call_kwargs)
    view = data.rank_view(method, call_kwargs.get("x"), call_kwargs, strategy.rank, strategy.world_size, name)
    if view is not None:
        call_kwargs.update(x=view, y=None, sample_weight=None, batch_size=None)
        if method == "fit":
            call_kwargs["shuffle"] = False
    validation = call_kwargs.get("validation_data")
    if method == "fit" and validation is not None:
        if isinstance(validation, (tuple, list)) and data.is_arrays(validation[0]):
            parts = list(validation) + [None] * (3 - len(validation))
            kwargs = {"y": parts[1], "sample_weight": parts[2],
                      "batch_size": validation_batch}  # fit's batch_size is None by now (x is this rank's view)
            view = data.rank_view("evaluate", parts[0], kwargs, strategy.rank, strategy.world_size, name)
        else:
            view = data.rank_view("evaluate", validation, {}, strategy.rank, strategy.world_size, name)
        if view is not None:
            call_kwargs["validation_data"] = view


@kerasdist.hookimpl
def kerasdist_run_call(method, call, call_kwargs, model, strategy, spec):
    if not _own(spec, strategy):
        return None
    keep_keras_from_wrapping_ddp(model)  # Keras 3.16's own DDP: kerasdist averages (weighted by rows) instead
    if strategy.world_size < 2:
        return None
    from . import predicting, training

    if method == "predict":
        _rank0_values_since_compile(model, training)
        return predicting.predict(call, call_kwargs, strategy.rank, strategy.world_size)
    if not model.built:  # built anywhere, or not yet: built here from a batch, then rank 0's values everywhere
        from kerasdist.plugin_tools import symbolic_build

        from .data import RankShare

        x = call_kwargs.get("x")
        if isinstance(x, RankShare) and len(x):
            symbolic_build(model, x.build_batch())
    training.install(model)
    if method == "fit" and model.built:
        _FROM_RANK0.discard(model)
        training.broadcast_from_rank0(list(model.variables)  # every optimizer's state (a GAN's two) too
                                      + [v for o in optimizers_held_by(model) for v in o.variables])
    _rank0_values_since_compile(model, training)
    result = call(**call_kwargs)
    if method == "fit":  # fit returns once rank 0's callbacks wrote their files (a next trial may read them)
        training.barrier()
    return result


def _rank0_values_since_compile(model, training):
    if model in _FROM_RANK0 and model.built:
        training.broadcast_from_rank0(model.variables)
    _FROM_RANK0.discard(model)
