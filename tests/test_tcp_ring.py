"""kerasdist's TCP ring all-reduce (plugins/multiworker/ring.py) between real processes on 127.0.0.1."""

import os

import numpy as np
import pytest

from tests.helpers import ROOT, finish, kill_group, python, start

PEER = os.path.join(ROOT, "tests", "workers", "ring_peer.py")


def ring(tmp_path, size, scenario, timeout=60, **flags):
    extra = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    procs = [start(python(PEER, "--rank", str(r), "--size", str(size), "--dir", str(tmp_path),
                          "--scenario", scenario, *extra)) for r in range(size)]
    return finish(procs, timeout=timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_sums_are_exact_and_identical_on_every_rank(tmp_path, size):
    import sys

    sys.path.insert(0, os.path.dirname(PEER))
    from ring_peer import SUM_CASES, case_input

    for code, output in ring(tmp_path, size, "sums"):
        assert code == 0, output[-3000:]
    results = [np.load(tmp_path / f"result-{r}.npz") for r in range(size)]
    for key in results[0].files:
        for other in results[1:]:
            assert results[0][key].tobytes() == other[key].tobytes(), f"{key} differs between ranks"
    for key in results[0].files:
        name = key.split("_", 1)[1] if key.startswith(("several_", "graph_")) else key
        inputs = [case_input(name, r) for r in range(size)]
        expected = np.sum(np.stack([i.astype("float64") for i in inputs]), axis=0)
        got = results[0][key]
        assert got.shape == inputs[0].shape and got.dtype == inputs[0].dtype, key
        tolerance = {"float16": 0.1, "float32": 1e-4}.get(str(got.dtype), 1e-12)
        assert np.allclose(got.astype("float64"), expected, rtol=0, atol=tolerance), key


@pytest.mark.timeout(60)
def test_a_peer_that_exits_is_a_clear_error_not_a_hang(tmp_path):
    (code0, out0), (code1, _) = ring(tmp_path, 2, "peer_exits", timeout=40)
    assert code1 == 0 and code0 == 4, out0[-2000:]
    assert "RING_ERROR gradient all-reduce failed on rank 0: rank 1 closed the connection (it exited)" in out0
    assert "AFTER the gradient ring is broken since an earlier failure" in out0


@pytest.mark.timeout(60)
def test_ranks_out_of_step_are_a_clear_error(tmp_path):
    for code, output in ring(tmp_path, 2, "out_of_step", timeout=40):
        assert code == 4, output[-2000:]
        assert "out of step with its neighbour" in output
        assert "every worker must run the same all-reduces in the same order" in output


@pytest.mark.timeout(90)
def test_a_stuck_peer_times_out_with_the_timeout_given(tmp_path):
    procs = [start(python(PEER, "--rank", str(r), "--size", "2", "--dir", str(tmp_path), "--scenario",
                          "stuck_peer", "--timeout", "2")) for r in range(2)]
    (code0, out0), = finish(procs[:1], timeout=45)
    kill_group(procs[1])
    procs[1].wait()
    assert code0 == 4, out0[-2000:]
    assert "no progress for 2 s (a peer is stuck or gone)" in out0
    waited = float(out0.split("WAITED ")[1].split()[0])
    assert 1.9 <= waited < 10


def _in_threads(function, size=2):
    import threading

    results = [None] * size
    threads = [threading.Thread(target=lambda r: results.__setitem__(r, function(r)), args=(r,))
               for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def _all_reduce_then_close(rings, sockets, length):
    """Every rank sums np.full(length, rank + 1); then the rings and the other sockets are closed."""
    try:
        return _in_threads(lambda r: rings[r].all_reduce(np.full(length, r + 1.0)))
    finally:
        for sock in [*rings, *sockets]:
            sock.close()


@pytest.mark.timeout(60)
def test_strangers_connecting_to_a_ring_port_are_turned_away():
    import socket

    from kerasdist_plugins.multiworker import ring as tcp_ring

    listeners = [tcp_ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [address for _, address in listeners]
    strangers = []
    for address in addresses:  # one stranger sends junk, one hangs up at once, one says nothing
        host, port = address.rsplit(":", 1)
        strangers.append(socket.create_connection((host, int(port))))
        strangers[-1].sendall(b"GET / HTTP/1.1\r\n\r\n" * 4)
        socket.create_connection((host, int(port))).close()
        strangers.append(socket.create_connection((host, int(port))))
    rings = _in_threads(lambda r: tcp_ring.TcpRing.connect(listeners[r][0], addresses, r, connect_timeout=20))
    assert all(rings), "the ring did not form"
    results = _all_reduce_then_close(rings, strangers, 5)
    assert [list(r) for r in results] == [[3.0] * 5, [3.0] * 5]


@pytest.mark.timeout(60)
def test_a_stranger_with_the_right_hello_but_no_secret_is_refused_at_once():
    """The stranger speaks first, with a well-formed hello for rank 0 (but a proof made without the secret);
    the job's own ranks still form the ring, with no wait for the stranger."""
    import socket
    import time

    from kerasdist_plugins.multiworker import ring as tcp_ring

    secret = b"the job's secret"
    listeners = [tcp_ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [address for _, address in listeners]
    strangers = []
    for rank, address in enumerate(addresses):
        host, port = address.rsplit(":", 1)
        hello = tcp_ring._HELLO.pack(tcp_ring._MAGIC, (rank - 1) % 2, 2,
                                     tcp_ring._proof(b"a guess", (rank - 1) % 2, 2, address))
        strangers.append(socket.create_connection((host, int(port))))
        strangers[-1].sendall(hello)
        strangers.append(socket.create_connection((host, int(port))))  # and one that says nothing
    start = time.monotonic()
    rings = _in_threads(lambda r: tcp_ring.TcpRing.connect(listeners[r][0], addresses, r, connect_timeout=20,
                                                           secret=secret))
    formed = time.monotonic() - start
    print(f"ring formed in {formed:.3f} s with a secret-less stranger and a silent one at each port")
    assert all(rings) and formed < 1.0, formed
    for stranger in strangers[::2]:  # the one that knew the words but not the secret was closed at once
        stranger.settimeout(2)
        assert stranger.recv(1) == b""
    results = _all_reduce_then_close(rings, strangers, 3)
    assert [list(r) for r in results] == [[3.0] * 3, [3.0] * 3]


def test_ranks_with_different_secrets_do_not_form_a_ring():
    from kerasdist_plugins.multiworker import ring as tcp_ring

    listeners = [tcp_ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [address for _, address in listeners]

    def join(rank):
        try:
            tcp_ring.TcpRing.connect(listeners[rank][0], addresses, rank, connect_timeout=2, secret=b"s%d" % rank)
        except tcp_ring.RingError as exc:
            return str(exc)

    errors = _in_threads(join)
    assert all(e and "did not connect to the ring in time" in e for e in errors), errors


@pytest.mark.timeout(120)
def test_sum_tensors_carries_float16_and_bfloat16_summed_in_float32():
    """Mixed precision: 16-bit floats cross the ring (as float32) and come back in their own dtype,
    correctly rounded and the same bits on every rank."""
    import tensorflow as tf

    from kerasdist_plugins.multiworker import ring as tcp_ring

    listeners = [tcp_ring.listen("127.0.0.1") for _ in range(2)]
    addresses = [address for _, address in listeners]
    rings = _in_threads(lambda r: tcp_ring.TcpRing.connect(listeners[r][0], addresses, r, connect_timeout=20))
    values = {tf.float16: [2048.0, 1.0], tf.bfloat16: [0.1, 3.0], tf.float32: [1.5, 0.25]}

    def run(rank):
        @tf.function
        def step():
            return rings[rank].sum_tensors([tf.fill([3], tf.constant(v[rank], d)) for d, v in values.items()])

        return step()

    try:
        results = _in_threads(run)
    finally:
        for r in rings:
            r.close()
    for rank_result in results:
        for (dtype, (a, b)), total in zip(values.items(), rank_result):
            assert total.dtype == dtype
            expected = tf.cast(tf.cast(a, dtype), tf.float32) + tf.cast(tf.cast(b, dtype), tf.float32)
            expected = tf.cast(expected, dtype)  # float16 2048 + 1 rounds to 2048
            np.testing.assert_array_equal(total.numpy(), np.full(3, expected.numpy()))
    np.testing.assert_array_equal(results[0][0].numpy(), results[1][0].numpy())
