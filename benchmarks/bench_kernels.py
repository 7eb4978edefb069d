"""Bandwidth of the harness kernels on the GPU (needs a CUDA device and the built extension).

    python benchmarks/bench_kernels.py [--device-mib 1024] [--host-mib 256] [--block-bytes 4096 65536 2097152]

For device memory and pinned host memory (reached through UVA), prints GB/s (10**9 bytes of
blocks per second, best of --repeat, CUDA events) for write_blocks, verify_blocks and
checksum_blocks, with addresses and ids already on the device.
"""

from __future__ import annotations

import argparse

import torch

from kvverify.device import kernels


def best_ms(fn, repeat: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def measure(ptrs, block_bytes: int, ids, repeat: int) -> tuple[float, float, float]:
    """Best milliseconds of write_blocks, verify_blocks and checksum_blocks over the blocks."""
    t_write = best_ms(lambda: kernels.write_blocks(ptrs, block_bytes, ids, 1, 7), repeat)
    states, _ = kernels.verify_blocks(ptrs, block_bytes, ids, 1, 7)
    assert bool((states == 0).all()), "blocks written by write_blocks do not verify OK"
    t_verify = best_ms(lambda: kernels.verify_blocks(ptrs, block_bytes, ids, 1, 7), repeat)
    t_sum = best_ms(lambda: kernels.checksum_blocks(ptrs, block_bytes), repeat)
    return t_write, t_verify, t_sum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device-mib", type=int, default=1024)
    ap.add_argument("--host-mib", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, nargs="+", default=[4096, 65536, 2 << 20])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'memory':>8} {'block_bytes':>11} {'write GB/s':>11} {'verify GB/s':>12} {'checksum GB/s':>14}")
    for memory, mib in (("device", args.device_mib), ("pinned", args.host_mib)):
        total = mib << 20
        if memory == "device":
            pool = torch.empty(total, dtype=torch.uint8, device="cuda")
        else:
            pool = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        for block_bytes in args.block_bytes:
            n = total // block_bytes
            ptrs = (pool.data_ptr() + block_bytes * torch.arange(n, dtype=torch.int64)).cuda()
            ids = torch.arange(n, dtype=torch.int64, device="cuda")
            t_write, t_verify, t_sum = measure(ptrs, block_bytes, ids, args.repeat)
            nbytes = n * block_bytes
            gbps = [nbytes / (t * 1e-3) / 1e9 for t in (t_write, t_verify, t_sum)]
            print(f"{memory:>8} {block_bytes:>11} {gbps[0]:>11.1f} {gbps[1]:>12.1f} {gbps[2]:>14.1f}", flush=True)
        del pool


if __name__ == "__main__":
    main()
