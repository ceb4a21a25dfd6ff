"""One gate for tests that need hardware or a build this machine may lack (like Lightning's RunIf).

    @run_if(nvidia_gpu=True)          # marked `gpu`, skipped with the reason when there is none
    def test_engine(): ...
"""

import os

import pytest

from helpers import PYTHON

HOROVODRUN = os.path.join(os.path.dirname(PYTHON), "horovodrun")


def _nvidia_gpu():
    from kerasdist_plugins.export import tensorrt

    reason = tensorrt.tensorrt_absent_reason()
    return f"needs an NVIDIA GPU and the tensorrt package ({reason})" if reason else None


def _tpu():
    from kerasdist_plugins import tpu

    reason = tpu.tpu_absent_reason()
    return f"needs a Cloud TPU ({reason})" if reason else None


def _horovod():
    from kerasdist_plugins import horovod

    reason = horovod.unavailable_reason()
    if reason is None and not os.path.exists(HOROVODRUN):
        reason = f"{HOROVODRUN} is missing"
    return f"needs horovod built with TensorFlow ({reason}); `make test` builds it" if reason else None


_GATES = {"nvidia_gpu": (_nvidia_gpu, "gpu"), "tpu": (_tpu, "tpu"), "horovod": (_horovod, None)}


def run_if(**needs):
    """Mark a test with each hardware it needs and skip it, naming what is missing, where it is absent."""
    unknown = sorted(set(needs) - set(_GATES))
    if unknown:
        raise TypeError(f"run_if: unknown requirement(s) {unknown}; known: {sorted(_GATES)}")
    wanted = [name for name, value in needs.items() if value]
    reasons = [reason for reason in (_GATES[name][0]() for name in wanted) if reason]

    def decorate(test):
        for name in wanted:
            marker = _GATES[name][1]
            if marker:
                test = getattr(pytest.mark, marker)(test)
        return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons))(test)

    return decorate
