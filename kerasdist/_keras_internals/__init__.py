"""The one package that touches Keras/TensorFlow private attributes.

Everything private lives here, one concern a module; ``tests/test_keras_internals*.py`` fail loudly when a
Keras release changes a piece. This ``__init__`` only re-exports what kerasdist's core and
``kerasdist.plugin_tools`` use:

- ``versions``: where each private piece lives on each Keras version, the version check, and the one
  KerasdistError (at compile) when the installed Keras lacks a piece;
- ``strategy_binding``: moving a model and optimizer built elsewhere under a tf.distribute strategy;
- ``multiworker_fit``: Keras's first-batch build and log reduction under a multi-worker strategy;
- ``gradient_routing``: an optimizer's gradient all-reduce routed to another transport; ``clipping``: its
  clipping applied to the replicas' summed gradient;
- ``coordination``: TensorFlow's coordination service; ``backup``: the chief-aware BackupAndRestore;
- ``training``: what a training step and its variables need (uneven batches, gradient accumulation,
  synchronized batch statistics, JAX layouts, evaluate()'s list);
- ``central``: replica writes to CentralStorageStrategy's variables; ``collectives``: MirroredStrategy's
  collective keys; ``layers``: changing a built layer in place; ``ps``: the parameter-server strategy;
  ``losses``: a ``Loss`` called inside a moved model's forward pass scaled once;
- ``torch``, ``torch_sharding``: the PyTorch backend's pieces (imported from them directly).
"""

from .backup import make_chief_aware_backup  # noqa: F401
from .central import (assign_own_state_outside_replicas, assign_state_from_first_replica,  # noqa: F401
                      decay_weights_outside_replicas,
                      update_loss_scale_once_per_step)
from .clipping import clip_summed_gradients  # noqa: F401
from .coordination import configure_coordination, tf_context_initialized  # noqa: F401
from .gradient_routing import route_gradient_all_reduce  # noqa: F401
from .layers import disable_per_channel_quantization, refresh_call_signature, state_unlocked  # noqa: F401
from .multiworker_fit import (install_multiworker_fit_fixes, is_multiworker_strategy, keras_array_batches,  # noqa: F401
                              set_log_summer, tf_global_seed, uninstall_multiworker_fit_fixes)
from .ps import PS_COORDINATOR_JOB, parameter_server_strategy, symbolic_build  # noqa: F401
from .strategy_binding import (bind_model, bound_strategy, move_to_strategy, optimizer_strategy,  # noqa: F401
                               unbound_from_strategy)
from .training import (accumulate_across_replicas, all_layers, flatten_metrics_in_order,  # noqa: F401
                       lay_out_variables, set_batch_share_weighting, synchronize_batch_norm, variable_layout,
                       weight_replicas_by_batch_share)
from .versions import (CHECKED_KERAS_VERSIONS, SUPPORTED_KERAS, installed_keras_version,  # noqa: F401
                       keras_shuffles_by_epoch, keras_version_checked)
