"""What the host watch's own bookkeeping costs per step of an engine-style loop, on the host alone
(no GPU: the driver calls native capture would feed it are fed by hand, over anonymous memory
declared as pinned and device memory).

    python benchmarks/bench_host_watch.py                 # 32 layers, 8 blocks of 16 KiB a transfer
    python benchmarks/bench_host_watch.py --steps 200 --in-flight 8

Each step issues one store and two loads (one batched copy each, a block of every layer), records an
event after each and completes the transfer ``--in-flight`` transfers back, as the demo offload
handler does (``kvverify.record.demo``). Prints the milliseconds a step spends in the watch, and
where (mprotect calls, device ops, completions: ``HostWatch.stats``). Needs ``kvverify._C`` on
x86-64 Linux. Not a test: ``bench_record.py`` measures the recorder on a GPU, this the watch's part
of it where a GPU is not at hand.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64, help="host blocks per layer")
    parser.add_argument("--blocks-per-transfer", type=int, default=8)
    parser.add_argument("--block-bytes", type=int, default=16 << 10)
    parser.add_argument("--in-flight", type=int, default=3, help="transfers pending before one completes")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)

    from kvverify.device.extension import ops

    ops()  # loads torch's libraries and the extension (raises with the build hint where it is missing)
    from kvverify import _C
    from kvverify.record.capture.watch import HostWatch

    lib = ctypes.PyDLL(_C.__file__)
    lib.kvverify_native_enable.argtypes = [ctypes.c_int]
    watch = HostWatch(lib)
    lib.kvverify_native_enable(1)
    why = watch.start()
    if why is not None:
        print(f"bench_host_watch: the host watch cannot start here: {why}", file=sys.stderr)
        return 2
    try:
        size = args.blocks * args.block_bytes
        pools = [mmap.mmap(-1, size) for _ in range(args.layers)]
        bases = [ctypes.addressof(ctypes.c_char.from_buffer(p)) for p in pools]
        for base in bases:
            watch.declare(base, size, host=True)
        device = mmap.mmap(-1, args.layers * size)
        device_base = ctypes.addressof(ctypes.c_char.from_buffer(device))
        watch.declare(device_base, args.layers * size, host=False)
        n, block = args.blocks_per_transfer, args.block_bytes

        def transfer(store: bool, first: int) -> list[tuple[int, int, bool]]:
            accesses = []
            for layer, base in enumerate(bases):
                for b in range(first, first + n):
                    host, dev = base + (b % args.blocks) * block, device_base + layer * size + (b % args.blocks) * block
                    accesses += [(dev, block, False), (host, block, True)] if store else \
                        [(host, block, False), (dev, block, True)]
            return accesses

        transfers = [transfer(kind == 0, (3 * step + kind) * n) for step in range(args.steps) for kind in range(3)]
        stream, event = 0x7000, 0xE000
        start = time.perf_counter()
        for k, accesses in enumerate(transfers):
            watch.device_ops(stream, accesses)
            watch.event_recorded(event + k, stream)
            if k >= args.in_flight:
                watch.event_completed(event + k - args.in_flight)
        seconds = time.perf_counter() - start
        stats = watch.stats()
    finally:
        watch.stop()
        lib.kvverify_native_enable(0)
    per_step = {what: (count / args.steps, ms / args.steps) for what, (count, ms) in stats.items()}
    inside = sum(ms for what, (_, ms) in per_step.items() if what in ("device ops", "completions"))
    print(f"host watch: {1e3 * seconds / args.steps:.3f} ms a step in all (with this script's own calls), "
          f"{inside:.3f} ms inside the watch; per step (count, ms): "
          + ", ".join(f"{what} {count:.1f} / {ms:.3f}" for what, (count, ms) in per_step.items())
          + f" [{args.layers} layers, {n} blocks of {block} bytes a transfer, 3 transfers a step, "
          f"threads {threading.active_count()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
