"""distribute="horovod": Horovod ring all-reduce for Keras 3, one process per rank.

Launch with ``horovodrun -np 2 -H localhost:2 python train.py``; the script only says
``model.compile(..., distribute="horovod")``. Horovod's own Keras layer is Keras-2 only
(``.ref()`` on variables, horovod#4290), so this plugin does the Keras 3 side itself on
``horovod.tensorflow`` ops:

- gradients: the compiled optimizer is given an ``apply`` that all-reduces gradients with
  ``hvd.grouped_allreduce`` (tensor fusion) first, with the options of Horovod's
  ``DistributedOptimizer`` (op, compression, backward_passes_per_step, sparse_as_dense,
  gradient_predivide_factor, average_aggregated_gradients);
- at the start of each ``fit``/``evaluate`` and epoch the ranks must be in the same call on the same model
  (kerasdist's agreement check: one error naming both sides on every rank, never a hang or two models' gradients
  averaged); at the start of ``fit`` weights and optimizer state are broadcast from rank 0;
- batch and epoch logs (validation included) and ``evaluate`` results are those of every rank's rows: each
  metric's state is summed over the ranks before its result is read (other scalars of a custom step: averaged);
- ``fit``/``evaluate`` data is split between ranks: ``batch_size`` is the global batch (each
  rank takes its part of every batch), as under every strategy; ``batch_size_per_worker=True``
  gives Horovod's semantics (whole batches per rank, global batch = batch_size x ranks);
- checkpoints, TensorBoard, CSV logs and the progress bar run on rank 0 only;
- learning-rate scaling by the world size and Horovod's warm-up schedule, only when asked.
- elastic training (``horovodrun --min-np/--max-np``): :func:`run_elastic` instead of ``fit``.

Each rank is one replica: the strategy is TensorFlow's default strategy.
"""

import itertools
import sys
import warnings

import kerasdist
from kerasdist.plugin_tools import is_dataset, keras_backend, process_state

from .cluster import detect
from .options import (BUILD_COMMAND, CPU_DEFAULTS, HOROVOD_VERSION, Horovod, check_options, check_runtime,
                      import_horovod, unavailable_reason)

#: Public names, imported on first use (they need Keras and Horovod).
_LAZY = {"GradientReducer": "gradients", "distribute_optimizer": "gradients", "scale_learning_rate": "gradients",
         "shard_dataset": "data", "shard_arrays": "data", "BroadcastStateCallback": "callbacks",
         "MetricAverageCallback": "callbacks", "LearningRateWarmupCallback": "callbacks",
         "CommitStateCallback": "callbacks", "average_logs": "callbacks", "broadcast_state": "callbacks",
         "check_same_on_all_ranks": "callbacks", "model_signature": "callbacks", "run_elastic": "elastic",
         "elastic_run": "elastic", "KerasElasticState": "elastic", "elastic_state_class": "elastic"}

__all__ = ["Horovod", "HOROVOD_VERSION", "BUILD_COMMAND", "CPU_DEFAULTS", "check_options", "unavailable_reason",
           *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- registration and availability ----------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("horovod", Horovod, aliases=("hvd",), check=unavailable_reason, install=BUILD_COMMAND,
             description="Horovod ring all-reduce (Gloo or MPI), one process per rank: "
                         "launch with `horovodrun -np N python train.py`.")


# -- cluster: detection, process start, strategy ---------------------------------

@kerasdist.hookimpl(tryfirst=True)
def kerasdist_detect_cluster(environ):
    return detect(environ)


@kerasdist.hookimpl
def kerasdist_auto_strategy(cluster):
    return "horovod" if cluster.source == "horovod" else None


@kerasdist.hookimpl
def kerasdist_listeners(cluster):
    if cluster.source != "horovod":
        return None
    return [{"what": "horovod: Gloo all-reduce ports and horovodrun's rendezvous server, chosen by horovodrun "
                     "(--network-interfaces limits the interfaces; no authentication)",
             "address": "<ports chosen by horovodrun>", "interfaces": "--network-interfaces'"}]


@kerasdist.hookimpl
def kerasdist_process_start(cluster, environ):
    """Under horovodrun: Horovod's CPU defaults, one GPU per local rank, ``hvd.init()``."""
    if cluster.source != "horovod" or keras_backend() != "tensorflow":
        return
    for name, value in CPU_DEFAULTS.items():
        environ.setdefault(name, value)
    if unavailable_reason():
        return  # compile(distribute="horovod") raises with the reason and the fix
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[cluster.extra.get("local_rank", 0) % len(gpus)], "GPU")
    import_horovod().init()


