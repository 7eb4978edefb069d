"""``kvverify merge A.json B.json ... [--json OUT]``: stress and probe reports from different hosts
in one table.

Reports are grouped by platform (GPU, driver, CUDA): per platform, the orders its probe reports
saw read their source early (before the call returned, or before the pending writer finished),
and each cell's verdict over every GPU of that platform (``report.joined_verdict``), side by side
with the other platforms'. A cell whose contract verdict differs between reports (made by
different kvverify versions) is flagged: its verdicts do not compare.

Inputs are read as plain data: stress reports of schema version 1 or 2 (``kvverify stress
--json``), probe reports (``kvverify probe --json``, kind ``kvverify-probe``). The merged
document follows ``kvverify/schemas/merged-report-v1.json`` (``docs/report-schema.md``).

Exit status: 0; 1 when contract verdicts conflict or a cell's verdict fails on some platform
(UNEXPECTED_CORRUPTION, SENSITIVITY_FAILURE); 2 when a report cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from kvverify.check import jsontext
from kvverify.errors import KvverifyError
from kvverify.stress.report import joined_verdict
from kvverify.terms import CONTRACTS, ORDERS, CellVerdict

MERGED_VERSION = 1
STRESS_VERSIONS = (1, 2)
PROBE_KIND = "kvverify-probe"
EARLY = "call"  # kvverify probe's source_read when the source was read out of stream order


class MergeError(KvverifyError, ValueError):
    """A report cannot be merged; the message names the file and what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class PlatformKey:
    """What a verdict depends on besides kvverify: the GPU's name, the driver, the CUDA version
    torch was built with (None where a report does not say)."""

    gpu: str | None
    driver: str | None
    cuda: str | None


