"""Callbacks: state broadcast, metric averaging, learning-rate warm-up, elastic commits."""

import numbers

import kerasdist
from kerasdist.plugin_tools import unique_variables, writes_files

from .metric_sums import combine_over_ranks

def chief_only(callback):
    """A callback that writes files (``plugin_tools.writes_files``) or prints Keras's progress bar."""
    return writes_files(callback) or any(cls.__name__ == "ProgbarLogger" and cls.__module__.startswith("keras.")
                                         for cls in type(callback).__mro__)



def _callback_base():
    import keras

    return keras.callbacks.Callback


def model_signature(model):
    """Shapes and dtypes of the weights and optimizer variables, in order (names differ across ranks)."""
    optimizer = getattr(model, "optimizer", None)
    return {"weights": [(tuple(v.shape), str(v.dtype)) for v in model.weights],
            "optimizer": [(tuple(v.shape), str(v.dtype)) for v in (optimizer.variables if optimizer else [])]}


def check_same_on_all_ranks(hvd, model, steps):
    """Raise on every rank (no rank waits forever) if the model or steps per epoch differ."""
    mine = dict(model_signature(model), steps=steps)
    everyone = hvd.allgather_object(mine, name="kerasdist_model_check")
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        first = everyone[0]
        if theirs["weights"] != first["weights"] or theirs["optimizer"] != first["optimizer"]:
            raise kerasdist.KerasdistError(
                f"distribute='horovod': the model differs across ranks: rank {rank} has "
                f"{len(theirs['weights'])} weights of shapes {[s for s, _ in theirs['weights']]} and "
                f"{len(theirs['optimizer'])} optimizer variables, rank 0 has {len(first['weights'])} weights "
                f"of shapes {[s for s, _ in first['weights']]} and {len(first['optimizer'])} optimizer "
                "variables. Every rank must build the same model and optimizer before fit().")
        raise kerasdist.KerasdistError(
            f"distribute='horovod': rank {rank} would run {theirs['steps']} steps per epoch but rank 0 "
            f"runs {first['steps']}; pass the same steps_per_epoch= on every rank, or give every rank the "
            "same number of batches.")


def state_variables(model):
    """The backing ``tf.Variable`` of each weight and optimizer variable of ``model``, each once."""
    optimizer = getattr(model, "optimizer", None)
    return [v.value for v in unique_variables(list(model.weights) + list(optimizer.variables if optimizer else []))]


def broadcast_state(hvd, model, root_rank=0):
    """Copy rank ``root_rank``'s weights and optimizer state (built, maybe trained) to every rank."""
    hvd.broadcast_variables(state_variables(model), root_rank=root_rank)


class BroadcastStateCallback(_callback_base()):
    """At the start of fit: same model everywhere (checked), then rank 0's state on every rank."""

    def on_train_begin(self, logs=None):
        import horovod.tensorflow as hvd

        check_same_on_all_ranks(hvd, self.model, (self.params or {}).get("steps"))
        broadcast_state(hvd, self.model)


class MetricAverageCallback(_callback_base()):
    """Batch and epoch logs (validation included) over every rank, before other callbacks see them: each metric's
    state summed over the ranks (at an epoch's end in place: its training state before validation resets it),
    other scalars averaged."""

    def __init__(self):
        super().__init__()
        self.fitting, self.training = False, None

    def on_train_begin(self, logs=None):
        self.fitting = True

    def on_train_end(self, logs=None):
        self.fitting = False

    def on_epoch_begin(self, epoch, logs=None):
        self.training = None

    def on_test_begin(self, logs=None):
        import horovod.tensorflow as hvd

        if self.fitting and hvd.size() > 1:  # validation is about to reset the training metrics
            self.training = combine_over_ranks(hvd, self.model, {})

    def on_train_batch_end(self, batch, logs=None):
        self._global_batch_logs(logs)

    def on_test_batch_end(self, batch, logs=None):
        self._global_batch_logs(logs)

    def _global_batch_logs(self, logs):
        """Each batch's logs (running values) over every rank, the metric states left as they are."""
        import horovod.tensorflow as hvd

        if logs and hvd.size() > 1:
            combine_over_ranks(hvd, self.model, logs, keep_states=True)

    def on_epoch_end(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if logs is None or hvd.size() == 1:
            return
        if self.training is None:  # no validation this epoch: the states are the training ones
            combine_over_ranks(hvd, self.model, logs)
        else:
            combine_over_ranks(hvd, self.model, logs, prefix="val_", earlier=self.training)


def average_logs(logs):
    """Replace each number in ``logs`` by its mean over the ranks (one all-reduce)."""
    if not logs:
        return
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    keys = sorted(k for k, v in logs.items() if isinstance(v, (numbers.Number, np.number, np.ndarray))
                  and np.ndim(v) == 0)
    if not keys or hvd.size() == 1:
        return
    values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
    averaged = hvd.allreduce(values, op=hvd.Average, name="kerasdist_metric_average").numpy()
    for key, value in zip(keys, averaged):
        logs[key] = float(value)


class LearningRateWarmupCallback(_callback_base()):
    """Horovod's learning-rate warm-up for Keras 3: from ``initial_lr / size`` to ``initial_lr``.

    The rate at epoch ``e`` (fractional, per batch) is
    ``initial_lr / size * (e * (size - 1) / warmup_epochs + 1)``, reaching ``initial_lr`` at
    the end of ``warmup_epochs`` (``e`` counts the batch in progress as done, as Horovod's).
    Momentum correction is not done: Keras 3 optimizers fix momentum when the step is traced.

    :param initial_lr: the rate after warm-up; default: the optimizer's rate when fit starts.
    :param size: number of ranks; default: ``horovod.tensorflow.size()``.
    """

    def __init__(self, initial_lr=None, warmup_epochs=5, steps_per_epoch=None, size=None, verbose=0):
        super().__init__()
        self.initial_lr, self.warmup_epochs = initial_lr, warmup_epochs
        self.steps_per_epoch, self.size, self.verbose = steps_per_epoch, size, verbose
        self.epoch = 0

    def on_train_begin(self, logs=None):
        if self.size is None:
            import horovod.tensorflow as hvd

            self.size = hvd.size()
        if self.initial_lr is None:
            self.initial_lr = float(self.model.optimizer.learning_rate.numpy())
        self.steps_per_epoch = self.steps_per_epoch or (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise kerasdist.KerasdistError(
                "horovod: the learning-rate warm-up needs the number of steps per epoch, which is unknown "
                "for this data; pass steps_per_epoch= to fit().")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch >= self.warmup_epochs:
            return
        self.model.optimizer.learning_rate = self.rate(self.epoch + batch / self.steps_per_epoch)

    def rate(self, epoch):
        epoch += 1.0 / self.steps_per_epoch
        return self.initial_lr / self.size * (epoch * (self.size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch, logs=None):
        if epoch < self.warmup_epochs and self.verbose and logs is not None:
            print(f"Epoch {epoch + 1}: learning rate warm-up to {float(self.model.optimizer.learning_rate.numpy()):g}")



class CommitStateCallback(_callback_base()):
    """Commit a :class:`KerasElasticState` at the end of every ``every``-th epoch (and check for host
    changes, which raises Horovod's ``HostsUpdatedInterrupt`` on every worker at the same epoch)."""

    def __init__(self, state, every=1):
        super().__init__()
        self.state, self.every = state, every

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every == 0:
            self.state.epoch = epoch + 1
            self.state.commit()
