"""The field's terms, each defined once: source access orders, directions, host memory kinds, trace
memory spaces, block states, executors, contract and cell verdicts.

Standard library only: ``kvverify check`` and every report import it.
"""

from __future__ import annotations

import enum


class SrcAccessOrder(enum.IntEnum):
    """``CUmemcpySrcAccessOrder``, with CUDA's values (CUDA Driver API, ``cuMemcpyBatchAsync``,
    CUDA 12.8+). The destination is always written in stream order.

    - ``STREAM``: the source is read in stream order, after all work issued earlier to the stream.
    - ``DURING_API_CALL``: the source may be read out of stream order, during the call; all reads
      are complete when the call returns.
    - ``ANY``: the source may be read out of stream order, at any time from the call until the
      copy completes in stream order.
    """

    STREAM = 1
    DURING_API_CALL = 2
    ANY = 3


ORDERS: tuple[str, ...] = tuple(o.name for o in SrcAccessOrder)
"""The orders by name, as traces, campaigns, reports and the command line spell them."""

# A store copies a GPU block to the host (D2H), a load copies it back (H2D).
STORE, LOAD = "store", "load"
DIRECTIONS: tuple[str, ...] = (STORE, LOAD)
COPY_KIND: dict[str, str] = {STORE: "D2H", LOAD: "H2D"}
COPY_KINDS: tuple[str, ...] = tuple(COPY_KIND[d].lower() for d in (LOAD, STORE))
"""``("h2d", "d2h")``: the copy kinds as ``kvverify probe`` and ``bench`` spell them."""

HOST_MEMORY_KINDS: tuple[str, ...] = ("pinned", "registered", "pageable")
"""Host memory as the harness allocates it: ``cudaHostAlloc``, ``cudaHostRegister``, plain pages."""
HOST_SPACE: dict[str, str] = {"pinned": "host_pinned", "registered": "host_registered", "pageable": "host_pageable"}
"""Host memory kind → the trace format's memory space."""
DEVICE_SPACE = "device"
SPACES: tuple[str, ...] = (DEVICE_SPACE, *HOST_SPACE.values())
"""The trace format's memory spaces (``docs/trace-format.md``)."""


class BlockState(enum.IntEnum):
    """What a checked block holds (``docs/architecture.md``, "kvverify.device.pattern"); the values are what the
    verify kernel writes."""

    OK = 0  # every word from the expected generation
    STALE = 1  # every word from one other generation
    TORN = 2  # words from several generations
    GARBAGE = 3  # a word whose hash does not match: poison, uninitialised, or the wrong block


BLOCK_STATES: tuple[str, ...] = tuple(s.name for s in BlockState)

NATIVE, ADVERSARIAL, KERNEL = "native", "adversarial", "kernel"
EXECUTORS: tuple[str, ...] = (NATIVE, ADVERSARIAL, KERNEL)
"""``native``: the driver as it is; ``adversarial``: each source read at an extreme its order allows;
``kernel``: the SM-kernel copy path, stream-ordered on both sides (``STREAM``'s contract)."""

SAFE, RACY = "SAFE", "RACY"
CONTRACTS: tuple[str, ...] = (SAFE, RACY)
"""The happens-before checker's verdict on a trace."""
INVALID = "INVALID"
"""What ``kvverify check --json`` says of an input that is not a valid trace (no verdict)."""
NOT_STARTED = "NOT_STARTED"
"""What ``kvverify record --json`` says of a program that did not start: its script or module was
not found or could not be loaded (no trace, no verdict)."""
NOT_RECORDED = "NOT_RECORDED"
"""What ``kvverify record --json`` says of a program that ended where its recording could not be
stopped (``os._exit`` on another thread than the recording's): no trace, no verdict."""


class CellVerdict(str, enum.Enum):
    """A cell's contract verdict joined with what was observed (``docs/report-schema.md``, "Cell
    verdicts"); ``kvverify.stress.report.cell_verdict`` is the rule."""

    CONFIRMED_RACE = "CONFIRMED_RACE"  # contract RACY, corruption observed
    NO_RACE_OBSERVED = "NO_RACE_OBSERVED"  # contract RACY, native run saw none
    SAFE_CONFIRMED = "SAFE_CONFIRMED"  # contract SAFE, no corruption
    UNEXPECTED_CORRUPTION = "UNEXPECTED_CORRUPTION"  # contract SAFE, corruption: a bug
    SENSITIVITY_FAILURE = "SENSITIVITY_FAILURE"  # contract RACY, the adversarial executor saw none: a harness bug
    NOT_RUN = "NOT_RUN"  # no observation (no GPU, or the cell was skipped)

    @property
    def failing(self) -> bool:
        """True for the two verdicts that fail the run (exit status 1)."""
        return self in (CellVerdict.UNEXPECTED_CORRUPTION, CellVerdict.SENSITIVITY_FAILURE)
