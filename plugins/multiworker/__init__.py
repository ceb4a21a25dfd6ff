"""distribute="multiworker": synchronous data parallelism across processes and machines.

Each process gets a cluster (TF_CONFIG, Slurm; see ``cluster_env``). At ``import
kerasdist`` the process joins the cluster and creates its
``tf.distribute.MultiWorkerMirroredStrategy`` (collective ops can only be set up
before TensorFlow runs an op); ``compile(distribute="multiworker")`` uses it.
Only the chief writes progress, checkpoints and TensorBoard events, and
``BackupAndRestore`` is on by default so that a relaunch resumes training.
"""

import os
import sys

import kerasdist
from kerasdist import ClusterConfigError, KerasdistError
from kerasdist.plugin_tools import (check_agreement, input_kind, is_dataset, keras_backend, number_from_env,
                                    private_backups, set_process_group)

from .gradients import (agree_on_ring, all_gather_text, gradient_transport, same_global_seed_everywhere,
                        use_ring)
from .probe import keep_ring_if_faster
from .join import TooLate, check_port_free, join_cluster, state
from .options import (BACKUP_DIR_VAR, BYTES_PER_PACK_VAR, COLLECTIVE_TIMEOUT_VAR, COMMUNICATION_VAR,
                      DEFAULT_JOIN_TIMEOUT, JOIN_TIMEOUT_VAR, SCRATCH_DIR_VAR, STRATEGY_FREE_VAR, CollectiveOptions,
                      MultiWorker, check_options_match, check_spec)

__all__ = ["MultiWorker", "CollectiveOptions", "gradient_transport", "check_port_free", "is_worker_cluster",
           "BACKUP_DIR_VAR", "BYTES_PER_PACK_VAR", "COLLECTIVE_TIMEOUT_VAR", "COMMUNICATION_VAR",
           "JOIN_TIMEOUT_VAR", "SCRATCH_DIR_VAR"]


# -- registration and choice -----------------------------------------------------

@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("multiworker", MultiWorker, aliases=("multi_worker", "multi-worker"),
             description="Synchronous data parallelism across processes/machines over gRPC collectives "
                         "(tf.distribute.MultiWorkerMirroredStrategy); cluster from TF_CONFIG or Slurm, "
                         "or start local workers with `kerasdist launch -n N`.")


def is_worker_cluster(cluster):
    """A cluster multiworker can train on: chief/worker tasks, no parameter servers."""
    return (not cluster.is_local and not cluster.has_parameter_servers
            and cluster.source in ("tf_config", "slurm")
            and cluster.task_type in ("chief", "worker"))


@kerasdist.hookimpl
def kerasdist_auto_strategy(cluster):
    return "multiworker" if is_worker_cluster(cluster) else None


@kerasdist.hookimpl
def kerasdist_process_start(cluster, environ):
    if not is_worker_cluster(cluster) or keras_backend() != "tensorflow":
        return
    options = CollectiveOptions.from_env(environ)
    join_timeout = number_from_env(environ, JOIN_TIMEOUT_VAR, float, DEFAULT_JOIN_TIMEOUT)
    state.cluster, state.options = cluster, options
    try:
        state.strategy = join_cluster(cluster, options, join_timeout)
    except TooLate as exc:
        state.error = exc


@kerasdist.hookimpl
def kerasdist_listeners(cluster):
    if not is_worker_cluster(cluster) or keras_backend() != "tensorflow":
        return None
    address = cluster.cluster[cluster.task_type][cluster.task_index]
    host = address.rsplit(":", 1)[0]
    return [{"what": "multiworker: TensorFlow's gRPC server (collectives, coordination); no authentication",
             "address": address.replace(host, "*", 1), "interfaces": "all"},
            {"what": "multiworker: kerasdist's TCP ring for gradients (a free port, job secret checked)",
             "address": f"{host}:<free port>", "interfaces": "the address's"}]


# -- kerasdist launch ---------------------------------------------------------------

