#!/usr/bin/env python3
"""Checks on report files for the GPU rounds of ci/gpu.sh (standard library, plus jsonschema to validate).

    python3 ci/reports.py same-verdicts A.json B.json   # two stress reports: the same verdict for every cell?
                                                        # (a native RACY cell that saw its race in one run only is timing)
    python3 ci/reports.py validate FILE.json...          # stress (schema 1 or 2) and merged documents

Exit status 0 when the check holds, 1 when it does not (the differences are printed), 2 when a file
cannot be read or jsonschema is missing (a validation not done is not a pass).
"""

from __future__ import annotations

import json
import sys


def _load(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"ci/reports.py: {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


# A RACY cell's verdict on the native executor is an observation: whether the race showed in its
# trials is timing, and two plain runs of the same campaign differ there too. Any other difference
# (a contract, an adversarial or kernel cell, a SAFE cell, a failure) is a real one.
OBSERVED_BY_LUCK = {"CONFIRMED_RACE", "NO_RACE_OBSERVED"}


def same_verdicts(a: str, b: str) -> int:
    ca = {c["label"]: c for c in _load(a)["cells"]}
    cb = {c["label"]: c for c in _load(b)["cells"]}
    differ, luck = [], []
    for label in sorted(ca.keys() | cb.keys()):
        x, y = ca.get(label), cb.get(label)
        va, vb = (c["verdict"] if c else "absent" for c in (x, y))
        if va == vb:
            continue
        print(f"{label}: {a}: {va}, {b}: {vb}")
        timing = (x and y and x["executor"] == "native" and x["contract"] == y["contract"]
                  and {va, vb} <= OBSERVED_BY_LUCK)
        (luck if timing else differ).append(label)
    print(f"{len(ca)} and {len(cb)} cells; {len(differ) + len(luck)} with different verdicts: {len(luck)} native "
          f"RACY cells where the race showed in one run only (timing), {len(differ)} other")
    return 1 if differ else 0


def validate(paths: list[str]) -> int:
    try:
        import jsonschema
    except ImportError:
        print("ci/reports.py: jsonschema is not installed: nothing validated (pip install jsonschema, or validate "
              "the files on a host that has it)", file=sys.stderr)
        return 2
    from kvverify.stress import merge, report

    bad = 0
    for path in paths:
        doc = _load(path)
        if doc.get("kind") == "kvverify-merge":
            schema, what = merge.load_schema(), "merged document"
        elif doc.get("schema_version") in (1, 2):
            version = doc["schema_version"]
            schema, what = report.load_schema(version), f"stress report, schema {version}"
        else:
            print(f"{path}: neither a merged document nor a stress report of schema 1 or 2")
            bad += 1
            continue
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
        for e in errors[:10]:
            print(f"{path}: {'/'.join(map(str, e.path)) or '(top)'}: {e.message[:200]}")
        print(f"{path}: {what}: {'valid' if not errors else f'{len(errors)} error(s)'}")
        bad += bool(errors)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "same-verdicts":
        return same_verdicts(argv[1], argv[2])
    if len(argv) >= 2 and argv[0] == "validate":
        return validate(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
