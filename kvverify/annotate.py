"""NVTX ranges for kvverify runs, so that an Nsight Systems timeline reads at a glance.

Everything lives in one NVTX domain, ``kvverify``, nested on the host thread that drives
the run::

    run    "kvverify stress smoke"                      (grey)
      cell "H1 store/D2H/ANY/pinned/adversarial"        (pink; category "store" or "load")
        trial "trial", payload = trial index (int64)    (sky blue)
          phase "write" | "swap" | "verify"             (fixed colour per phase)

Trial and phase ranges carry the category of the cell they run in, so a tool can filter a
whole direction. The ranges are pushed and popped on the calling thread (NVTX push/pop),
and every pop happens, also when the body raises.

**Ranges mark the host side.** A range that covers asynchronous GPU work (a kernel launch,
``cuMemcpyBatchAsync``) spans the host thread *issuing* that work, not the work itself:
the copy may still run on a copy engine after the ``swap`` range has closed. Nsight Systems
draws the GPU work on its own CUDA rows and links each launch to its NVTX range through the
CUDA API row (see ``docs/profiling.md``); ``HOST_SIDE_NOTE`` is the sentence reports print.

Cost: with no tool attached the ``nvtx`` package hands out a no-op domain and every range
here is a shared no-op context manager (``benchmarks/bench_nvtx_overhead.py`` measures it).
``configure(False)`` (the CLI's ``--no-nvtx``) makes that explicit. Where the ``nvtx``
package cannot be imported, the run goes on unannotated and says so once on stderr.

The module never imports ``nvtx`` at import time; the first range (or ``configure``) does.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

DOMAIN = "kvverify"

#: The phases of one trial, in order; ``phase_range`` accepts these names only.
PHASES: tuple[str, ...] = ("write", "swap", "verify")

#: Fixed ARGB colours (Okabe-Ito palette, readable by colour-blind users).
PHASE_COLORS: dict[str, int] = {
    "write": 0xFFE69F00,  # orange: compute-stream writers
    "swap": 0xFF0072B2,  # blue: the batched copy under test
    "verify": 0xFF009E73,  # green: verify kernels and host checks
}
RUN_COLOR = 0xFF999999  # grey
CELL_COLOR = 0xFFCC79A7  # reddish purple
TRIAL_COLOR = 0xFF56B4E9  # sky blue

#: NVTX category names, one per copy direction, registered in this order (ids 1 and 2).
CATEGORIES: tuple[str, ...] = ("store", "load")

# Accepted spellings of a direction -> category name.
_DIRECTION_ALIASES: dict[str, str] = {
    "store": "store",
    "d2h": "store",
    "load": "load",
    "h2d": "load",
}

TRIAL_MESSAGE = "trial"

HOST_SIDE_NOTE = (
    "NVTX ranges (domain kvverify) mark the host thread that issues the GPU work; "
    "asynchronous kernels and copies run on the CUDA rows of the timeline and may end "
    "after their range has closed."
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _NullRange:
    """A reusable context manager that does nothing (annotation off or no tool attached)."""

    __slots__ = ()

    def __enter__(self) -> _NullRange:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False


_NULL = _NullRange()


def _category_of(direction: str) -> str:
    try:
        return _DIRECTION_ALIASES[direction.lower()]
    except (KeyError, AttributeError):
        raise ValueError(
            f"unknown direction {direction!r}: expected one of 'store' (D2H) or 'load' (H2D)"
        ) from None


def _check_phase(name: str) -> None:
    if name not in PHASE_COLORS:
        raise ValueError(f"unknown phase {name!r}: expected one of {', '.join(PHASES)}")


def _check_trial_index(index: Any) -> int:
    if isinstance(index, bool) or not hasattr(index, "__index__"):
        raise TypeError(f"trial index must be an integer, not {type(index).__name__}")
    value = index.__index__()
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"trial index {value} does not fit the int64 payload")
    return value


class _Off:
    """Annotation off: arguments are still checked, every range is the shared no-op."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.active = False

    def run(self, label: str) -> _NullRange:
        return _NULL

    def cell(self, label: str, direction: str) -> _NullRange:
        _category_of(direction)
        return _NULL

    def trial(self, index: int) -> _NullRange:
        _check_trial_index(index)
        return _NULL

    def phase(self, name: str) -> _NullRange:
        _check_phase(name)
        return _NULL