_LAUNCH_OPTIONS = (  # (option, environment variable it sets in each worker)
    ("join_timeout", JOIN_TIMEOUT_VAR), ("communication", COMMUNICATION_VAR),
    ("bytes_per_pack", BYTES_PER_PACK_VAR), ("collective_timeout", COLLECTIVE_TIMEOUT_VAR),
    ("backup_dir", BACKUP_DIR_VAR),
)


@kerasdist.hookimpl
def kerasdist_add_launch_arguments(parser):
    parser.add_argument("--join-timeout", type=float, default=None,
                        help=f"seconds to wait for all workers to join ({JOIN_TIMEOUT_VAR}, "
                             f"default {DEFAULT_JOIN_TIMEOUT:g})")
    parser.add_argument("--communication", choices=("auto", "tcp", "ring", "nccl"), default=None,
                        help=f"collective implementation ({COMMUNICATION_VAR})")
    parser.add_argument("--bytes-per-pack", type=int, default=None,
                        help=f"gradient pack size in bytes for all-reduce ({BYTES_PER_PACK_VAR})")
    parser.add_argument("--collective-timeout", type=float, default=None,
                        help=f"abort a collective that takes longer ({COLLECTIVE_TIMEOUT_VAR})")
    parser.add_argument("--backup-dir", default=None,
                        help=f"where BackupAndRestore keeps its backup ({BACKUP_DIR_VAR})")


@kerasdist.hookimpl
def kerasdist_launch_environment(args, environ):
    for option, variable in _LAUNCH_OPTIONS:
        value = getattr(args, option, None)
        if value is not None:
            environ[variable] = str(value)


# -- compile -----------------------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_create_strategy(spec, cluster):
    if not isinstance(spec, MultiWorker):
        return None
    check_spec(spec)
    if state.error is not None:
        raise state.error
    if state.strategy is None:
        if cluster.is_local:
            raise ClusterConfigError(
                "distribute='multiworker' needs a cluster, and none was found: set TF_CONFIG in each worker, "
                "run under Slurm's srun, or start the workers with `kerasdist launch -n N script.py`.")
        if not is_worker_cluster(cluster):
            raise ClusterConfigError(
                f"distribute='multiworker' cannot run on this cluster ({cluster.source}, task "
                f"{cluster.task_type}, jobs {sorted(cluster.cluster)}): it needs chief/worker tasks and no "
                "'ps' job (parameter servers take a different strategy).")
        state.cluster = cluster
        state.options = CollectiveOptions.from_env(os.environ)
        state.strategy = join_cluster(cluster, state.options,
                                      number_from_env(os.environ, JOIN_TIMEOUT_VAR, float, DEFAULT_JOIN_TIMEOUT))
    check_options_match(spec, state.options)
    if _trains_strategy_free(spec):
        import tensorflow as tf

        return tf.distribute.get_strategy()  # plain Keras in each worker; the ring carries the rest
    return state.strategy


def _trains_strategy_free(spec):
    """Whether ``spec`` trains strategy-free here. The ring is agreed (and, under ``auto``, measured against
    TensorFlow's collectives) at the first compile that could use it; every worker reaches the same answer."""
    from . import strategy_free  # imports Keras: not at plugin loading

    _check_every_worker_has(strategy_free.given_setting(os.environ))
    mode = strategy_free.setting(os.environ)
    if mode == "off" or not strategy_free.supports(spec):
        return False
    if state.ring is None:
        ring = agree_on_ring(state.strategy, state.cluster, state.options)
        state.ring = (ring if mode == "on" else keep_ring_if_faster(ring, None, state.strategy, state.options)) \
            or False
    if state.ring and mode == "on" and state.strategy.extended.should_checkpoint and not state.said_strategy_free:
        state.said_strategy_free = True
        print("kerasdist: multiworker trains strategy-free (KERASDIST_STRATEGY_FREE=on): plain Keras in each "
              "worker, gradients over the TCP ring", file=sys.stderr, flush=True)
    if state.ring:  # other plugins (quantize's ranges) reduce across the workers through it
        set_process_group(state.ring.size, state.ring.rank, state.ring.sum_tensors)
    return bool(state.ring)


