"""communication="auto" measures kerasdist's TCP ring against TensorFlow's collectives at the first fit,
and every worker uses rank 0's decision (plugins/multiworker/probe.py). Real processes on 127.0.0.1."""

import json
import os
import sys
import threading

import numpy as np
import pytest

from tests.helpers import ROOT, child_env, max_diff, python, run, weights

KERASDIST = os.path.join(os.path.dirname(sys.executable), "kerasdist")
WORKER = os.path.join(ROOT, "tests", "workers", "mw_probe.py")
COMMON = ["--dataset", "--epochs", "2", "--examples", "96", "--batch", "16"]
PARAMETERS = 6 * 5 + 5 + 5 * 2 + 2  # mw_train.py's model
DEFAULT_PARAMETERS = 1 << 19  # probe.DEFAULT_PARAMETERS: strategy-free decides at compile, no model size yet


def launch(out, **env):
    result = run([KERASDIST, "launch", "-n", "2", "--join-timeout", "60", WORKER, *COMMON, "--out", str(out)],
                 timeout=150, env=child_env(**env))
    found = {}
    for line in result.stdout.splitlines():
        for word in ("PROBE", "TRANSPORT"):
            if line.startswith(("[0] ", "[1] ")) and line[4:].startswith(word + " "):
                found[word, int(line[1])] = line[4 + len(word) + 1:]
    return result.stdout, found


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run(python(WORKER, *COMMON, "--distribute", "none", "--out", str(out)), timeout=120)
    return weights(out, 0)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy_free, parameters", [("auto", DEFAULT_PARAMETERS), ("off", PARAMETERS)],
                         ids=["at-compile", "at-fit"])
def test_auto_probes_both_transports_and_every_worker_uses_rank_0s_choice(tmp_path, single, strategy_free,
                                                                          parameters):
    """The probe really runs on both workers, and rank 0's choice and figures are everyone's: the
    workers' own measurements are rigged to disagree (rank 0: TensorFlow's collectives, rank 1: the
    ring), so a worker acting on its own would hang or train differently. Strategy-free (the default) decides
    at the first compile, before the model's size is known (a 2 MiB gradient); MultiWorkerMirroredStrategy's
    step (KERASDIST_STRATEGY_FREE=off) at the first fit, with rank 0's model's size. TensorFlow's collectives
    chosen, both train under MultiWorkerMirroredStrategy."""
    output, found = launch(tmp_path, PROBE_TEST_FAVOUR="tensorflow,tcp", KERASDIST_TRANSPORT_PROBE="on",
                           KERASDIST_STRATEGY_FREE=strategy_free)
    assert set(found) == {(w, r) for w in ("PROBE", "TRANSPORT") for r in (0, 1)}, output[-3000:]
    probes = [json.loads(found["PROBE", r]) for r in (0, 1)]
    print(f"probe: {probes}")
    assert [p and p.pop("own_choice") for p in probes] == ["tensorflow", "tcp"]
    assert all(0 < p.pop("seconds") < 10 for p in probes)  # each worker's own clock
    assert probes[0] == probes[1]  # rank 0's decision and medians, bit for bit
    decided = probes[0]
    assert decided["choice"] == "tensorflow" and decided["parameters"] == parameters
    assert decided["ring_ms"] > decided["tensorflow_ms"] > 0 and 3 <= decided["rounds"] <= 9
    assert found["TRANSPORT", 0] == found["TRANSPORT", 1] == "tensorflow"
    logged = [line for line in output.splitlines() if "LOG kerasdist.multiworker all-reduce of" in line]
    assert len(logged) == 1 and logged[0].startswith("[0] "), logged  # the chief's one line
    assert (f"all-reduce of {parameters} float32 ({parameters * 4e-6:.2f} MB) and a scalar, median of {decided['rounds']}: TCP ring "
            f"{decided['ring_ms']:.2f} ms, TensorFlow's collectives {decided['tensorflow_ms']:.2f} ms; using "
            "TensorFlow's collectives") in logged[0]
    w0, w1 = weights(tmp_path, 0), weights(tmp_path, 1)
    print(f"max |w0 - w1| = {max_diff(w0, w1):.3g}; max |w0 - single| = {max_diff(w0, single):.3g}")
    assert max_diff(w0, w1) == 0.0 and max_diff(w0, single) <= 1e-5


# -- in one process: two ranks of a real ring in threads ------------------------------------------------