@kerasdist.hookimpl
def kerasdist_create_strategy(spec, cluster):
    if not isinstance(spec, Horovod):
        return None
    import tensorflow as tf

    check_options(spec)
    hvd = import_horovod()
    if cluster.source != "horovod":
        warnings.warn("distribute='horovod' in a process not started by horovodrun: training on this "
                      "one process. Launch it with `horovodrun -np N -H localhost:N python script.py` "
                      "to train on N processes.", stacklevel=2)
    hvd.init()  # a no-op when process start already did it
    check_runtime(spec, hvd)
    if tf.distribute.has_strategy():
        raise kerasdist.StrategyConflictError(
            "compile(distribute='horovod') was called inside a tf.distribute strategy scope; call it "
            "outside any `with strategy.scope():` block (Horovod runs one replica per process).")
    if hvd.size() > 1:  # the ranks train one model: what reduces over them (QAT's int8 ranges) reduces over these
        from kerasdist.plugin_tools import set_process_group

        set_process_group(hvd.size(), hvd.rank(), _sum_tensors(hvd))
    return tf.distribute.get_strategy()


def _sum_tensors(hvd):
    """float32 sums over the ranks, inside a training step (``plugin_tools.set_process_group``'s ``sum_tensors``)."""

    def sum_tensors(tensors):
        return [hvd.allreduce(tensor, op=hvd.Sum) for tensor in tensors]

    return sum_tensors


def _sum_rows(hvd):
    def sum_rows(rows):
        return hvd.allreduce(rows, op=hvd.Sum, name="kerasdist_output_loss_rows")

    return sum_rows


def _wrap_numbers():
    """Numbers the optimizers this process wraps, from 1: the same on every rank running the same script."""
    return process_state.slot("horovod.optimizer_numbers", lambda: itertools.count(1))


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, spec):
    if not isinstance(spec, Horovod):
        return
    import horovod.tensorflow as hvd

    from kerasdist.plugin_tools import output_losses_weighted_by_share

    from .gradients import GradientReducer, constant_learning_rate, distribute_optimizer, scale_learning_rate

    jit = compile_kwargs.get("jit_compile", "auto")
    if jit is True and hvd.size() > 1:
        raise kerasdist.KerasdistError(
            "compile(jit_compile=True, distribute='horovod'): XLA cannot compile Horovod's all-reduce "
            "(this build leaves out Horovod's XLA ops); pass jit_compile=False or 'auto'.")
    compile_kwargs["jit_compile"] = False
    optimizer = compile_kwargs["optimizer"]
    if spec.backward_passes_per_step > 1 and getattr(optimizer, "gradient_accumulation_steps", None):
        raise kerasdist.KerasdistError(
            f"horovod: backward_passes_per_step={spec.backward_passes_per_step} and the optimizer's "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} both accumulate "
            "gradients; use one of them (backward_passes_per_step also saves all-reduces).")
    previous = optimizer.__dict__.get("_kerasdist_horovod")
    reducer = GradientReducer(hvd, spec, name=f"kerasdist_gradients_{next(_wrap_numbers())}")
    reducer.lr_scaled = getattr(previous, "lr_scaled", False)
    distribute_optimizer(optimizer, reducer)
    reducer.count_rows(model)  # weights each rank's gradient by its rows: uneven parts train as one batch
    output_losses_weighted_by_share(model, _sum_rows(hvd))
    if spec.scale_learning_rate and not reducer.lr_scaled:
        scale_learning_rate(optimizer, hvd.size())
        reducer.lr_scaled = True
    if spec.sync_batch_norm:
        from kerasdist.plugin_tools import synchronize_batch_norm

        synchronize_batch_norm(model, sum_across=lambda tensor, name: hvd.allreduce(tensor, op=hvd.Sum, name=name))
    reducer.warmup_target_lr = getattr(previous, "warmup_target_lr", None)
    if spec.warmup_epochs:
        if not constant_learning_rate(optimizer):
            raise kerasdist.KerasdistError(
                f"horovod: warmup_epochs={spec.warmup_epochs} needs a constant (float) learning rate, but "
                "the optimizer uses a schedule; put the warm-up into the schedule or set warmup_epochs=0.")
        if reducer.warmup_target_lr is None:  # fixed once: a fit stopped mid-warm-up must not lower it
            reducer.warmup_target_lr = float(optimizer.learning_rate.numpy())


