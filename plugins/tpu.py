"""distribute="tpu": tf.distribute.TPUStrategy on a Cloud TPU (VM or node).

This machine kind has no TPU: the plugin reports itself unavailable here, and the tests check
everything up to the hardware boundary (resolver arguments, reachability, the errors).
"""

import dataclasses
import glob
import os
import socket
from typing import Optional
from urllib.parse import urlparse

import kerasdist

TPU_ENV_VARS = ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS")


@dataclasses.dataclass
class TPU(kerasdist.StrategySpec):
    """:param tpu: None (from TPU_NAME, else the local TPU VM), "local", a TPU name or "grpc://host:port".
    :param zone: GCE zone, for TPU names. :param project: GCP project, for TPU names.
    """

    tpu: Optional[str] = None
    zone: Optional[str] = None
    project: Optional[str] = None


def tpu_absent_reason(environ=None, device_glob="/dev/accel*"):
    """Why no TPU is visible to this process, or None when one may be."""
    environ = os.environ if environ is None else environ
    if any(environ.get(var) for var in TPU_ENV_VARS) or glob.glob(device_glob):
        return None
    return ("no TPU here: no /dev/accel* device (TPU VM) and neither TPU_NAME nor "
            "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS is set; run on a Cloud TPU or set TPU_NAME")


@kerasdist.hookimpl
def kerasdist_register_strategies(register):
    register("tpu", TPU, description="Cloud TPU (tf.distribute.TPUStrategy via TPUClusterResolver).",
             check=tpu_absent_reason)


@kerasdist.hookimpl(tryfirst=True)
def kerasdist_auto_strategy(cluster):
    return "tpu" if tpu_absent_reason() is None else None


@kerasdist.hookimpl
def kerasdist_create_strategy(spec):
    if not isinstance(spec, TPU):
        return None
    import tensorflow as tf

    target = spec.tpu or os.environ.get("TPU_NAME") or "local"
    check_reachable(target)
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu=target, zone=spec.zone, project=spec.project)
        if target != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (tf.errors.OpError, ValueError, RuntimeError) as exc:
        raise kerasdist.PluginUnavailableError(
            f"tpu: no usable TPU at tpu={target!r}: {type(exc).__name__}: {str(exc).splitlines()[0]}. "
            "Run on a Cloud TPU VM (tpu='local') or give the TPU's name or grpc://host:port.") from exc
    return tf.distribute.TPUStrategy(resolver)


def check_reachable(target, timeout=3.0):
    """A grpc:// TPU address must accept connections; TensorFlow would otherwise wait forever."""
    if not target.startswith("grpc://"):
        return
    address = urlparse(target)
    try:
        with socket.create_connection((address.hostname, address.port or 8470), timeout=timeout):
            return
    except OSError as exc:
        raise kerasdist.PluginUnavailableError(
            f"tpu: the TPU at {target!r} is not reachable ({exc.strerror or exc}); check TPU_NAME / tpu= "
            "and that the TPU is running.") from exc
