"""Latency of one gloo all_reduce on this machine: a 4-float tensor (a metric's state) vs the 2.1 MB gradient of
bench_torch.py's MLP. Run: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/gloo_latency.py"""

import time

import torch
import torch.distributed as dist

CALLS = 30


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    small, big = torch.randn(4), torch.randn(535_562)
    for name, tensor in (("4 floats", small), ("535,562 floats (2.1 MB)", big), ("4 floats again", small)):
        for _ in range(3):
            dist.all_reduce(tensor)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            dist.all_reduce(tensor)
        if dist.get_rank() == 0:
            print(f"all_reduce of {name}: {(time.perf_counter() - start) / CALLS * 1000:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
