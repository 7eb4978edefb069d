"""The allocations a recording knows, and which one a byte address lies in.

A trace names memory by buffer; a live program names it by address: a tensor's ``data_ptr``, or a
raw pointer packed into an int64 tensor for a batched swap. ``MemoryMap`` keeps the live
allocations the recorder has learnt of (torch's caching allocator blocks, pinned and registered
host memory, the CPU storages the program touched, memory the user declared) as disjoint address
intervals, and resolves a byte range to ``(allocation index, offset, length)``.

Two ways in, after the two ways memory comes to be known:

- ``fresh``: memory that was just allocated (an op's output, ``cudaHostAlloc``,
  ``cudaHostRegister``). Whatever the map held at those addresses is gone: its allocations are
  retired, and the new one gets a new index, so bytes reused by the allocator are never confused
  with the tensor that held them before (the caching allocator orders such reuse itself).
- ``known``: memory that existed before the recorder saw it (a tensor made before the recording,
  a block from the allocator's snapshot). It never displaces what the map holds.

A range that lies in no live allocation is *unresolved*: it is never dropped. ``unresolved_span``
records the address, the length and why, and gives the range a placeholder allocation in
``host_pageable`` memory, which is how the CUDA driver treats an address it does not know
(``docs/op.md``); overlapping or touching placeholders merge, so every access to the same unknown
bytes names one buffer. Memory learnt later with ``known`` absorbs the placeholders inside it: the
ops that used them then name the real allocation (``final``).
"""

from __future__ import annotations

import array
import bisect
from dataclasses import dataclass
from typing import NamedTuple

from kvverify.terms import SPACES

UNRESOLVED_ORIGIN = "unresolved"
_BELOW_ALL = -(1 << 63)  # the least int64: below every address


@dataclass(eq=False)
class Allocation:
    """``size`` bytes at byte address ``base`` in memory space ``space`` (``kvverify.terms.SPACES``).

    ``index`` is its position in ``MemoryMap.allocations`` (ops refer to it by index); ``origin``
    says how the recorder learnt of it (e.g. ``"tensor output"``, ``"cudaHostRegister"``); ``at``
    is where the program made it (``file.py:12 in f``) when the recorder saw that; ``label`` a name
    the user gave it (``kvverify.record.host_buffer``).
    """

    index: int
    base: int
    size: int
    space: str
    origin: str
    at: str | None = None
    label: str | None = None
    absorbed_into: Allocation | None = None  # a placeholder merged into a larger allocation

    @property
    def end(self) -> int:
        return self.base + self.size

    @property
    def placeholder(self) -> bool:
        return self.origin == UNRESOLVED_ORIGIN

    def final(self) -> tuple[Allocation, int]:
        """The allocation this one ended up in, and where this one starts in it (bytes)."""
        a, delta = self, 0
        while a.absorbed_into is not None:
            delta += a.base - a.absorbed_into.base
            a = a.absorbed_into
        return a, delta


class Unresolved(NamedTuple):
    """A byte range no known allocation held when it was used, and why (shown in the recording's
    summary unless memory learnt later absorbed its placeholder)."""

    address: int
    length: int
    reason: str
    at: str | None
    placeholder: Allocation


Span = tuple  # (allocation index, offset, length)