def read(path: str) -> dict[str, Any]:
    """The report at ``path`` as parsed JSON. Raises MergeError naming the file when it cannot be
    read, is not UTF-8, is not strict JSON (``kvverify.check.jsontext``: no NaN, Infinity, number
    beyond a float, repeated key or nesting deeper than the decoder allows), or is neither a stress
    report of a known schema version nor a probe report."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = jsontext.loads(f.read())
    except OSError as exc:
        raise MergeError(f"{path}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise MergeError(f"{path}: not UTF-8 (byte {exc.start} is {exc.object[exc.start]:#04x})") from None
    except jsontext.JSONTextError as exc:
        raise MergeError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or _kind(doc) is None:
        raise MergeError(f"{path}: neither a stress report (schema_version {' or '.join(map(str, STRESS_VERSIONS))}, "
                         f"from `kvverify stress --json`) nor a probe report (kind {PROBE_KIND!r}, from "
                         "`kvverify probe --json`)")
    return doc


def _kind(doc: Mapping[str, Any]) -> str | None:
    if doc.get("kind") == PROBE_KIND:
        return "probe"
    version = doc.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version in STRESS_VERSIONS and "cells" in doc:
        return "stress"
    return None


def _field(doc: Mapping[str, Any], path: str, where: str, kind: type = str):
    """``doc``'s field at the dotted ``path``, which must be a ``kind``; raises MergeError naming
    ``where`` and the field when it is missing or of another type."""
    value: Any = doc
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise MergeError(f"{where}: missing field {path!r}")
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise MergeError(f"{where}: field {path!r} is {json.dumps(value)[:40]}, not {_JSON_KINDS[kind]}")
    return value


_JSON_KINDS = {str: "a string", int: "an integer", list: "an array", Mapping: "an object"}


def _cell(c: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(c, Mapping):
        raise MergeError(f"{name}: a cell is {json.dumps(c)[:40]}, not an object")
    return c


def _stress_platform(p: Mapping[str, Any], where: str) -> PlatformKey:
    """The platform of a stress report's ``platform`` object (``where``: for errors); each field a
    string, or null where the report does not say."""
    return PlatformKey(*(None if p.get(key) is None else _field(p, key, where) for key in ("gpu", "driver", "cuda")))


def _probe_platform(p: Mapping[str, Any], where: str) -> PlatformKey:
    """The platform of a probe report's ``platform`` object: each field a string, or null or
    ``"unknown"`` where the probe could not tell."""
    def known(key: str) -> str | None:
        return None if p.get(key) in (None, "unknown") else _field(p, key, where)

    return PlatformKey(known("gpu_name"), known("driver_version"), known("cuda_runtime_version"))


def _gpu_of(rank: int, gpu_platform: Mapping[int, PlatformKey], top: PlatformKey, where: str) -> PlatformKey:
    """The platform of the GPU of ``rank``: its row of ``gpus``, or ``top`` in a report without one."""
    if not gpu_platform:
        return top
    if rank not in gpu_platform:
        raise MergeError(f"{where}: gpu {rank} is not a rank of gpus ({', '.join(map(str, gpu_platform))})")
    return gpu_platform[rank]


def merge(docs: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The merged document of ``docs`` (parsed reports, as ``read`` returns them; ``names``: where
    each came from, for the document and errors). Raises MergeError naming the report and field
    when one lacks what the merge needs."""
    platforms: dict[PlatformKey, dict[str, Any]] = {}

    def platform_of(p: PlatformKey, source: int) -> dict[str, Any]:
        row = platforms.setdefault(p, {"platform": p, "hosts": [], "sources": [], "gpus": 0, "reads_early": None,
                                       "probe_undecided": None})
        if source not in row["sources"]:
            row["sources"].append(source)
        return row

    sources = []
    cells: dict[str, dict[str, Any]] = {}
    for i, (doc, name) in enumerate(zip(docs, names)):
        same = next((names[k] for k in range(i) if docs[k] == doc), None)
        if same is not None:
            raise MergeError(f"{name}: the same report as {same} (given twice?): its GPUs and verdicts would count twice")
        kind = _kind(doc)
        if kind is None:
            raise MergeError(f"{name}: neither a stress report nor a probe report")
        if kind == "probe":
            row = platform_of(_probe_platform(_field(doc, "platform", name, Mapping), f"{name}: platform"), i)
            early = row["reads_early"] if row["reads_early"] is not None else []
            undecided = row["probe_undecided"] if row["probe_undecided"] is not None else []
            for c in _field(doc, "cells", name, list):
                entry = {k: _field(_cell(c, name), k, f"{name}: a probe cell") for k in ("direction", "order", "host_memory")}
                read_at = _field(c, "source_read.value", f"{name}: probe cell {entry}")
                target = early if read_at == EARLY else undecided if read_at != "stream" else None
                if target is not None and entry not in target:
                    target.append(entry)
            row["reads_early"], row["probe_undecided"] = early, undecided
            sources.append({"path": name, "kind": "probe",
                            "version": None if doc.get("version") is None else _field(doc, "version", name, int),
                            "kvverify": None, "created": None, "campaign": None})
            continue
        if doc.get("not_run_reason"):
            raise MergeError(f"{name}: nothing ran on a device there ({str(doc['not_run_reason'])[:200]}): a report of "
                             "contract verdicts only has no platform to compare; leave it out")
        kvverify_version = _field(doc, "platform.kvverify", name)
        gpu_rows = _field(doc, "gpus", name, list) if doc.get("gpus") is not None else []
        gpu_platform: dict[int, PlatformKey] = {}
        for g in gpu_rows:
            rank = _field(g, "rank", f"{name}: gpus", int)
            if rank in gpu_platform:
                raise MergeError(f"{name}: gpus: rank {rank} appears twice: which row is that GPU's?")
            gpu_platform[rank] = _stress_platform(_field(g, "platform", f"{name}: gpus", Mapping),
                                                  f"{name}: gpus: platform")
        top = _stress_platform(_field(doc, "platform", name, Mapping), f"{name}: platform")
        for g in gpu_rows:
            row = platform_of(gpu_platform[g["rank"]], i)
            row["gpus"] += 1
            if g.get("host") is not None and _field(g, "host", f"{name}: gpus") not in row["hosts"]:
                row["hosts"].append(g["host"])
        if not gpu_rows:
            platform_of(top, i)["gpus"] += 1
        sources.append({"path": name, "kind": "stress", "version": doc["schema_version"], "kvverify": kvverify_version,
                        **{k: None if doc.get(k) is None else _field(doc, k, name) for k in ("created", "campaign")}})
        for c in _field(doc, "cells", name, list):
            label = _field(_cell(c, name), "label", f"{name}: a cell")
            cell = cells.setdefault(label, {
                "label": label, **{k: _field(c, k, f"{name}: {label}") for k in
                                   ("scenario", "direction", "order", "host_memory", "executor")},
                "contracts": {}, "verdicts": {}})
            contract = _field(c, "contract.verdict", f"{name}: {label}")
            if contract not in CONTRACTS:
                raise MergeError(f"{name}: {label}: contract verdict {contract!r} is not one of {', '.join(CONTRACTS)}")
            cell["contracts"][i] = contract
            per_gpu = _field(c, "per_gpu", f"{name}: {label}", list) if c.get("per_gpu") is not None else []
            if per_gpu:
                pairs = [(_gpu_of(_field(p, "gpu", f"{name}: {label}: per_gpu", int), gpu_platform, top,
                                  f"{name}: {label}: per_gpu"),
                          _field(p, "verdict", f"{name}: {label}: per_gpu")) for p in per_gpu]
            else:
                pairs = [(top, _field(c, "verdict", f"{name}: {label}"))]
            for platform, verdict in pairs:
                platform_of(platform, i)  # the report's own platform where no row of gpus says
                try:
                    cell["verdicts"].setdefault(platform, []).append(CellVerdict(verdict))
                except ValueError:
                    raise MergeError(f"{name}: {label}: unknown verdict {verdict!r}") from None
    ids = {p: f"P{k + 1}" for k, p in enumerate(platforms)}
    out_cells, conflicts = [], []
    for cell in cells.values():
        agreed = set(cell["contracts"].values())
        if len(agreed) > 1:
            conflicts.append({"label": cell["label"], "contracts": [
                {"source": s, "kvverify": sources[s]["kvverify"], "verdict": v} for s, v in cell["contracts"].items()]})
        out_cells.append({
            **{k: cell[k] for k in ("label", "scenario", "direction", "order", "host_memory", "executor")},
            "contract": agreed.pop() if len(agreed) == 1 else "CONFLICT",
            "verdicts": {ids[p]: joined_verdict(vs).value for p, vs in cell["verdicts"].items()},
        })
    rows = []
    for p, row in platforms.items():
        rows.append({"id": ids[p], "gpu": p.gpu, "driver": p.driver, "cuda": p.cuda, "hosts": row["hosts"],
                     "gpus": row["gpus"], "sources": row["sources"], "reads_early": _ordered(row["reads_early"]),
                     "probe_undecided": _ordered(row["probe_undecided"])})
    failing = sorted({c["label"] for c in out_cells for v in c["verdicts"].values() if CellVerdict(v).failing})
    return {
        "kind": "kvverify-merge",
        "version": MERGED_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sources": sources,
        "platforms": rows,
        "cells": out_cells,
        "conflicts": conflicts,
        "failing": failing,
        "exit_status": 1 if conflicts or failing else 0,
    }