# -- fit / evaluate: data, callbacks ------------------------------------------------

@kerasdist.hookimpl
def kerasdist_prepare_dataset(dataset, kind, method, spec):
    if not isinstance(spec, Horovod) or not spec.shard or method == "predict":
        return None
    if not is_dataset(dataset) and (spec.batch_size_per_worker or kind not in ("py_dataset", "generator",
                                                                                 "torch_dataloader")):
        return None  # batch_size_per_worker: only tf.data datasets are sharded (others: a warning)
    import horovod.tensorflow as hvd

    if hvd.size() == 1:
        return None
    if spec.batch_size_per_worker:
        from .data import shard_dataset

        return shard_dataset(dataset, hvd.rank(), hvd.size(), method)
    from kerasdist.plugin_tools import split_batches

    # a shuffling DataLoader's order is settled in kerasdist_adjust_call (_same_loader_order), after the ranks'
    # agreement check: no collective of a call may come before it
    return split_batches(dataset, hvd.rank(), hvd.size())


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, spec):
    if not isinstance(spec, Horovod):
        return
    import horovod.tensorflow as hvd

    from .callbacks import BroadcastStateCallback, LearningRateWarmupCallback, MetricAverageCallback, chief_only
    from .data import per_worker_notice, shard_call_data, split_call_data

    rank, size = hvd.rank(), hvd.size()
    if method == "fit":
        from .gradients import reduce_before_loss_scaling

        reduce_before_loss_scaling(model.optimizer)
    callbacks = call_kwargs["callbacks"]
    # first, before any collective of the call; evaluate without average_metrics makes none: a rank may call it alone
    if (size > 1 and (method == "fit" or (method == "evaluate" and spec.average_metrics))
            and not _elastic(callbacks)):
        from kerasdist.plugin_tools import check_agreement

        check_agreement(method, model, call_kwargs, rank=rank, size=size, sum_arrays=_sum_arrays(hvd),
                        word="horovod")  # before rank 0's writers are dropped: a tuner's trial is read from them
    if rank != 0:
        call_kwargs["verbose"] = 0
        callbacks[:] = [c for c in callbacks if not chief_only(c)]
    if size == 1:
        return
    if spec.shard and not spec.batch_size_per_worker and method in ("fit", "evaluate"):
        _same_loader_order(hvd, call_kwargs)
    if spec.shard and method in ("fit", "evaluate"):
        if spec.batch_size_per_worker:
            if rank == 0 and method == "fit":
                print(per_worker_notice(call_kwargs, size), file=sys.stderr, flush=True)
            shard_call_data(call_kwargs, rank, size, method)
        else:
            shuffles = method == "fit" and call_kwargs.get("shuffle", True)
            split_call_data(call_kwargs, rank, size, method, _shared_seed(hvd) if method == "fit" else None,
                            keras_order=bool(shuffles) and _same_global_seed(hvd),
                            same_python_random=lambda: _same_python_random(hvd))
    callbacks = call_kwargs["callbacks"]  # the list itself: a call above may have given call_kwargs a new one
    if spec.average_metrics and method in ("fit", "evaluate"):  # evaluate's result: kerasdist_run_call
        callbacks.insert(0, MetricAverageCallback())
    if method == "fit":
        if spec.warmup_epochs and not any(isinstance(c, LearningRateWarmupCallback) for c in callbacks):
            target = getattr(model.optimizer.__dict__.get("_kerasdist_horovod"), "warmup_target_lr", None)
            callbacks.insert(1, LearningRateWarmupCallback(initial_lr=target, warmup_epochs=spec.warmup_epochs))
        callbacks.append(BroadcastStateCallback())  # last: after any callback that loads state on rank 0


