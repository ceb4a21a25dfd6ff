"""A ``keras.losses.Loss`` called inside a distributed model's forward pass (part of kerasdist._keras_internals).

Under a tf.distribute strategy of R replicas Keras divides a ``Loss``'s reduced value by R
(``losses.loss.scale_loss_for_distribution``), and its TensorFlow trainer divides each ``add_loss`` value by R
again (``_aggregate_additional_loss``): a ``Loss`` a layer calls and passes to ``add_loss`` trained and logged
at 1/R of one process (stock Keras too, issue 29). For models kerasdist moved under a strategy, a ``Loss``
reduced inside a layer's call is left unscaled; the trainer's own scaling then applies once, as for any
``add_loss`` value (and a loss returned as an output is scaled once by the compiled loss that reads it).

Inside :func:`unscaled_losses` (a model's own train step under kerasdist, this thread only) neither scales: every
loss is its replica's own mean, as an ``ops.mean`` loss is, and the step's caller weights the replicas.
"""

import contextlib
import threading

from . import versions
from .multiworker_fit import MOVED_ATTR

_unscaled = threading.local()  # MirroredStrategy traces each replica in its own thread


@contextlib.contextmanager
def unscaled_losses():
    """In this thread: Keras's 1/replicas on losses (and the replicas factor on their trackers) is not applied."""
    install_single_loss_scaling()
    before = getattr(_unscaled, "on", False)
    _unscaled.on = True
    try:
        yield
    finally:
        _unscaled.on = before


def install_single_loss_scaling():
    """Replace ``scale_loss_for_distribution`` and ``unscale_loss_for_distribution`` once (private:
    ``versions.PIECES["loss_scale_for_distribution"]``, ``["loss_unscale_for_distribution"]``, and the layer
    call context from ``versions.PIECES["layer_call_context_attribute"]``). Idempotent."""
    owner, name = versions.owner_of("loss_scale_for_distribution")
    original = getattr(owner, name)
    if getattr(original, "_kerasdist_single", False):
        return
    get_global_attribute = versions.locate("layer_call_context_attribute")

    def scale_loss_for_distribution(value):
        if getattr(_unscaled, "on", False):
            return value
        context = get_global_attribute("current_call_ctx")
        if context is not None and getattr(getattr(context, "entry_layer", None), MOVED_ATTR, False):
            return value  # inside a moved model's call: the trainer scales add_loss values itself
        return original(value)

    unscale_owner, unscale_name = versions.owner_of("loss_unscale_for_distribution")
    original_unscale = getattr(unscale_owner, unscale_name)

    def unscale_loss_for_distribution(value):
        return value if getattr(_unscaled, "on", False) else original_unscale(value)

    for function, replaced in ((scale_loss_for_distribution, original),
                               (unscale_loss_for_distribution, original_unscale)):
        function._kerasdist_single = True
        function._kerasdist_original = replaced
    setattr(unscale_owner, unscale_name, unscale_loss_for_distribution)
    setattr(owner, name, scale_loss_for_distribution)
