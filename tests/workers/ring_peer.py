"""One rank of a kerasdist TCP ring, for tests/test_tcp_ring.py.

    python tests/workers/ring_peer.py --rank R --size N --dir D --scenario NAME [--timeout S]

Ranks meet through files in D: each writes its address to D/address-R and waits for all.
Scenarios: "sums" (saves D/result-R.npz), "peer_exits", "out_of_step", "stuck_peer".
Prints "RING_ERROR <message>" when the ring raises.
"""

import argparse
import os
import sys
import time

import numpy as np

from kerasdist_plugins.multiworker import ring as tcp_ring

SUM_CASES = {  # name -> (shape, dtype)
    "empty": ((0,), "float32"), "one": ((1,), "float32"), "odd": ((7, 3), "float64"),
    "half": ((33,), "float16"), "ints": ((5,), "int32"), "gradient": ((512, 1024), "float32"),
}


def case_input(name, rank):
    shape, dtype = SUM_CASES[name]
    return (np.random.RandomState(rank).standard_normal(shape) * 10).astype(dtype)


def rendezvous(args):
    listener, address = tcp_ring.listen("127.0.0.1")
    path = os.path.join(args.dir, f"address-{args.rank}")
    with open(path + ".tmp", "w") as f:
        f.write(address)
    os.rename(path + ".tmp", path)
    addresses = []
    for rank in range(args.size):
        other = os.path.join(args.dir, f"address-{rank}")
        while not os.path.exists(other):
            time.sleep(0.02)
        with open(other) as f:
            addresses.append(f.read())
    return tcp_ring.TcpRing.connect(listener, addresses, args.rank, timeout=args.timeout, connect_timeout=30)


def sums(ring, args):
    import tensorflow as tf

    results = {name: ring.all_reduce(case_input(name, ring.rank)) for name in SUM_CASES}
    several = ring.sum_arrays(*(case_input(name, ring.rank) for name in ("one", "gradient")))
    results.update(several_one=several[0], several_gradient=several[1])
    tensors = [tf.constant(case_input(name, ring.rank)) for name in ("odd", "gradient", "half")]
    in_graph = tf.function(ring.sum_tensors)(tensors)
    results.update({f"graph_{name}": t.numpy() for name, t in zip(("odd", "gradient", "half"), in_graph)})
    np.savez(os.path.join(args.dir, f"result-{ring.rank}.npz"), **results)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args()
    ring = rendezvous(args)
    print("CONNECTED", flush=True)
    try:
        if args.scenario == "sums":
            sums(ring, args)
        elif args.scenario == "peer_exits":
            if ring.rank == 1:
                os._exit(0)
            ring.all_reduce(np.ones(1000, np.float32))
        elif args.scenario == "out_of_step":
            ring.all_reduce(np.ones(10 * (ring.rank + 1), np.float32))
        elif args.scenario == "stuck_peer":
            if ring.rank == 1:
                time.sleep(60)
            started = time.monotonic()
            try:
                ring.all_reduce(np.ones(1000, np.float32))
            finally:
                print(f"WAITED {time.monotonic() - started:.2f}", flush=True)
    except tcp_ring.RingError as exc:
        print(f"RING_ERROR {exc}", flush=True)
        try:  # the ring is now unusable, and says so
            ring.all_reduce(np.ones(1, np.float32))
        except tcp_ring.RingError as again:
            print(f"AFTER {again}", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