def _check_every_worker_has(value):
    """At the first compile: every worker's KERASDIST_STRATEGY_FREE (as given, checked after), which must match
    (else they would take different steps and wait on each other's collectives for ever)."""
    if state.strategy_free_setting is None:
        cluster = state.cluster
        texts, _ = all_gather_text(state.strategy, f"{cluster.task_type} {cluster.task_index}|{value}")
        tasks = list(dict.fromkeys(texts))  # one row per replica: a worker with 2 GPUs gives two
        if len({text.split("|", 1)[1] for text in tasks}) > 1:
            state.error = ClusterConfigError(
                f"{STRATEGY_FREE_VAR} differs between the workers ("
                + ", ".join(": ".join(text.split("|", 1)) for text in tasks)
                + "), so they would train with different steps: give every worker the same value (`kerasdist "
                "launch` passes its own environment to every worker), or unset it (auto).")
            raise state.error
        state.strategy_free_setting = value


def _strategy_free(strategy):
    return state.strategy is not None and strategy is not state.strategy and bool(state.ring)


@kerasdist.hookimpl
def kerasdist_adjust_compile(compile_kwargs, model, strategy, spec):
    """Keras's gradient_accumulation_steps, and synchronized batch statistics when asked."""
    if isinstance(spec, MultiWorker):
        _refuse_xla_on_cpu_workers(compile_kwargs)
    if isinstance(spec, MultiWorker) and _strategy_free(strategy):
        from . import strategy_free

        strategy_free.adjust_compile(compile_kwargs, model)
    elif isinstance(spec, MultiWorker):
        from kerasdist.plugin_tools import (custom_steps_train_as_one_device, output_losses_weighted_by_share,
                                            replicas_train_as_one_device)

        replicas_train_as_one_device(compile_kwargs, model, strategy, spec.sync_batch_norm)
        custom_steps_train_as_one_device(model, compile_kwargs, "multiworker")
        output_losses_weighted_by_share(model)


def _refuse_xla_on_cpu_workers(compile_kwargs):
    devices = state.strategy.extended.worker_devices if state.strategy is not None else ()
    if compile_kwargs.get("jit_compile") is True and devices and all("CPU" in d.upper() for d in devices):
        raise KerasdistError(
            "distribute='multiworker' on CPU workers cannot train with jit_compile=True: TensorFlow's XLA has no CPU "
            "collectives, and kerasdist's TCP ring cannot be called from an XLA-compiled step. Pass "
            "jit_compile=False or 'auto' (Keras's default, which uses no XLA on CPUs).")


# -- fit / evaluate / predict --------------------------------------------------------

@kerasdist.hookimpl
def kerasdist_prepare_dataset(dataset, kind, method, strategy, spec):
    if isinstance(spec, MultiWorker) and _strategy_free(strategy) and method != "predict":
        from . import inputs

        return inputs.split_dataset(dataset, kind, state.ring, spec.shuffle_seed)
    if not isinstance(spec, MultiWorker) or spec.shard_policy.lower() == "auto" or not is_dataset(dataset):
        return None
    import tensorflow as tf

    policy = {"data": tf.data.experimental.AutoShardPolicy.DATA,
              "file": tf.data.experimental.AutoShardPolicy.FILE,
              "off": tf.data.experimental.AutoShardPolicy.OFF}[spec.shard_policy.lower()]
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