def _elastic(callbacks):
    """Whether this is ``run_elastic``'s fit: a worker that joins later has made fewer calls than the others (the
    agreement check compares the counts); elastic's own state sync puts every worker at one epoch."""
    from .callbacks import CommitStateCallback

    return any(isinstance(callback, CommitStateCallback) for callback in callbacks)


def _sum_arrays(hvd):
    """The ranks' sums of float64 arrays in one Horovod all-reduce (``kerasdist.plugin_tools``'s ``sum_arrays``).
    One name for every such sum: two ranks at different ones fail on Horovod's shape check rather than wait."""

    def sum_arrays(*arrays):
        import numpy as np
        import tensorflow as tf

        arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
        message = np.concatenate([a.ravel() for a in arrays])
        summed = hvd.allreduce(tf.constant(message), op=hvd.Sum, name="kerasdist_sum_arrays").numpy()
        ends = np.cumsum([a.size for a in arrays])[:-1]
        return [part.reshape(a.shape) for part, a in zip(np.split(summed, ends), arrays)]

    return sum_arrays


def _same_loader_order(hvd, call_kwargs):
    """Every rank slices the same global batches of a torch ``DataLoader`` (``x``, or fit's ``validation_data``,
    split by kerasdist_prepare_dataset): where every rank holds the same torch generator states (the same script
    after ``torch.manual_seed`` / ``keras.utils.set_random_seed``, or torch's fixed default seed) each draws one
    process's order as it is; else the shuffling samplers are seeded with one shared seed (issue 35 item 10: they
    always were, another order than one process's: weights 0.0169 off)."""
    from kerasdist.plugin_tools import data_loader_draws_alike, input_kind, seed_shuffling_samplers

    for name in ("x", "validation_data"):
        loader = call_kwargs.get(name)
        if input_kind(loader) == "torch_dataloader" and not data_loader_draws_alike(loader, _sum_arrays(hvd),
                                                                                      hvd.size()):
            seed_shuffling_samplers(loader, _shared_seed(hvd))


def _shared_seed(hvd):
    """A fresh shuffle seed, the same on every rank (rank 0's)."""
    import random

    # SystemRandom: Python's random state stays one process's (Keras draws a PyDataset's shuffle from it)
    return hvd.broadcast_object(random.SystemRandom().randrange(2**31), root_rank=0, name="kerasdist_shuffle_seed")


def _same_global_seed(hvd):
    """Whether every rank set one TensorFlow global seed (``keras.utils.set_random_seed`` with the same value):
    then each draws one process's shuffle of in-memory arrays (before: the shared seed's order, another one).
    Keras 3.16 keys each epoch's shuffle by its number: one process's order whatever the seeds."""
    from kerasdist.plugin_tools import keras_shuffles_by_epoch, tf_global_seed

    if keras_shuffles_by_epoch():
        return True
    seeds = hvd.allgather_object(tf_global_seed(), name="kerasdist_global_seeds")
    return seeds[0] is not None and all(seed == seeds[0] for seed in seeds)


def _same_python_random(hvd):
    """Whether every rank's Python ``random`` state (Keras's PyDataset shuffle draws from it) is the same (or
    Keras 3.16 draws it from the epoch's number: the same everywhere)."""
    from kerasdist.plugin_tools import keras_shuffles_by_epoch, python_random_same_everywhere, sum_by_all_gather

    if keras_shuffles_by_epoch():
        return True

    gather = sum_by_all_gather(lambda value: hvd.allgather_object(value, name="kerasdist_random_states"))
    return python_random_same_everywhere(gather, hvd.size())


@kerasdist.hookimpl
def kerasdist_run_call(method, call, call_kwargs, model, spec):
    """``evaluate``: return the results over every rank (metric states summed; Keras hands callbacks a copy)."""
    if not isinstance(spec, Horovod) or method != "evaluate" or not spec.average_metrics:
        return None
    import horovod.tensorflow as hvd

    if hvd.size() == 1:
        return None
    from kerasdist.plugin_tools import flatten_metrics_in_order

    from .metric_sums import combine_over_ranks

    return_dict = call_kwargs.pop("return_dict", False)
    logs = call(**call_kwargs, return_dict=True)
    combine_over_ranks(hvd, model, logs)
    return logs if return_dict else flatten_metrics_in_order(model, logs)
