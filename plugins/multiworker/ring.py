"""Ring all-reduce over plain TCP sockets between the worker processes of one cluster.

The same algorithm as TensorFlow's CPU ring collective (reduce-scatter, then all-gather, one
neighbour each way), with the bytes moved by a few socket calls instead of gRPC messages, which
cost CPU time that the workers' compute then lacks (measured in docs/benchmarks.md). Every chunk
is summed by one worker and then copied to the others, so all workers end with the same bits.
"""

import hashlib
import hmac
import select
import socket
import struct
import threading
import time

import numpy as np

from kerasdist import KerasdistError
from kerasdist.plugin_tools import split_address

_MAGIC = b"kerasdist-ring/2"
_HELLO = struct.Struct("!16sII32s")  # magic, rank, size, proof: HMAC-SHA256(job secret, the rest)
_HEADER = struct.Struct("!QQ")  # message number, payload bytes
_PUBLIC_PART = _HELLO.size - 32  # magic, rank, size
_HELLO_TIMEOUT = 2.0
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


class RingError(KerasdistError):
    """A peer left, answered out of order, or did not answer in time."""


#: What to do when a peer left: said by the errors of a ring whose peer exited or stopped answering.
PEERS_MUST_RUN_THE_SAME = (
    "Every worker must run the same fit/evaluate calls, in the same order. To train in this process alone "
    "(e.g. a model restored with keras.models.load_model after the other workers finished: it restores "
    "distribute=\"multiworker\"), load it with kerasdist.load_plain(path) or compile it again with "
    "distribute=None.")


def listen(host, port=0):
    """Open a rank's listening socket on ``host``; returns it and its "host:port"."""
    listener = socket.create_server((host, port), family=_family(host), backlog=8)
    bound = listener.getsockname()[1]
    return listener, (f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}")


