"""Gradients and logs over kerasdist's TCP ring, when every worker agrees to use it."""

import hashlib
import secrets
import sys

from kerasdist import ClusterConfigError
from kerasdist.plugin_tools import route_gradient_all_reduce, set_log_summer, split_address, tf_global_seed

from . import ring as tcp_ring
from .join import state
from .options import COMMUNICATION_VAR
from .probe import keep_ring_if_faster

#: How long workers wait for each other while connecting the gradient ring.
RING_CONNECT_TIMEOUT = 60.0


def use_ring(model, strategy, method):
    """Send this model's gradients and logs over the TCP ring, when the workers agreed on one. Returns the
    ring that carries this ``fit``'s gradients, or None."""
    if state.ring is None:
        ring = agree_on_ring(strategy, state.cluster, state.options)
        state.ring = keep_ring_if_faster(ring, model, strategy, state.options) or False  # auto: measured
    ring = state.ring
    set_log_summer(strategy, ring.size if ring else 0, ring.sum_tensors if ring else None)
    if method == "fit":
        # an XLA-compiled step cannot call back into Python: it keeps TensorFlow's all-reduce
        use = ring and not model.jit_compile
        route_gradient_all_reduce(model.optimizer, strategy, ring.sum_tensors if use else _collective_sum)
        return ring if use else None
    return None


def _collective_sum(tensors):
    """TensorFlow's all-reduce (what Keras does), routed so that loss scaling sums before it checks."""
    import tensorflow as tf

    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, list(tensors))


def gradient_transport():
    """How this process's multiworker gradients travel: "tcp" (kerasdist's ring), "tensorflow"
    (TensorFlow's collectives), or None before the first ``fit``/``evaluate`` decided it."""
    if state.ring is None:
        return None
    return "tcp" if state.ring else "tensorflow"


def agree_on_ring(strategy, cluster, options):
    """Connect the workers' TCP ring, or agree on TensorFlow's collectives; every worker runs this
    at the same point (it runs two collectives), and all of them reach the same answer.

    Each worker offers "<its communication setting>|<its ring address>", with "!why" in place of the
    address when it will not use the ring (settings, GPUs) and "?why" when it cannot (sockets).
    """
    listener, offer = None, _ring_refusal(strategy, options)
    if offer is None:
        host, _ = split_address(cluster.cluster[cluster.task_type][cluster.task_index])
        try:
            listener, offer = tcp_ring.listen(host)
        except OSError as exc:
            offer = f"?cannot listen on {host}: {exc}"
    token = secrets.token_hex(16)  # this worker's share of the job's ring secret
    offers, rank = all_gather_text(strategy, f"{token}|{options.communication}|{offer}")
    secret = hashlib.sha256("".join(text.split("|", 1)[0] for text in offers).encode()).digest()
    settings = [text.split("|", 2)[1] for text in offers]
    offers = [text.split("|", 2)[2] for text in offers]
    ring = None
    if _refusals(offers):
        if listener is not None:
            listener.close()
    else:
        outcome = "ok"
        try:
            ring = tcp_ring.TcpRing.connect(listener, offers, rank, timeout=options.timeout_seconds,
                                            connect_timeout=RING_CONNECT_TIMEOUT, secret=secret)
        except (OSError, tcp_ring.RingError) as exc:
            outcome = f"?cannot connect the ring: {exc}"
        offers, _ = all_gather_text(strategy, outcome)
    refusals = _refusals(offers)
    if not refusals:
        return ring
    if ring is not None:
        ring.close()
    why = "; ".join(f"worker {i}: {text[1:]}" for i, text in refusals)
    if "tcp" in settings:
        demanding = ", ".join(str(i) for i, setting in enumerate(settings) if setting == "tcp")
        raise ClusterConfigError(
            f"{COMMUNICATION_VAR}=tcp (worker {demanding}) asks for the TCP gradient ring, which cannot run "
            f"({why}). Give every worker the same {COMMUNICATION_VAR}: auto (the ring when it can run) or "
            "ring (TensorFlow's collectives).")
    if any(text.startswith("?") for _, text in refusals) and strategy.extended.should_checkpoint:
        print(f"kerasdist: multiworker uses TensorFlow's collectives instead of the TCP ring ({why})",
              file=sys.stderr, flush=True)
    return None


def _refusals(offers):
    return [(i, text) for i, text in enumerate(offers) if text[:1] in ("!", "?")]


def _ring_refusal(strategy, options):
    """Why this worker cannot (or is told not to) use the TCP ring, as "!reason", or None."""
    if options.communication not in ("auto", "tcp"):
        return f"!{COMMUNICATION_VAR}={options.communication}"
    devices = strategy.extended.worker_devices
    if len(devices) != 1:
        return f"!{len(devices)} local replicas"
    if "CPU" not in devices[0].upper():
        return f"!trains on {devices[0]} (GPU: TensorFlow's collectives are faster there)"
    return None


def same_global_seed_everywhere(strategy):
    """Whether every worker set one TensorFlow global seed (``keras.utils.set_random_seed`` with the same value):
    then each draws one process's shuffle of arrays. One small collective; every worker asks at the same call."""
    seed = tf_global_seed()
    texts, _ = all_gather_text(strategy, "none" if seed is None else str(int(seed)))
    return seed is not None and len(set(texts)) == 1


_TEXT_WIDTH = 512


def all_gather_text(strategy, text):
    """Every worker's ``text`` (in replica order) and this worker's replica index."""
    import numpy as np
    import tensorflow as tf

    codes = np.zeros(_TEXT_WIDTH, np.int32)
    raw = text.encode()[:_TEXT_WIDTH]
    codes[:len(raw)] = list(raw)

    @tf.function
    def gather():
        def each_replica():
            context = tf.distribute.get_replica_context()
            return context.all_gather(tf.constant(codes)[None], axis=0), context.replica_id_in_sync_group

        return strategy.run(each_replica)

    table, rank = (strategy.experimental_local_results(v)[0] for v in gather())
    texts = [bytes(int(c) for c in row if c).decode(errors="replace") for row in table.numpy()]
    return texts, int(rank)
