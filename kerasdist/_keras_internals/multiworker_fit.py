"""Keras 3's TensorFlow trainer under a multi-worker MultiWorkerMirroredStrategy: its first-batch build
and its log reduction; and the first-batch build of every model kerasdist moved under a strategy (part of
kerasdist._keras_internals)."""

from .. import process_state
from . import versions

# -- multi-worker (MultiWorkerMirroredStrategy) --------------------------------
#
# Stock Keras 3.15 + TF 2.21 cannot ``fit`` under a multi-worker strategy
# (keras-team/keras#20585, tensorflow/tensorflow#72388): ``_maybe_symbolic_build``
# reduces a PerReplica data batch across workers, and ``reduce_per_replica``
# reduces scalar logs with ``axis=0``. Both paths always raise under a
# multi-worker MultiWorkerMirroredStrategy, so the patches below only change
# code paths that cannot work today; every other strategy takes Keras's code.

def _patches():
    """What the installed fixes replaced: name -> (owner, attribute, Keras's own). Kept across
    ``process_state.reset()``: the patches stay on Keras's classes until uninstalled."""
    return process_state.slot("kerasdist.multiworker_fit_patches", dict, keep=True)


#: set on a model kerasdist moved under a strategy (strategy_binding.move_to_strategy)
MOVED_ATTR = "_kerasdist_moved"


def build_from_input_structure(model, strategy, iterator):
    """Keras's first-batch build (``Trainer._symbolic_build``) from the structure of the input's batches
    (its ``tf.data`` ``element_spec``), without reading a batch. Keras's own build opens one extra iterator of
    the user's data before epoch 1 (``TensorFlowTrainer._maybe_symbolic_build``, whenever a strategy is
    bound): a ``shuffle(reshuffle_each_iteration=True)`` pipeline then trained epoch k on permutation k+1, a
    threaded PyDataset on a rotated batch order, a random augmentation map drew twice. Where the structure
    may not build the model (an unbuilt model, and a dimension past the rows unknown there: a layer would keep
    it), or fails to, one batch is read as Keras does."""
    import tensorflow as tf

    try:
        structure = iterator.data_adapter.get_tf_dataset().element_spec
        if model.built or all(spec.shape.rank is not None and None not in spec.shape[1:]
                              for spec in tf.nest.flatten(structure)):
            with strategy.scope():
                model._symbolic_build(data_batch=structure)
            _metrics_under(model, strategy)
            return
    except Exception:  # noqa: BLE001 - whatever the structure could not build: Keras's way below
        pass
    _build_from_first_batch(model, strategy, iterator)
    _metrics_under(model, strategy)


#: strategy_binding.move_metrics_to_strategy, set by strategy_binding when it is imported (it imports this module:
#: a registration, not an import back, keeps the modules acyclic)
METRICS_MOVER = []


def _metrics_under(model, strategy):
    for move in METRICS_MOVER:
        move(model, strategy)


def _build_from_first_batch(model, strategy, iterator):
    """Keras's own way (one batch read; this worker's first replica's part, whose shapes a multi-worker
    PerReplica batch cannot be reduced to)."""
    import tensorflow as tf
    from keras import tree

    for _, _, it in iterator:
        data_batch = tree.map_structure(
            lambda v: (strategy.experimental_local_results(v)[0]
                       if isinstance(v, tf.distribute.DistributedValues) else v),
            next(it))
        break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


def keras_array_batches(x, y, sample_weight, batch_size, shuffle):
    """The ``tf.data.Dataset`` of batches Keras's ``fit`` makes of in-memory arrays (``ArrayDataAdapter``), its
    shuffle included: an unseeded ``tf.random.shuffle`` inside the pipeline, so with the same global seed
    (``keras.utils.set_random_seed``) every process draws the permutation one process's ``fit`` draws."""
    import tensorflow as tf

    adapter = versions.locate("array_data_adapter")(x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                                                    shuffle=shuffle)
    # its flat_map hides the number of batches, which Keras's fit takes from the adapter: without it an epoch
    # ends at an exhausted iterator, one step late (epoch logs counted 72 rows of 64)
    return adapter.get_tf_dataset().apply(tf.data.experimental.assert_cardinality(adapter.num_batches))


def tf_global_seed():
    """TensorFlow's global seed (``tf.random.set_seed``, which ``keras.utils.set_random_seed`` calls), or None."""
    from tensorflow.python.eager import context

    return context.global_seed()