class MemoryMap:
    """Disjoint live allocations, by address. Not thread-safe (one recording thread)."""

    def __init__(self) -> None:
        self.allocations: list[Allocation] = []
        self.unresolved: list[Unresolved] = []
        self.overruns = 0  # unresolved ranges that run past a live allocation (their own placeholder)
        self.version = 0  # changes whenever the live set does
        # The live allocations sorted by base, in parallel sequences: a lookup is one bisect (on a
        # list: an array would make an int of every element it compares) and one index. Where each
        # stops resolving ranges (its end; a placeholder's base: nothing resolves in it) and its
        # index are C arrays, as is a copy of the bases: resolve_batch copies them into numpy
        # arrays without converting each element. The C arrays start with an entry below every
        # address where nothing resolves, so that every batched lookup lands on an entry: the
        # allocation at position i of the lists is at i + 1 in them.
        self._bases: list[int] = []
        self._live: list[Allocation] = []
        self._at_base: dict[int, Allocation] = {}  # the allocator's callbacks retire by base, at every malloc and free
        self._base_column = array.array("q", [_BELOW_ALL])
        self._ends = array.array("q", [_BELOW_ALL])
        self._indices = array.array("q", [-1])
        self._arrays: tuple | None = None  # (version, bases, ends, indices) for resolve_batch

    # -- learning ------------------------------------------------------------------------------

    def _new(self, base: int, size: int, space: str, origin: str, at: str | None, label: str | None) -> Allocation:
        if space not in SPACES:
            raise ValueError(f"unknown memory space {space!r}; use one of {', '.join(SPACES)}")
        if size <= 0:
            raise ValueError(f"an allocation has at least one byte, got {size} at {base:#x} ({origin})")
        a = Allocation(len(self.allocations), int(base), int(size), space, origin, at, label)
        self.allocations.append(a)
        i = bisect.bisect_left(self._bases, a.base)
        self._bases.insert(i, a.base)
        self._live.insert(i, a)
        self._at_base[a.base] = a
        self._base_column.insert(i + 1, a.base)
        self._ends.insert(i + 1, a.base if a.placeholder else a.end)
        self._indices.insert(i + 1, a.index)
        self.version += 1
        return a

    def overlapping(self, base: int, end: int) -> list[Allocation]:
        """The live allocations that hold a byte of ``[base, end)``, by address."""
        i = bisect.bisect_right(self._bases, base) - 1
        out = []
        if i >= 0 and self._live[i].end > base:
            out.append(self._live[i])
        i += 1
        while i < len(self._bases) and self._bases[i] < end:
            out.append(self._live[i])
            i += 1
        return out

    def fresh(self, base: int, size: int, space: str, origin: str, at: str | None = None,
              label: str | None = None) -> Allocation:
        """Memory allocated just now: retire every live allocation it overlaps, return the new one.

        Raises ValueError for an unknown space or ``size <= 0``."""
        for old in self.overlapping(base, base + size):
            self._drop(old)
        return self._new(base, size, space, origin, at, label)

    def known(self, base: int, size: int, space: str, origin: str, at: str | None = None,
              label: str | None = None) -> Allocation:
        """Memory that existed before the recorder saw it. Returns the live allocation holding
        ``base`` if there is one that is not a placeholder (grown to ``size`` where that overlaps
        nothing else); otherwise a new allocation, cut short where another live allocation begins,
        that absorbs the placeholders it overlaps (grown to cover them: they hold no other known
        memory). Raises ValueError as ``fresh``."""
        holder = self.find(base)
        if holder is not None and not holder.placeholder:
            if holder.base == base and size > holder.size:
                nxt = bisect.bisect_right(self._bases, base)
                limit = self._bases[nxt] if nxt < len(self._bases) else base + size
                if limit > holder.end:
                    holder.size = min(size, limit - base)
                    self._ends[nxt] = holder.end  # its position nxt - 1, plus the first entry
                    self.version += 1
            return holder
        hi = base + size
        overlapping = self.overlapping(base, hi)
        for a in overlapping:
            if not a.placeholder:  # a live allocation past base: this one ends where that one begins
                hi = min(hi, a.base)
        absorbed = [a for a in overlapping if a.placeholder and a.base < hi]
        lo, hi = min([base] + [a.base for a in absorbed]), max([hi] + [a.end for a in absorbed])
        for a in absorbed:
            self._drop(a)
        new = self._new(lo, hi - lo, space, origin, at, label)
        for a in absorbed:
            a.absorbed_into = new
        return new

    def retire(self, base: int) -> Allocation | None:
        """The allocation at ``base`` was freed: forget it (later addresses in it are unresolved
        until memory is allocated there again). Returns it, or None if none starts there."""
        a = self._at_base.get(base)
        if a is not None:
            self._drop(a)
        return a

    def forget_all(self) -> None:
        """Forget every live allocation (a stretch of the program went unseen: any of them may
        have been freed and its bytes handed out again); addresses are learnt again as they are
        met. The allocations stay in ``allocations``, where ops logged before refer to them."""
        for a in list(self._live):
            self._drop(a)

    def _drop(self, a: Allocation) -> None:
        i = bisect.bisect_left(self._bases, a.base)
        del self._bases[i], self._live[i], self._base_column[i + 1], self._ends[i + 1], self._indices[i + 1]
        del self._at_base[a.base]
        self.version += 1

    # -- looking up ------------------------------------------------------------------------

    def find(self, address: int) -> Allocation | None:
        """The live allocation holding byte ``address``, or None."""
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0:
            return None
        a = self._live[i]
        return a if address < a.base + a.size else None

    def resolve(self, address: int, length: int) -> Span | None:
        """``(index, offset, length)`` when ``length`` bytes from ``address`` lie in one live
        allocation, else None."""
        i = bisect.bisect_right(self._bases, address) - 1  # find(), inlined
        if i < 0:
            return None
        a = self._live[i]
        if address + length > a.base + a.size:
            return None
        return (a.index, address - a.base, length)

    def resolve_known(self, address: int, length: int) -> Span | None:
        """As ``resolve``, but None where the range lies in a placeholder (``length`` >= 1): the
        lookup of every tensor of every op, which learns memory only where this fails."""
        i = bisect.bisect_right(self._bases, address)  # the position in the C arrays
        if address + length > self._ends[i]:
            return None
        return (self._indices[i], address - self._bases[i - 1], length)

    def why_not(self, address: int, length: int) -> str:
        """Why ``resolve(address, length)`` found nothing, in words."""
        a = self.find(address)
        if a is not None and not a.placeholder:
            return f"runs {address + length - a.end} bytes past the end of {self.describe(a)}"
        return "lies in no allocation the recording knows"

    def describe(self, a: Allocation) -> str:
        """``device allocation of 4096 bytes at 0x7f00 (made at f.py:3 in g)``: for messages."""
        where = f" (made at {a.at})" if a.at else f" ({a.origin})"
        return f"{a.space} allocation of {a.size} bytes at {a.base:#x}{where}"

    def unresolved_span(self, address: int, length: int, reason: str, at: str | None) -> Span:
        """Remember an unresolved range (never dropped) and return its span in a placeholder
        allocation (``host_pageable``). A range that runs past a live allocation gets a placeholder
        of its own, outside the map (it is a bug of the program, reported as such)."""
        end = address + length
        around = self.overlapping(address - 1, end + 1)
        if any(not a.placeholder and a.base < end and address < a.end for a in around):
            a = Allocation(len(self.allocations), int(address), int(length), "host_pageable", UNRESOLVED_ORIGIN, at)
            self.allocations.append(a)
            self.overruns += 1
        else:
            merged = [a for a in around if a.placeholder]
            lo = min([address] + [a.base for a in merged])
            hi = max([end] + [a.end for a in merged])
            for old in merged:
                self._drop(old)
            a = self._new(lo, hi - lo, "host_pageable", UNRESOLVED_ORIGIN, at, None)
            for old in merged:
                old.absorbed_into = a
        self.unresolved.append(Unresolved(int(address), int(length), reason, at, a))
        return (a.index, int(address) - a.base, int(length))

    def still_unresolved(self) -> list[Unresolved]:
        """The unresolved ranges that no memory learnt later took in."""
        return [u for u in self.unresolved if u.placeholder.final()[0].placeholder]

    def resolve_batch(self, addresses, lengths):
        """Resolve many ranges at once (a batched swap's pointers).

        ``addresses``, ``lengths``: 1-D int64 numpy arrays of equal shape ``(n,)``, bytes.
        Returns ``(indices, offsets, found)``: int64 ``(n,)`` allocation indices and offsets
        (meaningless where not found) and a bool ``(n,)`` mask of the ranges that lie wholly in one
        live allocation that is not a placeholder.
        """
        import numpy as np

        if self._arrays is None or self._arrays[0] != self.version:
            self._arrays = (self.version, np.array(self._base_column, dtype=np.int64),
                            np.array(self._ends, dtype=np.int64), np.array(self._indices, dtype=np.int64))
        _, bases, ends, indices = self._arrays
        slot = bases.searchsorted(addresses, side="right")
        slot -= 1
        return indices.take(slot), addresses - bases.take(slot), addresses + lengths <= ends.take(slot)
