"""A complete third-party kerasdist plugin: ``distribute="onedevice"``.

Installed with pip, it is found through the ``kerasdist`` entry-point group
(see pyproject.toml), exactly like kerasdist's built-in plugins.
"""

import dataclasses

import kerasdist


@dataclasses.dataclass
class OneDevice(kerasdist.StrategySpec):
    """Train on a single device, e.g. ``kerasdist.onedevice(device="/cpu:1")``."""

    device: str = "/cpu:0"


@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("onedevice", OneDevice, aliases=("one_device",),
             description="All variables and computation on one device (tf.distribute.OneDeviceStrategy).")


@kerasdist.hookimpl
def kerasdist_create_strategy(spec):
    if isinstance(spec, OneDevice):
        import tensorflow as tf

        return tf.distribute.OneDeviceStrategy(spec.device)
