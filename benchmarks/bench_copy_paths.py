"""The copy-path figures of issue 14 against its targets, from the JSON that ``kvverify bench`` writes.
Prints figures; a figure short of its target is reported, not raised (this is a benchmark, not a test).

    kvverify bench --quick --no-repeat --json bench.json            # 64 MiB per call: 4096 pages of 16 KiB
    kvverify bench --calibrate -o paths.json
    python benchmarks/bench_copy_paths.py bench.json [paths.json]

Targets (GB/s, 1e9 bytes/s, pinned host memory; event-timed unless said otherwise):
- the kernel path at >= 45 GB/s for 16 KiB pages, H2D and D2H, and >= 10x the driver batch (STREAM) for H2D,
  end to end (the issue's own driver-batch figures are end-to-end: at small pages the batch's cost is its call,
  which the event-timed figure leaves out; both ratios are printed);
- the best safe path (STREAM, loop or kernel) at >= 90% of the point's ceiling (one contiguous copy of the same
  bytes, both directions at once for ``both``) for every page size from 16 KiB, in each direction and both at once.
Also printed: the compute slowdown of a bf16 matmul under each path, and the calibration's pick per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvverify.measure.calibration import SAFE_PATHS  # noqa: E402
from kvverify.units import format_size  # noqa: E402

KERNEL_TARGET_GBPS = 45.0
KERNEL_OVER_BATCH_H2D = 10.0
OF_CEILING = 0.90
FROM_PAGE = 16 * 1024


def median(method: dict | None, key: str = "gbps") -> float | None:
    if method is None or method[key]["n"] == 0:
        return None
    return method[key]["median"]


def gbps(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def verdict(ok: bool | None) -> str:
    return "n/a (not measured)" if ok is None else "met" if ok else "NOT MET"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", help="kvverify bench --json output")
    parser.add_argument("paths", nargs="?", help="kvverify bench --calibrate -o output")
    args = parser.parse_args()
    doc = json.loads(Path(args.bench).read_text())
    points = doc["points"]
    plat = doc["platform"]
    print(f"{plat.get('gpu_name')} driver {plat.get('driver_version')}, {doc['config']['host_memory']} host memory")

    print(f"\n1. kernel path at {format_size(FROM_PAGE)} pages (target >= {KERNEL_TARGET_GBPS:g} GB/s; "
          f"H2D >= {KERNEL_OVER_BATCH_H2D:g}x STREAM)")
    for direction in ("h2d", "d2h"):
        for p in (p for p in points if p["direction"] == direction and p["page_bytes"] == FROM_PAGE):
            kernel, stream = median(p["methods"].get("kernel")), median(p["methods"].get("STREAM"))
            ok = None if kernel is None else kernel >= KERNEL_TARGET_GBPS
            line = (f"   {direction} {p['pages_per_call']} pages/call: kernel {gbps(kernel)} GB/s "
                    f"(>= {KERNEL_TARGET_GBPS:g}: {verdict(ok)}); STREAM {gbps(stream)} GB/s")
            if direction == "h2d" and kernel is not None and stream:
                k_e2e = median(p["methods"].get("kernel"), "e2e_gbps")
                s_e2e = median(p["methods"].get("STREAM"), "e2e_gbps")
                line += f"; kernel/STREAM {kernel / stream:.1f}x event-timed"
                if k_e2e and s_e2e:
                    ratio = k_e2e / s_e2e
                    line += (f", end to end {gbps(k_e2e)}/{gbps(s_e2e)} = {ratio:.1f}x "
                             f"(>= {KERNEL_OVER_BATCH_H2D:g}x: {verdict(ratio >= KERNEL_OVER_BATCH_H2D)})")
            print(line)

    print(f"\n2. best safe path against the ceiling, pages from {format_size(FROM_PAGE)} (target >= {OF_CEILING:.0%})")
    for p in sorted(points, key=lambda p: (p["direction"], p["page_bytes"], p["pages_per_call"])):
        if p["page_bytes"] < FROM_PAGE:
            continue
        safe = {m: median(p["methods"].get(m)) for m in SAFE_PATHS}
        safe = {m: v for m, v in safe.items() if v is not None}
        ceiling = median(p["methods"].get("ceiling"))
        if not safe or not ceiling:
            print(f"   {p['direction']} {p['label']}: {verdict(None)}")
            continue
        best = max(safe, key=safe.get)
        share = safe[best] / ceiling
        print(f"   {p['direction']:4} {format_size(p['page_bytes']):>8} x {p['pages_per_call']:>5}: {best} "
              f"{safe[best]:.1f} of {ceiling:.1f} GB/s = {share:.1%}: {verdict(share >= OF_CEILING)}")

    if doc["config"].get("compute"):
        cfg = doc["config"]["compute"]
        print(f"\n3. compute slowdown: {cfg['matmul_size']}^2 bf16 matmuls while each path copies "
              "(median; ? = the copies did not share the whole matmul window in some reps)")
        for p in points:
            parts = []
            for name, m in p["methods"].items():
                c = m.get("compute")
                if c and c["n"]:
                    parts.append(f"{name} {100 * c['slowdown']['median']:+.1f}%{'' if c['overlapped'] == c['n'] else '?'}")
            print(f"   {p['direction']:4} {p['label']}: " + ", ".join(parts))

    if args.paths:
        paths = json.loads(Path(args.paths).read_text())
        print(f"\n4. calibration ({len(paths['entries'])} shapes, ranked by {paths['ranked_by']}): best path per shape")
        for e in paths["entries"]:
            runner = e["runner_up"]
            print(f"   {e['direction']:4} {format_size(e['page_bytes']):>8} x {e['pages_per_call']:>5}: "
                  f"{e['best']['path']} {e['best']['gbps']:.1f}"
                  + (f" (runner-up {runner['path']} {runner['gbps']:.1f})" if runner else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
