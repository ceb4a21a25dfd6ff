"""Local devices: split the CPU into N logical devices so "mirrored" has N replicas."""

import os

from .errors import KerasdistError

CPU_REPLICAS_VAR = "KERASDIST_CPU_REPLICAS"
MAX_CPU_REPLICAS = 64  # or the machine's core count, if larger


def cpu_replicas_from_env(environ=None):
    environ = os.environ if environ is None else environ
    value = environ.get(CPU_REPLICAS_VAR, "").strip()
    if not value:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    limit = max(MAX_CPU_REPLICAS, os.cpu_count() or 1)
    if not 1 <= count <= limit:
        raise KerasdistError(f"{CPU_REPLICAS_VAR}={value!r} is not valid: give a whole number from 1 to {limit} "
                             "(the number of logical CPU devices, e.g. 2; each one costs TensorFlow start-up "
                             "time and memory).")
    return count


def split_cpu(count):
    """Make ``count`` logical CPU devices; must run before TensorFlow initializes its devices."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == count:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as exc:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == count:
            return
        raise KerasdistError(
            f"{CPU_REPLICAS_VAR}={count} came too late: TensorFlow already initialized {have} CPU "
            "device(s). Import kerasdist before running any TensorFlow or Keras operation "
            f"(or call kerasdist.split_cpu({count}) first thing).") from exc


def local_replica_devices():
    """Devices a single-process "mirrored" uses: all GPUs, else all logical CPUs."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [d.name for d in gpus]
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def check_devices_exist(devices, plugin):
    """Raise a KerasdistError naming any device in ``devices`` that this process does not have."""
    import tensorflow as tf

    logical = [d.name for d in tf.config.list_logical_devices()]
    known = {_device_key(d) for d in logical}
    unknown = [d for d in devices if _device_key(d) not in known]
    if unknown:
        raise KerasdistError(f"{plugin}: device(s) {unknown} do not exist here; available: {logical}. "
                             f"Set {CPU_REPLICAS_VAR}=N to make N logical CPUs.")


def canonical_devices(devices):
    """``devices`` as a sorted tuple of "/device:TYPE:N" names: '/cpu:1', '/device:CPU:1' and
    '/job:localhost/device:CPU:1' are one device."""
    return tuple(sorted({"/device:%s:%d" % _device_key(d) for d in devices}))


DEVICE_NAME_FORMS = "'/gpu:0', '/cpu:1', '/device:GPU:0' or '/job:worker/task:0/device:GPU:0'"


def check_device_names(devices, where):
    """Refuse an empty device list (None is the one that means the default devices) and a name TensorFlow
    cannot read, naming it; ``where`` is e.g. "mirrored: devices". Lists of strings only: other values
    are the option annotations' to refuse."""
    if not isinstance(devices, (list, tuple)) or not all(isinstance(d, str) for d in devices):
        return
    if not devices:
        raise KerasdistError(f"{where}=[] names no device; list at least one (such as {DEVICE_NAME_FORMS}), or "
                             "give None for the default devices (all GPUs, else all logical CPUs).")
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        return  # the strategy's backend check names what is missing
    for device in devices:
        _device_key(device, f"{where}={list(devices)!r}")


def _device_key(device, where="devices"):
    """'/cpu:1', '/device:CPU:1' and '/job:localhost/device:CPU:1' all name ('CPU', 1)."""
    import tensorflow as tf

    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError as exc:
        spec, reason = None, str(exc)
    else:
        reason = None if spec.device_type else "it names no device type"
    if reason is not None:
        available = [d.name for d in tf.config.list_logical_devices()]
        raise KerasdistError(f"{where}: {device!r} is not a device name ({reason}); give names such as "
                             f"{DEVICE_NAME_FORMS} (this process has {available}).")
    return (spec.device_type.upper(), spec.device_index or 0)