def _ordered(entries: list[dict[str, str]] | None) -> list[dict[str, str]] | None:
    if entries is None:
        return None
    return sorted(entries, key=lambda e: (ORDERS.index(e["order"]) if e["order"] in ORDERS else len(ORDERS),
                                          e["direction"], e["host_memory"]))


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the merged document, from the package data."""
    text = resources.files("kvverify").joinpath(f"schemas/merged-report-v{MERGED_VERSION}.json").read_text("utf-8")
    return json.loads(text)


# -- the command --------------------------------------------------------------------------------


DESCRIPTION = """\
Merge stress and probe reports from several hosts into one table per platform
(GPU, driver, CUDA): per platform, the orders its probe reports saw read their
source early, and each cell's verdict over every GPU of that platform, side by
side with the other platforms'. A cell whose contract verdict differs between
reports (made by different kvverify versions) is flagged.

Inputs: stress reports (kvverify stress --json, schema 1 or 2) and probe
reports (kvverify probe --json). The merged JSON follows
kvverify/schemas/merged-report-v1.json (docs/report-schema.md)."""

EPILOG = """\
Exit status: 0; 1 when contract verdicts conflict or a cell fails on some
platform (UNEXPECTED_CORRUPTION, SENSITIVITY_FAILURE); 2 when a report cannot
be read or merged: a field of the wrong type, the same report twice, a report
where nothing ran on a device (the file and the reason on stderr).

Example:
  kvverify merge a/stress.json b/stress.json a/probe.json --json fleet.json"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("reports", nargs="+", metavar="REPORT.json",
                        help="stress reports (kvverify stress --json) and probe reports (kvverify probe --json)")
    parser.add_argument("--json", metavar="PATH", help="write the merged document as JSON ('-' for stdout; "
                                                       "the tables then go to stderr)")
    parser.add_argument("--details", action="store_true",
                        help="list every cell's verdicts (default: only where platforms differ, fail or conflict)")


