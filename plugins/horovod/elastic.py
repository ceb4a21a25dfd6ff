"""Elastic training (horovodrun --min-np/--max-np): ``run_elastic`` instead of ``fit``."""

import logging

import kerasdist
from kerasdist.plugin_tools import process_state
from .callbacks import CommitStateCallback, state_variables
from .options import import_horovod

log = logging.getLogger("kerasdist.horovod")


def run_elastic(model, *args, state=None, **fit_kwargs):
    """``model.fit(*args, **fit_kwargs)`` under ``hvd.elastic.run``: survives workers leaving and joining.

    Launch with ``horovodrun --min-np M --max-np N --host-discovery-script S python train.py``.
    The model (compiled with ``distribute="horovod"``, built) and its optimizer state plus the epoch
    are committed at the end of every epoch. When the world changes, every worker goes back to the
    last commit (a worker that failed) or stays at it (hosts added or removed between epochs), Horovod
    re-forms the ring, rank 0's committed state is broadcast to every worker (new ones included), and
    ``fit`` continues from the committed epoch, with the data re-sharded for the new size. Returns the
    ``History`` of the last ``fit`` attempt (its epochs since the last reset).

    :param state: a :class:`KerasElasticState` (default: a new one at ``initial_epoch``); pass your own
        to sync extra values (``KerasElasticState(model, my_counter=0)``) or to register reset callbacks.
    """
    reducer = getattr(getattr(model, "optimizer", None), "__dict__", {}).get("_kerasdist_horovod")
    if reducer is None:
        raise kerasdist.KerasdistError(
            "horovod run_elastic: compile the model with distribute='horovod' first.")
    if reducer.passes > 1:
        raise kerasdist.KerasdistError(
            "horovod run_elastic: backward_passes_per_step > 1 is not supported with elastic training "
            "(partly accumulated gradients are not part of the committed state); use 1.")
    if not model.built:
        raise kerasdist.KerasdistError(
            "horovod run_elastic: the model must be built before training starts (every worker, new ones "
            "included, receives rank 0's weights before fit): give it a keras.Input or call model.build().")
    if state is None:
        state = KerasElasticState(model, epoch=fit_kwargs.get("initial_epoch", 0))
    fit_kwargs.pop("initial_epoch", None)
    user_callbacks = list(fit_kwargs.pop("callbacks", None) or [])

    def train(state):
        commit = CommitStateCallback(state)
        return model.fit(*args, initial_epoch=state.epoch, callbacks=user_callbacks + [commit], **fit_kwargs)

    return elastic_run(train)(state)


def elastic_run(func):
    """``hvd.elastic.run`` for Keras 3: also turns Horovod op errors raised inside ``fit`` (grouped
    all-reduce, object broadcast/all-gather) into ``HorovodInternalError``, so the job recovers."""
    import tensorflow as tf
    from horovod.common.elastic import run_fn
    from horovod.common.exceptions import HorovodInternalError

    hvd = import_horovod()

    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except (tf.errors.UnknownError, tf.errors.AbortedError, tf.errors.InternalError,
                tf.errors.FailedPreconditionError) as exc:
            if "horovod" in str(exc).lower():
                lines = [line for line in str(exc).splitlines() if "orovod" in line] or [""]
                log.warning("horovod elastic: a collective failed (%s: %s); going back to the last "
                            "commit", type(exc).__name__, lines[0].strip()[:300])
                raise HorovodInternalError(exc) from exc
            raise

    def reset():
        hvd.shutdown()
        hvd.init()

    return run_fn(wrapper, reset)


def KerasElasticState(model, epoch=0, **kwargs):  # noqa: N802  (makes the class on first use)
    """Horovod elastic state of a Keras 3 model: weights, optimizer variables, ``epoch`` (+ kwargs).

    ``horovod.tensorflow.elastic.TensorFlowKerasState`` is Keras-2 code (``optimizer.variables()``,
    Keras variables broadcast directly); this one works on the Keras 3 variables' backing
    ``tf.Variable``s. ``commit()`` copies them to host memory, ``restore()`` assigns them back,
    ``sync()`` broadcasts rank 0's. After a reset the train function is re-traced for the new world
    size, and a learning rate scaled by ``scale_learning_rate=True`` is re-scaled.
    Extra keyword arguments are synced too and read back as attributes (``state.my_counter``).
    """
    return elastic_state_class()(model, epoch=epoch, **kwargs)


def elastic_state_class():
    """The :func:`KerasElasticState` class (a ``horovod.common.elastic.ObjectState``), made on first use."""
    made = process_state.slot("horovod.elastic_state_class", list)
    if not made:
        import_horovod()
        from horovod.common.elastic import ObjectState

        class _KerasElasticState(ObjectState):
            __doc__ = KerasElasticState.__doc__

            def __init__(self, model, epoch=0, **kwargs):
                import horovod.tensorflow as hvd

                self.model = model
                self._size = hvd.size()
                self._values = []
                super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, epoch=epoch, **kwargs)

            def _variables(self):
                optimizer = self.model.optimizer
                if not optimizer.built:
                    optimizer.build(self.model.trainable_variables)
                return state_variables(self.model)

            def save(self):
                self._values = [v.numpy() for v in self._variables()]
                super().save()

            def restore(self):
                for variable, value in zip(self._variables(), self._values):
                    variable.assign(value)
                super().restore()

            def sync(self):
                import horovod.tensorflow as hvd

                hvd.broadcast_variables(self._variables(), root_rank=0)
                self._values = [v.numpy() for v in self._variables()]
                super().sync()

            def reset(self):
                import horovod.tensorflow as hvd

                size = hvd.size()
                reducer = self.model.optimizer.__dict__.get("_kerasdist_horovod")
                if reducer is not None and getattr(reducer, "lr_scaled", False) and size != self._size:
                    lr = self.model.optimizer.learning_rate
                    self.model.optimizer.learning_rate = float(lr.numpy()) * size / self._size
                self._size = size
                # The all-reduce in the train step is traced for a world size (none at all for one worker).
                self.model.make_train_function(force=True)

        _KerasElasticState.__name__ = _KerasElasticState.__qualname__ = "KerasElasticState"
        made.append(_KerasElasticState)
    return made[0]
