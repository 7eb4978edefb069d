"""``kvverify record`` against PyTorch's CUDA Stream Sanitizer (CSAN) on the same programs: the demo
offload handler (``kvverify.record.demo``) in its safe form and with each mistake.

    python benchmarks/compare_csan.py                  # prints a markdown table for docs/record.md
    python benchmarks/compare_csan.py --json out/record-vs-csan.json

Per form: what the recorder reports (verdict, races, the pair of lines of the first), what CSAN
reports (``torch.cuda._sanitizer.enable_cuda_sanitizer()`` in a child process: CSAN cannot be
turned off, and it stops the program at the first race it finds), and how many loaded pages were
corrupted when the program ran natively and under CSAN (checked on the host after the run). The
loop does the model's work on the compute stream (a matmul per layer), so that compute is busy when
transfers are issued, as in a serving engine. Needs a CUDA device and ``kvverify._C``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HAZARD = {None: "-", "store-any": "H1", "load-no-wait": "H2 (WAW)", "load-into-read": "H2 (WAR)",
          "descriptor-rewrite": "H3", "aten-race": "control (aten ops only)"}

CHILD = """\
import sys
import torch.cuda._sanitizer as csan
csan.enable_cuda_sanitizer()
from kvverify.record import demo
shape = demo.Shape(**{shape!r})
engine = demo.Engine(shape, {mistake!r})
engine.run()
print("corrupted", engine.corrupted_loads())
"""


def shape_args(args) -> dict:
    n = args.blocks_per_transfer
    return dict(layers=args.layers, steps=args.steps, blocks_per_transfer=n, gpu_blocks=12 * n, cpu_blocks=8 * n,
                block_bytes=args.block_bytes, in_flight=16, hidden=args.hidden, tokens=args.tokens)


def under_csan(shape: dict, mistake: str | None) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD.format(shape=shape, mistake=mistake)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    found = "CSAN detected a possible data race" in r.stderr
    corrupted = next((int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("corrupted")), None)
    lines = r.stderr.splitlines()
    first = next((lines[i + 1].strip() for i, line in enumerate(lines[:-1]) if line.rstrip().endswith("during kernel:")),
                 "")
    return {"race_reported": found, "exit": r.returncode, "corrupted": corrupted, "first_line": first,
            "stderr_tail": r.stderr[-400:] if r.returncode and not found else ""}


def recorded(shape: dict, mistake: str | None) -> dict:
    from kvverify.record import demo, recording

    engine = demo.Engine(demo.Shape(**shape), mistake)
    with recording() as rec:
        engine.run()
    verdict = rec.check()
    ops = rec.trace()["ops"]
    pair = ""
    if verdict.races:
        r = verdict.races[0]
        pair = f"{r.kind}: {ops[r.first].get('at', '?')} / {ops[r.second].get('at', '?')}"
    native = demo.Engine(demo.Shape(**shape), mistake)
    native.run()
    return {"verdict": verdict.verdict, "races": len(verdict.races), "first_pair": pair,
            "corrupted_native": native.corrupted_loads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--blocks-per-transfer", type=int, default=16)
    parser.add_argument("--block-bytes", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--forms", nargs="+", default=None, metavar="FORM",
                        help="only these forms (safe, or a mistake of kvverify.record.demo.MISTAKES); default: all")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)

    from kvverify import device
    from kvverify.record import demo

    forms = {"safe": None, **{m: m for m in demo.MISTAKES}}
    unknown = sorted(set(args.forms or ()) - set(forms))
    if unknown:
        parser.error(f"unknown form(s) {', '.join(unknown)}; forms: {', '.join(forms)}")
    reason = device.gpu_refusal()
    if reason:
        print(f"compare_csan: {reason}", file=sys.stderr)
        return 2
    shape = shape_args(args)
    rows = []
    for mistake in (forms[f] for f in (args.forms or forms)):
        row = {"form": mistake or "safe", "hazard": HAZARD[mistake], **recorded(shape, mistake)}
        row["csan"] = under_csan(shape, mistake)
        rows.append(row)
        print(f"{row['form']}: record {row['verdict']} ({row['races']} races), CSAN "
              f"{'race' if row['csan']['race_reported'] else 'nothing'} (exit {row['csan']['exit']})", file=sys.stderr,
              flush=True)
    print(f"\n{shape['layers']} layers, {shape['steps']} steps, {shape['blocks_per_transfer']} blocks of "
          f"{shape['block_bytes']} bytes per layer and transfer, compute: a ({shape['tokens']} x {shape['hidden']}) "
          f"@ ({shape['hidden']} x {shape['hidden']}) fp16 matmul per layer; the last load into each GPU block "
          "checked, per page\n")
    print("| form | hazard | kvverify record | CSAN | corrupted pages, native | corrupted pages, under CSAN |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        c = row["csan"]
        csan = "race reported" if c["race_reported"] else ("nothing" if c["exit"] == 0 else f"exit {c['exit']}")
        under = "stopped at the race" if c["race_reported"] else (c["corrupted"] if c["corrupted"] is not None else "?")
        record = row["verdict"] + (f", {row['races']} races; first {row['first_pair']}" if row["races"] else "")
        print(f"| {row['form']} | {row['hazard']} | {record} | {csan} | {row['corrupted_native']} | {under} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