def run(args) -> int:
    from kvverify.stress import render as terminal

    # As stress: the terminal's width, else COLUMNS, else rich's 80; --details in a log without
    # COLUMNS gets 200, so that its table keeps one line per cell.
    console = terminal.console(stderr=args.json == "-")
    if args.details and not console.is_terminal and "COLUMNS" not in os.environ:
        console = terminal.console(stderr=args.json == "-", width=200)
    try:
        docs = [read(path) for path in args.reports]
        merged = merge(docs, args.reports)
    except MergeError as exc:
        print(f"kvverify merge: {exc}", file=sys.stderr)
        return 2
    render(merged, console, details=args.details)
    text = json.dumps(merged, indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    elif args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            print(f"kvverify merge: --json {args.json}: cannot be written ({exc.strerror})", file=sys.stderr)
            return 2
        print(f"kvverify merge: merged report written to {args.json}", file=sys.stderr)
    return merged["exit_status"]


def _report_ref(source: int) -> str:
    """How the tables name a report: its number among the command line's reports."""
    return f"[{source + 1}]"


def _early_text(entries: list[dict[str, str]] | None) -> str:
    if entries is None:
        return "no probe report"
    if not entries:
        return "none"
    by_order: dict[str, list[str]] = {}
    for e in entries:
        by_order.setdefault(e["order"], []).append(f"{e['direction']} {e['host_memory']}")
    return "; ".join(f"{order}: {', '.join(what)}" for order, what in by_order.items())


def render(merged: Mapping[str, Any], console, details: bool = False) -> None:
    """Print the platforms (with what their probes saw read early), each platform's count of cells
    per verdict, the cells that need a reader's eye (platforms differ, a verdict fails, contracts
    conflict; ``details``: every cell) with their contract and each platform's verdict, then the
    conflicts and failures."""
    from rich.table import Table
    from rich.text import Text

    platforms = Table(title="kvverify merge: platforms")
    # "GPU runs", not GPUs: a stress report names no GPU by serial, so one GPU in two reports counts twice
    for name in ("Platform", "GPU", "Driver", "CUDA", "Hosts", "GPU runs", "Reports"):
        platforms.add_column(name, overflow="fold")
    for p in merged["platforms"]:
        platforms.add_row(*map(Text, (p["id"], p["gpu"] or "?", p["driver"] or "?", p["cuda"] or "?",
                                      ", ".join(p["hosts"]) or "-", str(p["gpus"]),
                                      " ".join(_report_ref(s) for s in p["sources"]))))  # text, never markup
    console.print(platforms)
    # A path folded over several lines of a table cell can be neither read nor copied: the table names
    # each report by number, and each path has a line of its own, however wide. The probes' findings
    # are sentences: they wrap as prose below the table rather than fold in a narrow column.
    for number, source in enumerate(merged["sources"]):
        console.print(Text(f"{_report_ref(number)} {source['path']}"), no_wrap=True, overflow="ignore", crop=False)
    for p in merged["platforms"]:
        console.print(Text(f"{p['id']} read early (probe): {_early_text(p['reads_early'])}"))
    ids = [p["id"] for p in merged["platforms"]]
    with_cells = [i for i in ids if any(i in c["verdicts"] for c in merged["cells"])]
    if merged["cells"]:
        counts = Table(title="kvverify merge: cells per verdict")
        counts.add_column("Platform")
        seen = [v for v in CellVerdict if any(c["verdicts"].get(i) == v.value for c in merged["cells"] for i in ids)]
        for v in seen:
            counts.add_column(v.value, justify="right")
        for i in with_cells:
            counts.add_row(i, *(str(sum(c["verdicts"].get(i) == v.value for c in merged["cells"])) for v in seen))
        console.print(counts)
        differ = [c for c in merged["cells"] if len(set(c["verdicts"].values())) > 1]
        shown = merged["cells"] if details else [
            c for c in merged["cells"] if c in differ or c["contract"] == "CONFLICT" or c["label"] in merged["failing"]]
        table = Table(title="kvverify merge: " + ("verdicts per platform" if details else
                                                  "cells where platforms differ, fail or conflict"))
        table.add_column("Cell", overflow="fold")
        table.add_column("Contract")
        for i in with_cells:
            table.add_column(i, no_wrap=True)
        for c in shown:
            contract = Text(c["contract"], style="bold red" if c["contract"] == "CONFLICT" else "")
            verdicts = []
            for i in with_cells:
                v = c["verdicts"].get(i)
                verdicts.append(Text(v or "-", style="bold red" if v and CellVerdict(v).failing else ""))
            table.add_row(Text(c["label"]), contract, *verdicts)
        if shown:
            console.print(table)
        console.print(f"Platforms disagree on {len(differ)} of {len(merged['cells'])} cells."
                      + ("" if details else " --details lists every cell."), markup=False, highlight=False)
    for conflict in merged["conflicts"]:
        versions = ", ".join(f"{_report_ref(k['source'])} (kvverify {k['kvverify']}): {k['verdict']}"
                             for k in conflict["contracts"])
        console.print(Text(f"CONFLICT {conflict['label']}: contract verdicts differ: {versions}", style="bold red"))
    if merged["failing"]:
        console.print(Text(f"Failing on some platform: {', '.join(merged['failing'])}", style="bold red"))
