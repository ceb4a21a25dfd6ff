"""communication="auto" on CPU workers: the TCP ring or TensorFlow's collectives, whichever is faster here.

Once the TCP ring is connected (at the first ``compile`` when the step could run strategy-free, the default;
else at the first ``fit``/``evaluate``), every worker times a few step-shaped rounds on each transport,
alternating the two: a buffer the size of rank 0's model's gradients (its trainable parameters, float32, at most
MAX_PARAMETERS = 8M elements, 32 MB; DEFAULT_PARAMETERS at compile, before the strategy holds a model) plus one
scalar (the per-step log sum), through the ring and through TensorFlow's collective all-reduce (the one
the strategy uses for Keras's gradients). Rank 0's medians decide, and every worker receives that
decision over the ring, so workers can never choose differently (and hang). A jit-compiled model keeps
TensorFlow's all-reduce for its gradients anyway: no probe, the ring kept for the logs. The ring wins on
the machines measured so far (docs/benchmarks.md); on a CPU where it does not, ``auto`` takes TensorFlow's collectives.
"""

import dataclasses
import logging
import statistics
import time
from typing import Optional

import numpy as np

from kerasdist.plugin_tools import process_state

log = logging.getLogger("kerasdist.multiworker")

#: Gradient size probed when the model has no weights yet (2 MiB of float32).
DEFAULT_PARAMETERS = 1 << 19
#: The most float32 elements probed (32 MB): past that both transports are bandwidth-bound alike.
MAX_PARAMETERS = 1 << 23
#: Timed rounds (one step-shaped exchange on each transport per round): at least MIN, at most MAX, and no new
#: round once the timed all-reduces took BUDGET_S in all on any worker.
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 9, 0.3
_CHOICES = ("tcp", "tensorflow")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the probe measured and chose (the medians are rank 0's: the ones that decided)."""

    choice: str  # "tcp" (the ring) or "tensorflow"
    ring_ms: float
    tensorflow_ms: float
    parameters: int  # float32 elements per all-reduce
    rounds: int
    own_choice: str  # what this worker's own medians said (rank 0's choice is used)
    seconds: float  # how long the probe took on this worker, set-up and agreement included


def last_probe() -> Optional[ProbeResult]:
    """The probe's result in this process, or None (no probe ran: not ``auto``, not CPU workers,
    the probe turned off with ``KERASDIST_TRANSPORT_PROBE=off``, or before the first ``fit``)."""
    return _record().get("result")


def _record():
    return process_state.slot("multiworker.transport_probe", dict, keep=True)  # lives as long as the decision


def keep_ring_if_faster(ring, model, strategy, options):
    """``ring`` when it should carry the gradients, else False (the ring is closed).

    Every worker calls this with the ring the workers agreed on (the same truth on all of them). The
    probe runs only when every worker's setting is "auto", none turned it off and no worker's model is
    jit-compiled; otherwise the ring is kept unmeasured. Every worker probes rank 0's gradient size.
    ``options``: this worker's :class:`~.options.CollectiveOptions`. On any error the ring is closed
    (the other workers then fail instead of waiting).
    """
    if not ring or ring.size == 1:
        return ring
    wants_probe = options.communication == "auto" and options.probe and not getattr(model, "jit_compile", False)
    try:
        own_size = _gradient_size(model) if wants_probe and ring.rank == 0 else 0
        refusals, size = ring.all_reduce(np.array([0.0 if wants_probe else 1.0, float(own_size)]))
        if refusals > 0:
            return ring
        return _probe(ring, strategy, int(size))
    except BaseException:
        ring.close()
        raise


def _probe(ring, strategy, size):
    start = time.perf_counter()
    ring_s, tensorflow_s, rounds = _medians(ring, strategy, size)
    own = "tcp" if ring_s <= tensorflow_s else "tensorflow"
    offer = np.zeros(3) if ring.rank else np.array([_CHOICES.index(own) + 1.0, ring_s, tensorflow_s])
    code, ring_s, tensorflow_s = ring.all_reduce(offer)  # rank 0's decision and figures, on every worker
    result = ProbeResult(_CHOICES[int(code) - 1], ring_s * 1e3, tensorflow_s * 1e3, size, rounds, own,
                         time.perf_counter() - start)
    _record()["result"] = result
    if ring.rank == 0:
        log.info("all-reduce of %d float32 (%.2f MB) and a scalar, median of %d: TCP ring "
                 "%.2f ms, TensorFlow's collectives %.2f ms; using %s (probe: %.2f s)", size, size * 4e-6, rounds,
                 result.ring_ms, result.tensorflow_ms,
                 "the TCP ring" if result.choice == "tcp" else "TensorFlow's collectives", result.seconds)
    if result.choice == "tcp":
        return ring
    ring.close()
    return False


def _gradient_size(model):
    size = sum(int(np.prod(v.shape)) for v in model.trainable_weights) if model is not None else 0
    return min(size or DEFAULT_PARAMETERS, MAX_PARAMETERS)


def _medians(ring, strategy, size):
    """This worker's median seconds per step-shaped exchange (a gradient all-reduce of ``size`` float32
    and a scalar one, as the per-step log sum), on the ring and on TensorFlow's collectives, and the
    number of timed rounds (the same on every worker)."""
    import tensorflow as tf

    buffer, scalar = tf.zeros([size], tf.float32), tf.zeros([], tf.float32)

    @tf.function(autograph=False)  # plain graph building: autograph's conversion cost ~0.3 s (loaded machine)
    def ring_step(x, s):
        total = ring.sum_tensors([x])[0]
        with tf.control_dependencies([total]):  # one after the other, as in a step
            return total, ring.sum_tensors([tf.identity(s)])[0]

    @tf.function(autograph=False)
    def tensorflow_step(x, s):
        def replica(x, s):  # copies on the replica's device, as the gradients are
            context = tf.distribute.get_replica_context()
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(x))
            with tf.control_dependencies([total]):
                return total, context.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(s))

        return strategy.run(replica, args=(x, s))

    calls = (lambda: [t.numpy() for t in ring_step(buffer, scalar)],
             lambda: [strategy.experimental_local_results(t)[0].numpy() for t in tensorflow_step(buffer, scalar)])
    for call in calls:  # trace and set up, untimed
        call()
    times = ([], [])
    while True:
        for call, spent in zip(calls, times):
            start = time.perf_counter()
            call()
            spent.append(time.perf_counter() - start)
        rounds = len(times[0])
        done = rounds >= MAX_ROUNDS or (rounds >= MIN_ROUNDS and sum(map(sum, times)) >= BUDGET_S)
        if ring.all_reduce(np.array([float(done)]))[0] > 0:  # any worker done: all stop together
            return statistics.median(times[0]), statistics.median(times[1]), rounds