class _Pushed:
    """Pushes one range of the ``kvverify`` domain on enter and pops it on exit, always."""

    __slots__ = ("_attributes", "_push", "_pop", "_handle")

    def __init__(self, attributes, push, pop, handle):
        self._attributes = attributes
        self._push = push
        self._pop = pop
        self._handle = handle

    def __enter__(self) -> _Pushed:
        self._push(self._attributes, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._pop(self._handle)
        return False


class _CellScope(_Pushed):
    """A cell range that also sets the category its trial and phase ranges inherit."""

    __slots__ = ("_local", "_category", "_saved")

    def __init__(self, attributes, push, pop, handle, local, category):
        super().__init__(attributes, push, pop, handle)
        self._local = local
        self._category = category
        self._saved = None

    def __enter__(self) -> _CellScope:
        self._saved = getattr(self._local, "category", None)
        self._push(self._attributes, self._handle)
        self._local.category = self._category
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._pop(self._handle)
        finally:
            self._local.category = self._saved
        return False


class _On:
    """Annotation on, a tool attached: real NVTX push/pop with pre-registered strings."""

    def __init__(self, nvtx_module) -> None:
        self.reason = "on"
        self.active = True
        self._domain = nvtx_module.get_domain(DOMAIN)
        self._handle = self._domain.handle
        try:
            # The module-level functions the nvtx package's own `annotate` uses: one C call
            # each, no keyword handling. Private, so fall back to the public Domain methods.
            from nvtx._lib.lib import pop_range, push_range

            self._push, self._pop = push_range, pop_range
        except ImportError:
            domain = self._domain
            self._push = lambda attributes, _handle: domain.push_range(attributes)
            self._pop = lambda _handle: domain.pop_range()
        self._local = threading.local()
        # Fixed category ids: "store" -> 1, "load" -> 2, registered before any range.
        self._category_ids = {name: self._domain.get_category_id(name) for name in CATEGORIES}
        get = self._domain.get_event_attributes
        # category (None, "store", "load") -> phase -> pre-built range (attributes immutable)
        self._phases: dict[str | None, dict[str, _Pushed]] = {}
        for category in (None, *CATEGORIES):
            cat_id = self._category_ids.get(category) if category else None
            self._phases[category] = {
                phase: _Pushed(
                    get(message=phase, color=PHASE_COLORS[phase], category=cat_id),
                    self._push,
                    self._pop,
                    self._handle,
                )
                for phase in PHASES
            }
        self._domain.get_registered_string(TRIAL_MESSAGE)  # registered once, cached by nvtx

    def run(self, label: str) -> _Pushed:
        attributes = self._domain.get_event_attributes(message=str(label), color=RUN_COLOR)
        return _Pushed(attributes, self._push, self._pop, self._handle)

    def cell(self, label: str, direction: str) -> _CellScope:
        category = _category_of(direction)
        attributes = self._domain.get_event_attributes(
            message=str(label), color=CELL_COLOR, category=self._category_ids[category]
        )
        return _CellScope(attributes, self._push, self._pop, self._handle, self._local, category)

    def trial(self, index: int) -> _Pushed:
        value = _check_trial_index(index)
        category = getattr(self._local, "category", None)
        # A fresh attributes object per trial: the payload differs, and threads may interleave.
        attributes = self._domain.get_event_attributes(
            message=TRIAL_MESSAGE,
            color=TRIAL_COLOR,
            category=self._category_ids[category] if category else None,
            payload=value,
        )
        return _Pushed(attributes, self._push, self._pop, self._handle)

    def phase(self, name: str) -> _Pushed:
        ranges = self._phases[getattr(self._local, "category", None)]
        try:
            return ranges[name]
        except KeyError:
            _check_phase(name)
            raise


_lock = threading.Lock()
_annotator: _Off | _On | None = None
_warned_missing = False


def _warn_missing_once(exc: BaseException) -> None:
    global _warned_missing
    if _warned_missing:
        return
    _warned_missing = True
    from kvverify import screen

    text = ("kvverify: NVTX annotation is off: the nvtx package cannot be imported "
            f"({type(exc).__name__}: {exc}); the run goes on without NVTX ranges "
            "(install it with `pip install nvtx`).")
    print(screen.fit(text, sys.stderr), file=sys.stderr, flush=True)


def configure(enabled: bool) -> None:
    """Turn NVTX annotation on (``True``, the default) or off (``False``, ``--no-nvtx``).

    With ``enabled`` true the ``nvtx`` package is imported and the ``kvverify`` domain is
    created; the ranges reach a tool only when one is attached (Nsight Systems, or any
    library named by ``NVTX_INJECTION64_PATH``), and are shared no-ops otherwise. Where
    ``nvtx`` cannot be imported, one line on stderr says so (once per process) and every
    range becomes a no-op; the run goes on. Calling ``configure`` again re-decides.
    """
    global _annotator
    with _lock:
        if not enabled:
            _annotator = _Off("off (--no-nvtx)")
            return
        try:
            import nvtx
        except Exception as exc:  # ImportError, or a broken binary module (OSError, ...)
            _warn_missing_once(exc)
            _annotator = _Off(f"off (nvtx package unavailable: {exc})")
            return
        domain = nvtx.get_domain(DOMAIN)
        if not isinstance(domain, nvtx.Domain):
            # The nvtx package returns its no-op DummyDomain when no tool is attached.
            _annotator = _Off("on (no NVTX tool attached: ranges are no-ops)")
            return
        _annotator = _On(nvtx)


def _current() -> _Off | _On:
    annotator = _annotator
    if annotator is None:
        configure(True)
        annotator = _annotator
    return annotator


def state() -> str:
    """One line saying whether ranges are recorded, for logs and reports.

    ``"on"`` (a tool is attached), ``"on (no NVTX tool attached: ranges are no-ops)"``,
    ``"off (--no-nvtx)"`` or ``"off (nvtx package unavailable: ...)"``.
    """
    return _current().reason


def is_active() -> bool:
    """True when ranges reach an attached NVTX tool (annotation on and a tool present)."""
    return _current().active


def run_range(label: str):
    """Context manager: one range for a whole run (e.g. ``"kvverify stress smoke"``)."""
    return _current().run(label)


def cell_range(label: str, direction: str):
    """Context manager: one range per cell, in the NVTX category of its copy direction.

    ``label`` names the cell, e.g. ``"H1 store/D2H/ANY/pinned/adversarial"``;
    ``direction`` is ``"store"`` (or ``"D2H"``) or ``"load"`` (or ``"H2D"``); anything
    else raises ``ValueError``. Trial and phase ranges opened inside on the same thread
    carry the same category.
    """
    return _current().cell(label, direction)


def trial_range(index: int):
    """Context manager: one range per trial, message ``"trial"``, payload the index (int64).

    Raises ``TypeError`` for a non-integer index and ``ValueError`` outside int64.
    """
    return _current().trial(index)


def phase_range(name: str):
    """Context manager: one range per phase of a trial: ``"write"``, ``"swap"`` or ``"verify"``.

    Each phase has a fixed colour (``PHASE_COLORS``); any other name raises ``ValueError``.
    The range marks the host thread issuing the phase's GPU work, not the GPU work itself.
    """
    return _current().phase(name)


def add_cli_option(parser) -> None:
    """Add ``--no-nvtx`` to an argparse (sub)parser; ``kvverify.cli`` applies it."""
    parser.add_argument(
        "--no-nvtx",
        action="store_true",
        help="do not emit NVTX ranges (domain kvverify) for Nsight Systems",
    )


def configure_from_args(args) -> None:
    """Apply ``--no-nvtx`` from parsed arguments; does nothing if the option is absent."""
    if hasattr(args, "no_nvtx"):
        configure(not args.no_nvtx)


def _reset_for_tests() -> None:
    """Forget the configuration and the missing-package warning (tests only)."""
    global _annotator, _warned_missing
    with _lock:
        _annotator = None
        _warned_missing = False
