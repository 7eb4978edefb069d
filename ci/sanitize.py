#!/usr/bin/env python3
"""compute-sanitizer over kvverify's GPU tests, each run judged from its logs (`ci/gpu.sh sanitizer`).

    python3 ci/sanitize.py --out DIR [--tools memcheck,racecheck,synccheck]
    python3 ci/sanitize.py --judge LOG...        # judge logs of an earlier run

memcheck runs the op and kernel GPU tests, racecheck and synccheck the harness kernels' tests
(TESTS below). Tests marked `sanitizer_incompatible` are deselected (pyproject.toml: the sanitizer
keeps freed allocations and serializes kernels). memcheck runs with torch's caching allocator off
(PYTORCH_NO_CUDA_MEMORY_CACHING=1), so that an access past a tensor is past an allocation the
sanitizer knows, not inside a cached segment.

A tool passes when pytest passes under it and every error its summaries count is known noise
(NOISE below, each with its reason). The sanitizer writes DIR/sanitizer-TOOL.PID.log per process;
pytest's own output goes to DIR/sanitizer-TOOL.pytest.log. Exit status 0 when every tool passed,
1 when one did not, 2 when compute-sanitizer cannot be found (set COMPUTE_SANITIZER).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

OPS = "tests/device/test_ops_gpu.py"
KERNELS = "tests/device/test_kernels_gpu.py"
TESTS = {"memcheck": [OPS, KERNELS], "racecheck": [KERNELS], "synccheck": [KERNELS]}
# Each tool's wall-clock limit: together under ci/gpu.sh's limit for the step.
TIMEOUT_S = {"memcheck": 300, "racecheck": 140, "synccheck": 140}

# (name, pattern over one report's text, why it is not an error of kvverify's code)
NOISE = (
    (
        "cuGetProcAddress INVALID_VALUE",
        re.compile(r"Program hit CUDA_ERROR_INVALID_VALUE\b.*\bon CUDA API call to cuGetProcAddress(_v2)?\b"),
        ("cuda-python's bindings (and torch) ask the driver for optional entry points with cuGetProcAddress; "
         "where this driver has none it answers CUDA_ERROR_INVALID_VALUE and the caller goes on without it. "
         "On the H200 a memcheck run of the op tests reported 35 of these and no other error (issue 15)."),
    ),
)

PREFIX = "========="
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


@dataclasses.dataclass
class Judgement:
    """What a sanitizer log says: ``counted`` errors (its summaries: errors, and racecheck's
    warnings too), ``noise`` reports per NOISE name, ``other`` reports (their first lines), and how
    many summary lines were found (none: the tool did not finish)."""

    counted: int = 0
    noise: dict[str, int] = dataclasses.field(default_factory=dict)
    other: list[str] = dataclasses.field(default_factory=list)
    summaries: int = 0

    @property
    def unexplained(self) -> int:
        """Errors the summaries count beyond the known noise."""
        return self.counted - sum(self.noise.values())

    @property
    def passed(self) -> bool:
        return self.summaries > 0 and self.unexplained == 0


def reports(text: str) -> list[str]:
    """The sanitizer's reports in ``text``: a report is a line ``========= <text>`` and the indented
    ``=========     ...`` lines after it, joined with single spaces."""
    out: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        body = line[len(PREFIX):]
        if not body.strip():
            continue
        if body.startswith(" ") and not body.startswith("  "):
            out.append([body.strip()])
        elif out:
            out[-1].append(body.strip())
    return [" ".join(r) for r in out]


def judge(text: str, judgement: Judgement | None = None) -> Judgement:
    """Add the log ``text`` to ``judgement`` (a new one by default) and return it."""
    j = judgement or Judgement()
    for report in reports(text):
        if m := SUMMARY.search(report):
            j.counted += int(m.group(1))
            j.summaries += 1
            continue
        if m := RACECHECK_SUMMARY.search(report):
            j.counted += int(m.group(1)) + int(m.group(2))
            j.summaries += 1
            continue
        if report.startswith("COMPUTE-SANITIZER"):
            continue
        name = next((n for n, pattern, _ in NOISE if pattern.search(report)), None)
        if name is None:
            j.other.append(report[:300])
        else:
            j.noise[name] = j.noise.get(name, 0) + 1
    return j


def _say(judgement: Judgement, what: str) -> None:
    print(f"{what}: {judgement.counted} error(s) counted by {judgement.summaries} summary line(s); "
          f"known noise: {dict(judgement.noise) or 'none'}; unexplained: {judgement.unexplained}")
    for line in judgement.other[:20]:
        print(f"  report: {line}")
    if not judgement.summaries:
        print("  no summary line: the sanitizer did not finish (see its log)")


def judge_files(paths: list[str]) -> Judgement:
    j = Judgement()
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            judge(f.read(), j)
    return j


def find_sanitizer() -> str | None:
    candidates = [os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "compute-sanitizer"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def run_tool(sanitizer: str, tool: str, out: str) -> bool:
    for old in glob.glob(os.path.join(out, f"sanitizer-{tool}.*.log")):
        os.remove(old)
    env = dict(os.environ)
    if tool == "memcheck":
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    command = [sanitizer, "--tool", tool, "--target-processes", "all",
               "--log-file", os.path.join(out, f"sanitizer-{tool}.%p.log"),
               sys.executable, "-m", "pytest", "-m", "gpu and not sanitizer_incompatible", "-q", "-p", "no:cacheprovider",
               *TESTS[tool]]
    print(f"== {tool}: {' '.join(command)}", flush=True)
    with open(os.path.join(out, f"sanitizer-{tool}.pytest.log"), "w") as log:
        try:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S[tool],
                                check=False).returncode
        except subprocess.TimeoutExpired:
            print(f"{tool}: did not finish within {TIMEOUT_S[tool]} s")
            return False
    logs = sorted(glob.glob(os.path.join(out, f"sanitizer-{tool}.*[0-9].log")))
    j = judge_files(logs)
    _say(j, f"{tool} ({len(logs)} log(s))")
    print(f"{tool}: pytest exit status {rc} (its output: {log.name})")
    return rc == 0 and j.passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for the logs (default $OUT or out)")
    p.add_argument("--tools", default=",".join(TESTS), help="comma list of memcheck,racecheck,synccheck")
    p.add_argument("--judge", nargs="+", metavar="LOG", help="only judge these sanitizer logs")
    args = p.parse_args(argv)
    if args.judge:
        j = judge_files(args.judge)
        _say(j, "logs")
        return 0 if j.passed else 1
    tools = [t for t in args.tools.split(",") if t]
    unknown = [t for t in tools if t not in TESTS]
    if unknown:
        print(f"ci/sanitize.py: unknown tool(s) {unknown}; choose from {', '.join(TESTS)}", file=sys.stderr)
        return 2
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("ci/sanitize.py: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); "
              "set COMPUTE_SANITIZER to its path", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for name, _, why in NOISE:
        print(f"known noise, not counted: {name}: {why}")
    failed = [tool for tool in tools if not run_tool(sanitizer, tool, args.out)]
    print(f"sanitizer: {'failed: ' + ', '.join(failed) if failed else 'every tool passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
