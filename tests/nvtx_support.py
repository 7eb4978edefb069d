"""Test helpers: record NVTX ranges without Nsight Systems.

``tests/nvtx_inject/inject.c`` is an NVTX injection library: NVTX loads the library named
by ``NVTX_INJECTION64_PATH`` at a process's first NVTX call, as it loads Nsight Systems'
own, and the library writes one JSON line per NVTX event to ``KVVERIFY_NVTX_LOG``. The
helpers here build it with the system C compiler against the NVTX v3 headers, run a command
under it, parse the log and rebuild the push/pop range tree of each thread.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INJECT_SOURCE = Path(__file__).resolve().parent / "nvtx_inject" / "inject.c"
LIBRARY_NAME = "libkvverify_nvtx_recorder.so"
LOG_ENV = "KVVERIFY_NVTX_LOG"
INJECTION_ENV = "NVTX_INJECTION64_PATH"
HEADER = os.path.join("nvtx3", "nvToolsExt.h")


class InjectionUnavailable(RuntimeError):
    """The recorder cannot be built here (no C compiler, no NVTX headers, not Linux)."""


def find_c_compiler() -> str | None:
    """``$CC`` if set and found, else the first of ``cc``, ``gcc``, ``clang`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def _header_roots() -> list[Path]:
    """Directories that may hold ``nvtx3/nvToolsExt.h``, most specific first."""
    roots: list[Path] = []
    site_dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    site_dirs.update(p for p in sys.path if p and os.path.isdir(p))
    try:  # the `nvtx` package: some builds ship the headers (the PyPI wheels do not)
        import nvtx

        roots.extend(Path(p).parent for p in glob.glob(
            os.path.join(os.path.dirname(nvtx.__file__), "**", "nvtx3"), recursive=True))
    except Exception:
        pass
    for site in sorted(site_dirs):
        # nvidia-nvtx wheels (a dependency of CUDA builds of torch): nvidia/cu13/include,
        # nvidia/nvtx/include, ...
        roots.extend(Path(p).parent for p in glob.glob(os.path.join(site, "nvidia", "*", "include", "nvtx3")))
        roots.extend(Path(p).parent for p in glob.glob(os.path.join(site, "nvidia", "include", "nvtx3")))
    for env in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(env):
            roots.append(Path(os.environ[env]) / "include")
    roots.extend(Path(p) for p in ("/usr/local/cuda/include", *sorted(glob.glob("/usr/local/cuda-*/include")),
                                   "/usr/include", "/opt/nvidia/include"))
    return roots


def find_nvtx_include() -> Path | None:
    """The first directory ``D`` with ``D/nvtx3/nvToolsExt.h`` (the NVTX v3 headers).

    ``KVVERIFY_NVTX_INCLUDE``, when set, is the only place looked at.
    """
    override = os.environ.get("KVVERIFY_NVTX_INCLUDE")
    for root in [Path(override)] if override else _header_roots():
        if (root / HEADER).is_file() and (root / "nvtx3" / "nvToolsExtPayload.h").is_file():
            return root
    return None


def build_injection_library(out_dir: Path) -> Path:
    """Compile ``inject.c`` into ``out_dir``; raise ``InjectionUnavailable`` saying why not."""
    if not sys.platform.startswith("linux"):
        raise InjectionUnavailable(f"the NVTX recorder is built for Linux only (this is {sys.platform})")
    cc = find_c_compiler()
    if cc is None:
        raise InjectionUnavailable("no C compiler found (set CC, or install cc/gcc/clang) to build the NVTX recorder")
    include = find_nvtx_include()
    if include is None:
        raise InjectionUnavailable(
            "NVTX v3 headers (nvtx3/nvToolsExt.h) not found: the nvtx wheel does not ship them; install "
            "nvidia-nvtx (pulled in by CUDA builds of torch) or the CUDA toolkit, or set KVVERIFY_NVTX_INCLUDE"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / LIBRARY_NAME
    cmd = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-std=gnu99", f"-I{include}",
           str(INJECT_SOURCE), "-o", str(library), "-lpthread"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        # A compiler that is present but fails on our source is a bug, not a reason to skip.
        raise RuntimeError(f"building the NVTX recorder failed: {' '.join(cmd)}\n{result.stderr}")
    return library


def injection_env(library: Path, log: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment that loads the recorder into NVTX and logs to ``log``."""
    env = dict(os.environ if base is None else base)
    env[INJECTION_ENV] = str(library)
    env[LOG_ENV] = str(log)
    env.pop("NVTX_DISABLE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_recorded(cmd: list[str], library: Path, log: Path, *, timeout: float = 600,
                 extra_env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with the recorder attached; return the completed process (output captured)."""
    env = injection_env(library, log)
    env.update(extra_env or {})
    return subprocess.run(cmd, env=env, cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def read_events(log: Path) -> list[dict]:
    """Parse the recorder's log (one JSON object per line), in ``seq`` order per process."""
    if not log.exists():
        return []
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: (e["pid"], e["seq"]))


@dataclasses.dataclass
class Range:
    """One push/pop range of one thread, with the ranges pushed inside it."""

    message: str | None
    category: int
    category_name: str | None
    color: str | None
    payload_type: str | None
    payload: int | float | None
    pid: int
    tid: int
    level: int
    closed: bool = False
    children: list[Range] = dataclasses.field(default_factory=list)

    def walk(self):
        """This range and every range below it, depth first."""
        yield self
        for child in self.children:
            yield from child.walk()

    def outline(self, indent: int = 0) -> str:
        """A readable indented outline (for assertion messages)."""
        extra = f" [{self.category_name}]" if self.category_name else ""
        extra += f" payload={self.payload}" if self.payload is not None else ""
        extra += "" if self.closed else " (NOT POPPED)"
        lines = ["  " * indent + f"{self.message}{extra}"]
        lines += [child.outline(indent + 1) for child in self.children]
        return "\n".join(lines)


@dataclasses.dataclass
class RangeForest:
    """The push/pop ranges of one domain: per-thread root ranges, plus balance problems."""

    roots: list[Range]
    unmatched_pops: list[dict]   # pop events with no open push on their thread
    unclosed: list[Range]        # pushes never popped

    def outline(self) -> str:
        """All root ranges as one indented outline."""
        return "\n".join(root.outline() for root in self.roots)

    def all(self):
        """Every range, depth first."""
        for root in self.roots:
            yield from root.walk()


def push_pop_forest(events: list[dict], domain: str = "kvverify") -> RangeForest:
    """Rebuild the nesting of push/pop ranges of ``domain``, thread by thread."""
    stacks: dict[tuple[int, int], list[Range]] = {}
    roots: list[Range] = []
    unmatched: list[dict] = []
    for event in events:
        if event.get("domain") != domain or event["ev"] not in ("push", "pop"):
            continue
        key = (event["pid"], event["tid"])
        stack = stacks.setdefault(key, [])
        if event["ev"] == "push":
            node = Range(
                message=event.get("message"),
                category=event.get("category", 0),
                category_name=event.get("category_name"),
                color=event.get("color"),
                payload_type=event.get("payload_type"),
                payload=event.get("payload"),
                pid=event["pid"],
                tid=event["tid"],
                level=event.get("level", -1),
            )
            (stack[-1].children if stack else roots).append(node)
            stack.append(node)
        elif stack:
            stack.pop().closed = True
        else:
            unmatched.append(event)
    unclosed = [node for stack in stacks.values() for node in stack]
    return RangeForest(roots=roots, unmatched_pops=unmatched, unclosed=unclosed)


def start_end_pairs(events: list[dict], domain: str = "kvverify") -> tuple[dict[int, dict], list[int]]:
    """Start/end ranges of ``domain``: (start events by id that never ended, end ids never started)."""
    open_: dict[int, dict] = {}
    stray: list[int] = []
    for event in events:
        if event.get("domain") != domain:
            continue
        if event["ev"] == "start":
            open_[event["id"]] = event
        elif event["ev"] == "end":
            if open_.pop(event["id"], None) is None:
                stray.append(event["id"])
    return open_, stray


def assert_balanced(forest: RangeForest) -> None:
    """Every push has its pop and every pop its push."""
    assert not forest.unmatched_pops, f"pops without a push: {forest.unmatched_pops}\n{forest.outline()}"
    assert not forest.unclosed, (
        "pushes never popped: " + ", ".join(repr(r.message) for r in forest.unclosed) + "\n" + forest.outline()
    )


PHASES = ("write", "swap", "verify")


def range_kind(node: Range) -> str:
    """Classify a kvverify range by its message: phase, trial, or other (run / cell)."""
    if node.message in PHASES:
        return "phase"
    if node.message == "trial":
        return "trial"
    return "other"


def assert_run_cell_trial_phase(forest: RangeForest) -> None:
    """Every root is a run; runs hold only cells, cells only trials, trials only phases.

    Runs and cells are recognised by position (their labels are free text); trials by the
    message ``"trial"`` with an int64 payload, phases by their names.
    """
    outline = forest.outline()
    assert forest.roots, "no kvverify ranges were recorded"
    for run in forest.roots:
        assert range_kind(run) == "other", f"a {range_kind(run)} range outside any run:\n{outline}"
        for cell in run.children:
            assert range_kind(cell) == "other" and cell.category_name in ("store", "load"), (
                f"run {run.message!r} holds {cell.message!r}, not a cell with a direction category:\n{outline}")
            for trial in cell.children:
                assert range_kind(trial) == "trial", f"cell {cell.message!r} holds {trial.message!r}:\n{outline}"
                assert trial.payload_type == "int64" and isinstance(trial.payload, int), outline
                for phase in trial.children:
                    assert range_kind(phase) == "phase", f"trial holds {phase.message!r}:\n{outline}"
                    assert not phase.children, f"phase {phase.message!r} holds ranges:\n{outline}"