class TcpRing:
    """One process's place in a ring: it sends to rank + 1 and receives from rank - 1.

    Every rank calls :func:`listen`, the addresses are shared (in rank order), every rank
    calls :meth:`connect`, then the same ``all_reduce`` calls run in the same order on every rank.
    """

    def __init__(self, rank, size, right=None, left=None, timeout=None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a ring of {size}")
        self.rank, self.size, self.timeout = rank, size, timeout
        self._right, self._left = right, left
        self._messages = 0  # sent = received: every exchange sends one message and receives one
        self._lock = threading.Lock()
        self._broken = None

    @classmethod
    def connect(cls, listener, addresses, rank, timeout=None, connect_timeout=60.0, secret=b""):
        """Connect to the next rank, accept the previous one and close ``listener``.

        :param timeout: seconds an all-reduce may wait without progress (None: no limit).
        :param secret: the job's secret; the hello each rank sends proves it knows it, so a stranger
            that reaches a ring port is turned away at once, whatever it sends.
        """
        size = len(addresses)
        try:
            if size == 1:
                return cls(rank, size, timeout=timeout)
            deadline = time.monotonic() + connect_timeout
            right_address = addresses[(rank + 1) % size]
            right = _connect(right_address, deadline)
            try:
                right.sendall(_HELLO.pack(_MAGIC, rank, size, _proof(secret, rank, size, right_address)))
                left = _accept(listener, (rank - 1) % size, size, deadline, secret, addresses[rank])
            except BaseException:
                right.close()
                raise
        finally:
            listener.close()
        for sock in (right, left):
            _tune(sock)
        return cls(rank, size, right, left, timeout)

    def close(self):
        for sock in (self._right, self._left):
            if sock is not None:
                sock.close()
        self._right = self._left = None

    # -- all-reduce --------------------------------------------------------------------------

    def all_reduce(self, array):
        """Return the element-wise sum of ``array`` over all ranks (a new array, same dtype and shape)."""
        result = np.array(array, copy=True, order="C")
        self.all_reduce_in_place(result.reshape(-1))
        return result

    def all_reduce_in_place(self, flat):
        """Replace the contiguous 1-D ``flat`` by its sum over all ranks."""
        if self.size == 1:
            return
        with self._lock:
            if self._broken:
                raise RingError(f"the gradient ring is broken since an earlier failure: {self._broken}")
            try:
                self._ring_all_reduce(flat)
            except (OSError, RingError) as exc:
                self._broken = str(exc)
                raise RingError(f"gradient all-reduce failed on rank {self.rank}: {exc}") from None

    def sum_arrays(self, *arrays):
        """The sums over all ranks of several arrays, sent as one message."""
        flat = np.concatenate([np.asarray(a).reshape(-1) for a in arrays])
        self.all_reduce_in_place(flat)
        sums, offset = [], 0
        for array in arrays:
            sums.append(flat[offset:offset + array.size].reshape(array.shape))
            offset += array.size
        return sums

    def sum_tensors(self, tensors):
        """All-reduce (sum) dense tensors from inside a ``tf.function``: one message per dtype.

        float16 and bfloat16 tensors travel and are summed as float32, then cast back (every rank
        casts the same float32 sum, so all ranks still end with the same bits).
        """
        import tensorflow as tf

        sums = [None] * len(tensors)
        by_dtype = {}
        for index, tensor in enumerate(tensors):
            by_dtype.setdefault(_wire_dtype(tf, tensor.dtype), []).append(index)
        for dtype, indices in by_dtype.items():
            group = [tf.cast(tensors[i], dtype) if tensors[i].dtype != dtype else tensors[i] for i in indices]
            results = tf.numpy_function(self.sum_arrays, group, [dtype] * len(group), stateful=True,
                                        name="kerasdist_ring_all_reduce")
            for index, result in zip(indices, results):
                result.set_shape(tensors[index].shape)
                sums[index] = tf.cast(result, tensors[index].dtype) if dtype != tensors[index].dtype else result
        return sums

    def sum_count(self, count):
        """A scalar tensor (a replica's row count) summed over all ranks, from inside a ``tf.function``."""
        import tensorflow as tf

        return self.sum_tensors([tf.reshape(count, [1])])[0][0]

    def _ring_all_reduce(self, flat):
        chunks = np.array_split(flat, self.size)
        incoming = np.empty_like(chunks[0])
        for step in range(self.size - 1):  # reduce-scatter: rank r ends owning the sum of chunk r + 1
            send, receive = (self.rank - step) % self.size, (self.rank - step - 1) % self.size
            into = incoming[:len(chunks[receive])]
            self._exchange(chunks[send], into)
            np.add(chunks[receive], into, out=chunks[receive])
        for step in range(self.size - 1):  # all-gather
            send, receive = (self.rank - step + 1) % self.size, (self.rank - step) % self.size
            self._exchange(chunks[send], chunks[receive])

    def _exchange(self, send_array, receive_array):
        """Send one array to the right while receiving one from the left (no deadlock on full buffers)."""
        in_header = bytearray(_HEADER.size)
        outgoing = _nonempty(memoryview(_HEADER.pack(self._messages, send_array.nbytes)), _bytes_view(send_array))
        incoming = _nonempty(memoryview(in_header), _bytes_view(receive_array))
        payload = len(incoming) - 1
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while outgoing or incoming:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise RingError(f"no progress for {self.timeout:g} s (a peer is stuck or gone). "
                                f"{PEERS_MUST_RUN_THE_SAME}")
            readable, writable, _ = select.select([self._left] if incoming else [],
                                                  [self._right] if outgoing else [], [], wait)
            if writable:
                sent = self._right.send(outgoing[0])
                outgoing[0] = outgoing[0][sent:]
                if not len(outgoing[0]):
                    outgoing.pop(0)
            if readable:
                got = self._left.recv_into(incoming[0])
                if not got:
                    raise RingError(f"rank {(self.rank - 1) % self.size} closed the connection (it exited). "
                                    f"{PEERS_MUST_RUN_THE_SAME}")
                incoming[0] = incoming[0][got:]
                if not len(incoming[0]):
                    incoming.pop(0)
                    if len(incoming) == payload:  # the header is in: check it before the payload
                        _check_header(in_header, self._messages, receive_array.nbytes)
        self._messages += 1


def _wire_dtype(tf, dtype):
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _nonempty(*views):
    return [view for view in views if len(view)]


def _check_header(header, expected_number, expected_bytes):
    number, nbytes = _HEADER.unpack(header)
    if (number, nbytes) != (expected_number, expected_bytes):
        raise RingError(f"out of step with its neighbour: got message {number} of {nbytes} bytes, expected "
                        f"message {expected_number} of {expected_bytes} bytes (every worker must run the "
                        "same all-reduces in the same order)")


def _bytes_view(array):
    return memoryview(array).cast("B") if array.nbytes else memoryview(b"")


def _family(host):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _connect(address, deadline):
    host, port = split_address(address)
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RingError(f"cannot connect to the gradient ring at {address}: {exc}") from None
            time.sleep(0.05)


def _proof(secret, rank, size, address):
    """What a hello carries: only a process that knows the job's secret can compute it."""
    message = b"%s|%d|%d|%s" % (_MAGIC, rank, size, address.encode())
    return hmac.new(secret, message, hashlib.sha256).digest()


def _accept(listener, expected_rank, size, deadline, secret, own_address):
    """The previous rank's connection. Every other connection (junk, silence, a hello without the
    secret) is closed as soon as it shows what it is, or after 2 s of silence, while the wait goes on."""
    expected = _HELLO.pack(_MAGIC, expected_rank, size, _proof(secret, expected_rank, size, own_address))
    pending = {}  # socket -> (bytes so far, give-up time)
    listener.setblocking(False)
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise RingError(f"rank {expected_rank} did not connect to the ring in time "
                                "(is a firewall in the way?)")
            for sock, (_, give_up) in list(pending.items()):
                if now >= give_up:
                    pending.pop(sock)
                    sock.close()  # silent for too long
            readable, _, _ = select.select([listener, *pending], [], [], min(0.2, deadline - now))
            for sock in readable:
                if sock is listener:
                    try:
                        accepted, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    accepted.setblocking(False)
                    pending[accepted] = (b"", time.monotonic() + _HELLO_TIMEOUT)
                    continue
                data, give_up = pending[sock]
                try:
                    chunk = sock.recv(_HELLO.size - len(data))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                data += chunk
                public = min(len(data), _PUBLIC_PART)  # the proof is compared only whole, in constant time
                if not chunk or data[:public] != expected[:public]:
                    pending.pop(sock)
                    sock.close()  # hung up, or not the hello of the expected rank
                elif len(data) == _HELLO.size:
                    pending.pop(sock)
                    if hmac.compare_digest(data, expected):
                        sock.setblocking(True)
                        return sock
                    sock.close()  # the right words without the job's secret
                else:
                    pending[sock] = (data, give_up)
    finally:
        for sock in pending:
            sock.close()


def _receive_exactly(sock, count):
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise RingError("connection closed during the handshake")
        data += chunk
    return bytes(data)


def _tune(sock):
    sock.settimeout(None)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():  # a vanished host is noticed in ~25 s
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