def two_rings():
    from kerasdist_plugins.multiworker import ring as tcp_ring

    listeners = [tcp_ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [address for _, address in listeners]
    rings = [None, None]

    def connect(rank):
        rings[rank] = tcp_ring.TcpRing.connect(listeners[rank][0], addresses, rank, timeout=20, connect_timeout=20)

    in_parallel(connect)
    return rings


def in_parallel(function):
    errors = []

    def each(rank):
        try:
            function(rank)
        except BaseException as exc:  # noqa: BLE001  re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=each, args=(rank,), daemon=True) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


class Model:
    def __init__(self, *shapes, jit_compile=False):
        self.trainable_weights = [np.zeros(shape) for shape in shapes]
        self.jit_compile = jit_compile


@pytest.mark.timeout(60)
@pytest.mark.parametrize("environs, jit_compile", [
    (({"KERASDIST_COMMUNICATION": "auto"}, {"KERASDIST_COMMUNICATION": "tcp"}), (False, False)),
    (({"KERASDIST_TRANSPORT_PROBE": "on"}, {"KERASDIST_TRANSPORT_PROBE": "off"}), (False, False)),
    (({"KERASDIST_COMMUNICATION": "tcp"}, {"KERASDIST_COMMUNICATION": "tcp"}), (False, False)),
    (({}, {}), (False, True)),
], ids=["one-worker-says-tcp", "one-worker-turns-it-off", "tcp", "one-model-jit-compiled"])
def test_no_probe_unless_every_worker_is_auto_with_the_probe_on(monkeypatch, environs, jit_compile):
    """A worker that asks for the ring (or turns the probe off, or whose model is jit-compiled: its
    gradients keep TensorFlow's all-reduce) keeps every worker from probing: one probing alone would
    wait forever for the other."""
    from kerasdist_plugins.multiworker import probe
    from kerasdist_plugins.multiworker.options import CollectiveOptions

    def must_not_run(*args):
        raise AssertionError("probed")

    monkeypatch.setattr(probe, "_medians", must_not_run)
    monkeypatch.setitem(probe._record(), "result", None)
    rings, kept = two_rings(), [None, None]
    try:
        def decide(rank):
            kept[rank] = probe.keep_ring_if_faster(rings[rank], Model((2, 3), jit_compile=jit_compile[rank]), None,
                                                   CollectiveOptions.from_env(environs[rank]))

        in_parallel(decide)
        assert kept == rings and probe.last_probe() is None
    finally:
        for ring in rings:
            ring.close()


def test_a_bad_probe_setting_is_a_clear_error():
    from kerasdist import ClusterConfigError
    from kerasdist_plugins.multiworker.options import CollectiveOptions

    with pytest.raises(ClusterConfigError, match="KERASDIST_TRANSPORT_PROBE='maybe' is not valid; choose on .* or off"):
        CollectiveOptions.from_env({"KERASDIST_TRANSPORT_PROBE": "maybe"})
    assert CollectiveOptions.from_env({"KERASDIST_TRANSPORT_PROBE": " OFF "}).probe is False
    assert CollectiveOptions.from_env({}).probe is True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("faster_on_rank_0", ["tcp", "tensorflow"])
def test_the_faster_transport_on_rank_0_is_every_ranks_choice(monkeypatch, faster_on_rank_0):
    from kerasdist_plugins.multiworker import probe
    from kerasdist_plugins.multiworker.options import CollectiveOptions

    sizes = {}

    def medians(ring, strategy, size):  # rank 1 measures the opposite of rank 0
        sizes[ring.rank] = size
        fast, slow = (0.001, 0.002) if ring.rank == 0 else (0.003, 0.0005)
        return (fast, slow, 4) if faster_on_rank_0 == "tcp" else (slow, fast, 4)

    monkeypatch.setattr(probe, "_medians", medians)
    monkeypatch.setitem(probe._record(), "result", None)
    rings, kept = two_rings(), [None, None]
    try:
        def decide(rank):
            model = Model((3, 4), (4,)) if rank == 0 else Model((7, 7))  # rank 0's size is everyone's
            kept[rank] = probe.keep_ring_if_faster(rings[rank], model, None, CollectiveOptions())

        in_parallel(decide)
    finally:
        for ring in rings:
            ring.close()
    assert kept == (rings if faster_on_rank_0 == "tcp" else [False, False])
    decided = probe.last_probe()  # both ranks recorded it in this one process: the same figures
    assert sizes == {0: 16, 1: 16}
    assert decided.choice == faster_on_rank_0 and decided.parameters == 16 and decided.rounds == 4
    assert (decided.ring_ms, decided.tensorflow_ms) == ((1.0, 2.0) if faster_on_rank_0 == "tcp" else (2.0, 1.0))


def test_the_probed_size_is_the_models_capped_at_32_mb_and_the_result_outlives_a_reset():
    from kerasdist.plugin_tools import process_state
    from kerasdist_plugins.multiworker import probe

    class Huge:
        trainable_weights = [type("Weight", (), {"shape": (5000, 5000)})()]

    assert probe._gradient_size(Model((3, 4), (4,))) == 16
    assert probe._gradient_size(Model()) == probe.DEFAULT_PARAMETERS == 1 << 19  # not built yet: 2 MiB
    assert probe._gradient_size(Huge()) == probe.MAX_PARAMETERS == 8 << 20  # 32 MB of float32
    probe._record()
    assert "multiworker.transport_probe" in process_state.names(kept=True)


@pytest.mark.timeout(60)
def test_an_error_in_one_workers_probe_closes_the_ring_so_the_other_fails_fast(monkeypatch):
    import time

    from kerasdist_plugins.multiworker import probe
    from kerasdist_plugins.multiworker.options import CollectiveOptions

    def medians(ring, strategy, size):
        if ring.rank == 0:
            raise RuntimeError("probe failed on rank 0")
        ring.all_reduce(np.ones(1))  # rank 0 never joins this one
        return 0.001, 0.002, 3

    monkeypatch.setattr(probe, "_medians", medians)
    rings, errors = two_rings(), [None, None]
    start = time.monotonic()
    try:
        def decide(rank):
            try:
                probe.keep_ring_if_faster(rings[rank], Model((2,)), None, CollectiveOptions())
            except Exception as exc:  # noqa: BLE001  checked below
                errors[rank] = exc

        in_parallel(decide)
    finally:
        for ring in rings:
            ring.close()
    assert "probe failed on rank 0" in str(errors[0])
    assert "closed the connection" in str(errors[1]) and time.monotonic() - start < 10, errors[1]
