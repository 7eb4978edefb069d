"""What ``kvverify check`` reports: a verdict and the races behind it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvverify.check.model import Range, printable
from kvverify.terms import RACY, SAFE

if TYPE_CHECKING:
    from kvverify.check.model import Trace


@dataclass(frozen=True)
class Race:
    """Two ops whose accesses to the same bytes no rule orders.

    ``first`` < ``second`` are op indices (equal for two copies of one copy_batch or for a copy
    whose source and destination overlap). ``kind`` is RAW / WAR / WAW by issue order (the
    earlier-issued access first; inside one op, by copy index, source before destination), or
    FREE when one of the two ops is a ``free`` (use after free, rule 9).
    ``overlap`` is one overlapping byte range of the pair (the lowest, in buffer name order;
    ranges one op lists back to back count as one);
    ``rule`` the number of the rule that leaves them unordered ("2", "4", "5", "6", "7", "8" for
    two host threads, "9" for a free);
    ``reason`` says why in words and ``fix`` gives one concrete change that orders them.
    ``first_at`` / ``second_at``: where the program issued the two ops (their ``at``), if the trace
    says."""

    first: int
    second: int
    kind: str
    overlap: Range
    rule: str
    reason: str
    fix: str
    first_at: str | None = None
    second_at: str | None = None

    def to_json(self) -> dict:
        """The race as ``kvverify check --json`` lists it; ``first_at`` / ``second_at`` only where known."""
        out = {
            "first": self.first,
            "second": self.second,
            "kind": self.kind,
            "overlap": self.overlap.to_json(),
            "rule": self.rule,
            "reason": self.reason,
            "fix": self.fix,
        }
        if self.first_at is not None:
            out["first_at"] = self.first_at
        if self.second_at is not None:
            out["second_at"] = self.second_at
        return out


@dataclass(frozen=True)
class Verdict:
    """The checker's answer. ``races`` is sorted by (first, second); each op pair appears once.
    ``truncated`` is True when the checker stopped after ``max_races`` races (the verdict is
    RACY either way)."""

    races: tuple[Race, ...] = ()
    truncated: bool = False
    trace: Trace | None = field(default=None, repr=False, compare=False)  # the trace it decides

    @property
    def verdict(self) -> str:
        return RACY if self.races else SAFE

    @property
    def safe(self) -> bool:
        return not self.races

    def pairs(self) -> set[tuple[int, int]]:
        return {(r.first, r.second) for r in self.races}

    def to_json(self) -> dict:
        """The object ``kvverify check --json`` prints."""
        out: dict = {"verdict": self.verdict, "races": [r.to_json() for r in self.races]}
        if self.truncated:
            out["truncated"] = True
        return out

    def render(self, trace: Trace | None = None, source: str | None = None) -> str:
        """A human report: the verdict, then each race with both ops (and where the program issued
        them), bytes, kind, why and fix. ``trace`` defaults to the trace the verdict decided.
        Names from the trace are escaped where a terminal would act on them (:func:`printable`):
        a buffer named ``"\\r\\x1b[32mSAFE"`` cannot repaint the verdict."""
        trace = trace if trace is not None else self.trace
        where = f" in {source}" if source else ""
        if trace is not None:
            where += f" ({len(trace.ops)} ops, {len(trace.streams)} streams)"
        n = len(self.races)
        if not n:
            return printable(f"SAFE{where}: no two accesses to the same bytes can run in either order.") + "\n"
        more = " (stopped there: --max-races)" if self.truncated else ""
        lines = [f"RACY{where}: {n} race{'s' if n != 1 else ''}{more}", ""]

        def op(i: int) -> str:
            return trace.describe(i) if trace is not None else f"op {i}"

        for k, r in enumerate(self.races, 1):
            lines.append(f"race {k}: {r.kind} on {r.overlap} ({r.overlap.length} bytes), rule {r.rule}")
            if r.first == r.second:
                lines.append(f"  op:     {op(r.first)}")
            else:
                lines.append(f"  first:  {op(r.first)}")
                lines.append(f"  second: {op(r.second)}")
            lines.append(f"  why:    {r.reason}")
            lines.append(f"  fix:    {r.fix}")
            lines.append("")
        return "\n".join(map(printable, lines))
