"""One mapping from a scenario's program to a trace (``docs/trace-format.md``), and the
contract verdict the checker gives it.

Byte ranges come from the layout the executors use: the GPU pool is ``num_tensors``
tensors of ``gpu_slots`` pages each (tensor ``t``'s page of block ``b`` at
``(t * slots + b) * page_bytes``), the host pool likewise. The contract verdict does not
depend on how many tensors a block spans (every step touches all of them alike), so the
checker is handed a trace with at most ``CONTRACT_TENSORS`` tensors: it keeps the
multi-tensor shape and the checker's work small.

The harness's own final checks (``Expect``) come after a device-wide drain and are not
part of the user's program, so they are left out; ``Read`` and ``HostConsume`` are in it.
"""

from __future__ import annotations

from typing import Any

from kvverify.check.model import op_to_json
from kvverify.scenarios.program import (
    GPU,
    Blocks,
    Expect,
    HostConsume,
    HostFill,
    Poll,
    Program,
    Read,
    Record,
    Swap,
    SyncEvent,
    SyncStream,
    WaitEvent,
    WaitStream,
    Write,
)
from kvverify.terms import DEVICE_SPACE, HOST_SPACE

CONTRACT_TENSORS = 2
BUFFER = {GPU: "gpu_kv", "host": "cpu_kv"}


def _ranges(blocks: Blocks, slots: int, page_bytes: int, tensors: int) -> list[list[Any]]:
    # One range per tensor and run of consecutive slots: small traces, same bytes.
    runs: list[tuple[int, int]] = []
    for s in blocks.slots:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    buf = BUFFER[blocks.pool]
    return [[buf, (t * slots + start) * page_bytes, n * page_bytes] for t in range(tensors) for start, n in runs]


def to_trace(program: Program, order: str, host_memory: str, page_bytes: int, tensors: int) -> dict[str, Any]:
    """The trace (a JSON-ready dict, format version 1) of ``program`` with every swap in
    ``order`` and the host pool of kind ``host_memory`` (pinned, registered, pageable)."""
    if host_memory not in HOST_SPACE:
        raise ValueError(f"host memory kind must be one of {', '.join(HOST_SPACE)}, got {host_memory!r}")
    slots = {GPU: program.gpu_slots, "host": program.host_slots}

    def ranges(b: Blocks) -> list[list[Any]]:
        return _ranges(b, slots[b.pool], page_bytes, tensors)

    ops: list[dict[str, Any]] = []
    for step in program.steps:
        if isinstance(step, Write):
            ops.append({"op": "kernel", "stream": step.stream, "name": "write_kv", "reads": [], "writes": ranges(step.blocks)})
        elif isinstance(step, Read):
            ops.append({"op": "kernel", "stream": step.stream, "name": "read_kv", "reads": ranges(step.blocks), "writes": []})
        elif isinstance(step, Swap):
            copies = []
            for c in step.copies:
                for (sp, s), (dp, d) in c.pairs():
                    for t in range(tensors):
                        copies.append({"src": [BUFFER[sp], (t * slots[sp] + s) * page_bytes, page_bytes],
                                       "dst": [BUFFER[dp], (t * slots[dp] + d) * page_bytes, page_bytes]})
            ops.append({"op": "copy_batch", "stream": step.stream, "order": order, "copies": copies, "name": step.name})
        elif isinstance(step, (Record, WaitEvent, WaitStream, SyncEvent, SyncStream)):
            ops.append(op_to_json(step))
        elif isinstance(step, Poll):
            # The engine queries until each event reports done: the last query it makes
            # returned true, which orders the captured work like a sync.
            ops += [{"op": "query_event", "event": e, "result": True} for e in step.events]
        elif isinstance(step, HostFill):
            ops.append({"op": "host_write", "ranges": ranges(step.blocks)})
        elif isinstance(step, HostConsume):
            ops.append({"op": "host_read", "ranges": ranges(step.blocks)})
        elif isinstance(step, Expect):
            continue
        else:  # pragma: no cover - a new step type must be mapped here
            raise TypeError(f"no trace mapping for step {step!r}")
    # Setup: every block written (GPU by a kernel, host by the host), then a device sync.
    setup: list[dict[str, Any]] = []
    if program.gpu_slots:
        setup.append({"op": "kernel", "stream": program.streams[0], "name": "setup_gpu", "reads": [],
                      "writes": [[BUFFER[GPU], 0, tensors * program.gpu_slots * page_bytes]]})
    if program.host_slots:
        setup.append({"op": "host_write", "ranges": [[BUFFER["host"], 0, tensors * program.host_slots * page_bytes]]})
    setup.append({"op": "sync_device"})
    doc = {
        "version": 1,
        "buffers": {
            BUFFER[GPU]: {"space": DEVICE_SPACE, "bytes": max(1, tensors * program.gpu_slots * page_bytes)},
            BUFFER["host"]: {"space": HOST_SPACE[host_memory], "bytes": max(1, tensors * program.host_slots * page_bytes)},
        },
        "streams": list(program.streams),
        "ops": setup + ops,
    }
    return doc


def contract(doc: dict[str, Any]):
    """The checker's ``Verdict`` on a trace dict (``.verdict`` is "SAFE" or "RACY", ``.races`` the
    witnesses). Raises ``TraceError`` for a trace the mapping got wrong (a bug here)."""
    from kvverify import check

    return check(doc)