def is_multiworker_strategy(strategy):
    """True for a MultiWorkerMirroredStrategy spanning more than this process."""
    import tensorflow as tf

    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def install_multiworker_fit_fixes():
    """Make Keras 3's TF trainer work under a multi-worker strategy, and build every model kerasdist moved
    under a strategy from its input's structure (:func:`build_from_input_structure`); idempotent, True once
    installed.

    Runs when a worker joins its cluster, at ``import kerasdist``, and at every compile under a tf.distribute
    strategy (``strategy_binding.move_to_strategy``): on a Keras that lacks a piece it
    replaces (``versions.PIECES``) it changes nothing and returns False, and compiling under the
    multi-worker strategy raises the KerasdistError naming that piece."""
    patches = _patches()
    if patches:
        return True
    if versions.missing("tf_trainer_build", "tf_reduce_per_replica"):
        return False
    trainer, build_name = versions.owner_of("tf_trainer_build")
    trainer_module, reduce_name = versions.owner_of("tf_reduce_per_replica")
    original_build = getattr(trainer, build_name)
    original_reduce = getattr(trainer_module, reduce_name)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if (strategy is None or iterator is None
                or not (is_multiworker_strategy(strategy) or getattr(self, MOVED_ATTR, False))):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        build_from_input_structure(self, strategy, iterator)

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and is_multiworker_strategy(strategy):
            return _mean_over_workers(values, strategy)
        return original_reduce(values, strategy, reduction)

    patches["build"] = (trainer, build_name, original_build)
    patches["reduce"] = (trainer_module, reduce_name, original_reduce)
    setattr(trainer, build_name, _maybe_symbolic_build)
    setattr(trainer_module, reduce_name, reduce_per_replica)
    if not versions.missing("py_dataset_enqueuer_generator"):
        _stop_threaded_py_datasets_on_the_main_thread_only(patches)
    return True


def _stop_threaded_py_datasets_on_the_main_thread_only(patches):
    """A threaded PyDataset's batches (``workers`` > 1) come from Keras's generator that stops the enqueuer when
    it is read past the epoch's last batch. One process never reads past it, but a strategy's input pipeline
    prefetches the next element from tf.data's thread: that stop then raced the main thread's ``on_epoch_end``
    and ``on_epoch_begin`` and, landing after the next epoch's start, stopped that epoch's enqueuer and queued
    its first batches ahead of a fresh run of all of them: the epoch trained in another order than one process
    (about 1 run in 5 on a loaded machine). The generator is given its epoch's batches and never resumed after
    the last one; ``on_epoch_end`` (Keras's, on the main thread) stops the enqueuer as in one process."""
    owner, name = versions.owner_of("py_dataset_enqueuer_generator")
    original = getattr(owner, name)

    def _finite_enqueuer_generator(self):
        batches = original(self)
        for _ in range(self.num_batches):
            try:
                yield next(batches)
            except StopIteration:
                return

    patches["py_dataset_generator"] = (owner, name, original)
    setattr(owner, name, _finite_enqueuer_generator)


def _mean_over_workers(values, strategy):
    """Keras's per-step logs averaged over the workers: float scalars through the strategy's
    log summer when one is set (one message for all of them), the rest by ``strategy.reduce``."""
    import keras
    import tensorflow as tf
    from keras import tree

    # a metric's variable returned as its result (keras.io's CategoricalTruePositives): its value (a Keras
    # variable has a dtype name, and strategy.reduce takes no Keras variable)
    flat = [tf.convert_to_tensor(v) if isinstance(v, keras.Variable) else v for v in tree.flatten(values)]
    summer = _log_summers().get(id(strategy))
    local = [strategy.experimental_local_results(v) for v in flat]
    fast = [i for i, v in enumerate(flat) if summer is not None and len(local[i]) == 1
            and local[i][0].shape.rank == 0 and local[i][0].dtype.is_floating]
    means = [None if i in fast else strategy.reduce("MEAN", v, axis=None if v.shape.rank == 0 else 0)
             for i, v in enumerate(flat)]
    if fast:
        for i, total in zip(fast, summer[1]([local[i][0] for i in fast])):
            means[i] = total / summer[0]
    return tree.pack_sequence_as(values, means)


def _log_summers():
    """id(strategy) -> (number of workers, function summing a list of tensors over the workers). Reset by
    ``process_state.reset()``: logs are then averaged by TensorFlow's reduce, which gives the same means."""
    return process_state.slot("kerasdist.log_summers", dict)


def set_log_summer(strategy, workers, sum_tensors):
    """Average ``fit``/``evaluate`` logs under ``strategy`` with ``sum_tensors`` (None: TensorFlow's reduce)."""
    if sum_tensors is None:
        _log_summers().pop(id(strategy), None)
    else:
        _log_summers()[id(strategy)] = (workers, sum_tensors)


def uninstall_multiworker_fit_fixes():
    """Restore Keras's own functions (tests)."""
    patches = _patches()
    for key in ("build", "reduce", "py_dataset_generator"):
        if key in patches:
            owner, name, original = patches.pop(key)
            setattr(owner, name, original)