@kerasdist.hookimpl
def kerasdist_adjust_call(method, call_kwargs, model, strategy, spec):
    if not isinstance(spec, MultiWorker):
        return
    if _strategy_free(strategy):
        return _adjust_strategy_free_call(method, call_kwargs, model, spec)
    from . import workers
    from kerasdist.plugin_tools import read_py_datasets_in_one_processs_order

    read_py_datasets_in_one_processs_order(method, call_kwargs, "multiworker")  # MWMS prefetches as Mirrored does
    if method in ("fit", "evaluate"):
        ring = use_ring(model, strategy, method)
        if state.ring:  # else TensorFlow's collectives carry everything: not checked
            check_agreement(method, model, call_kwargs, rank=state.ring.rank, size=state.ring.size,
                            sum_arrays=state.ring.sum_arrays, word="multiworker")
    index = None
    if method == "fit":
        from kerasdist.plugin_tools import may_split_unevenly, set_batch_share_weighting

        # weighting replicas by their batch share costs one small all-reduce per step: only when needed, and
        # over the TCP ring when the gradients take it (a TensorFlow collective costs ~1 ms CPU per step more)
        uneven = may_split_unevenly(call_kwargs, strategy.num_replicas_in_sync)
        if uneven:
            _refuse_loss_scaling_on_uneven_shares(model, strategy.num_replicas_in_sync)
        set_batch_share_weighting(model, uneven, replicas=ring.size if ring else None,
                                  sum_counts=ring.sum_count if ring else None)
        index = private_backups.count_fit()
        keras_order = (call_kwargs.get("shuffle", True) and input_kind(call_kwargs.get("x")) is None
                       and same_global_seed_everywhere(strategy))  # else kerasdist's shared seeded order
        workers.shuffle_arrays_alike(call_kwargs, spec.shuffle_seed + index, keras_order)
    _chief_writes(method, call_kwargs, model, spec, strategy, index)


def _refuse_loss_scaling_on_uneven_shares(model, workers):
    """MultiWorkerMirroredStrategy's step does not yet train under a LossScaleOptimizer (mixed_float16) as one process
    when the workers' shares of a batch differ (the fuzzer's seed 4002: 0.04-0.15 off with an Embedding; a Dense
    model 6.0e-3; even shares and float32 are exact; the strategy-free step 3.2e-5): one clear error, not silent
    wrong training."""
    import keras

    if isinstance(getattr(model, "optimizer", None), keras.optimizers.LossScaleOptimizer):
        raise KerasdistError(
            f"distribute='multiworker' on MultiWorkerMirroredStrategy's step (sync_batch_norm=True or "
            f"KERASDIST_STRATEGY_FREE=off) cannot yet train under mixed_float16 (a LossScaleOptimizer) on batches "
            f"that may split unevenly over the {workers} workers. Use the strategy-free step (the default: leave "
            f"KERASDIST_STRATEGY_FREE unset and sync_batch_norm off), NumPy inputs whose batch size and row count "
            f"divide by {workers}, or mixed_bfloat16 / float32.")


def _adjust_strategy_free_call(method, call_kwargs, model, spec):
    from . import inputs, strategy_free

    ring = state.ring
    check_agreement(method, model, call_kwargs, rank=ring.rank, size=ring.size, sum_arrays=ring.sum_arrays,
                    word="multiworker")
    index = private_backups.count_fit() if method == "fit" else None
    if method in ("fit", "evaluate"):
        strategy_free.install(model, ring)
        inputs.split_call_data(call_kwargs, ring, method, spec.shuffle_seed + index if method == "fit" else None)
    _chief_writes(method, call_kwargs, model, spec, state.strategy, index)
    strategy_free.broadcast_before(method, model, ring, call_kwargs)  # fit: after the backup's restore


def _chief_writes(method, call_kwargs, model, spec, strategy, index):
    """``fit``'s backup; only the chief prints and writes (the others' paths are given back at the end)."""
    from . import backup, workers

    chief = bool(strategy.extended.should_checkpoint)
    if method == "fit" and spec.backup:
        backup.add_backup(call_kwargs, spec, model, strategy, index, chief, private_backups.scratch_dir())
    if method == "fit" and state.ring:  # a next trial of a tuner may read the chief's checkpoint at once
        call_kwargs["callbacks"].append(workers.ChiefFilesWritten(state.ring))
    if not chief:
        if call_kwargs.get("verbose", "auto") != 0:
            call_kwargs["verbose"] = 0
        if method == "fit":
            workers.redirect_writes(call_kwargs, private_backups.scratch_dir())
