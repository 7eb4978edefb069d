"""Throughput of the numpy block-pattern reference on this CPU (one core: numpy does not thread).

    python benchmarks/bench_pattern.py [--mb 256] [--block-bytes 4096 65536 2097152] [--repeat 3]
                                       [--tile-words 65536 ...]

Prints MB/s (10**6 bytes of blocks per second, best of --repeat) for fill_blocks,
classify_blocks (all OK, the common case; and all STALE) and checksum_blocks_reference.
--tile-words sweeps kvverify.device.pattern.TILE_WORDS, the tile that bounds temporaries.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvverify.device import pattern


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


WIDTHS = (10, 17, 20, 14)


def measure(blocks: np.ndarray, ids: np.ndarray, repeat: int) -> tuple[float, ...]:
    """Best seconds of fill, classify (all OK), classify (all STALE), checksum over ``blocks``."""
    t_fill = best_seconds(lambda: pattern.fill_blocks(blocks, ids, 5, 1234), repeat)
    states, _ = pattern.classify_blocks(blocks, ids, 5, 1234)
    assert (states == pattern.BlockState.OK).all()
    t_ok = best_seconds(lambda: pattern.classify_blocks(blocks, ids, 5, 1234), repeat)
    t_stale = best_seconds(lambda: pattern.classify_blocks(blocks, ids, 6, 1234), repeat)
    t_sum = best_seconds(lambda: pattern.checksum_blocks_reference(blocks), repeat)
    return t_fill, t_ok, t_stale, t_sum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="total bytes of blocks, in MiB")
    ap.add_argument("--block-bytes", type=int, nargs="+", default=[4096, 65536, 2 << 20])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tile-words", type=int, nargs="+", default=[pattern.TILE_WORDS])
    args = ap.parse_args()

    print(f"{'block_bytes':>11} {'tile_words':>10} {'fill MB/s':>10} {'classify OK MB/s':>17} "
          f"{'classify STALE MB/s':>20} {'checksum MB/s':>14}")
    for block_bytes in args.block_bytes:
        words = block_bytes // 8
        n = max(1, (args.mb << 20) // block_bytes)
        total = n * block_bytes
        blocks = np.empty((n, words), dtype=np.uint64)
        ids = np.arange(n, dtype=np.int64) * 7 + 3
        for tile in args.tile_words:
            pattern.TILE_WORDS = tile
            row = measure(blocks, ids, args.repeat)
            print(f"{block_bytes:>11} {tile:>10} " + " ".join(f"{total / t / 1e6:>{w}.0f}" for t, w in zip(row, WIDTHS, strict=True)),
                  flush=True)


if __name__ == "__main__":
    main()
