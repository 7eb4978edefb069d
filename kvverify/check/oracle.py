"""The checker's oracle: enumerate every execution the rules allow, simulate the bytes, compare.

Deliberately simple and independent of :mod:`kvverify.check.rules` (no vector clocks): the ordering
rules of ``docs/trace-format.md`` are written again, as an explicit graph of moments:

- each host thread: ``call i`` → ``ret i`` → ``call j`` … over its own ops, ``j`` its next op
  (rule 1; ops without a thread are the first thread's);
- each stream: a chain of items (kernels, copies, records, waits), each from ``begin`` to ``end``;
  an item begins after its ``call`` (rule 1) and after the previous item's ``end`` (rule 2);
- a record is an item of its stream; a wait is an item that also follows the event's latest
  record (rules 2, 3); ``wait_stream`` is a record on ``on`` and a wait on ``stream``;
- a host synchronization makes ``ret`` follow what it observed (rule 4);
- an ``acquire``'s ``ret`` follows the ``ret`` of every earlier ``release`` of its name (rule 8);
  reachability makes it transitive, through every thread's program order and every stream;
- an access is a node placed inside its window: kernel and STREAM reads / destination writes
  between ``begin`` and ``end``; DURING_API_CALL and pageable source reads between ``call`` and
  ``ret`` (and before ``end``); ANY source reads between ``call`` and ``end`` (rules 5, 6); a copy
  to pageable memory is written in stream order like any other (rule 6 as amended). Nothing
  orders the nodes of one copy or one batch among themselves (rule 7). A ``free`` is a node
  between its ``call`` and ``ret`` that writes its bytes (rule 9).

An execution is any order of the access nodes consistent with the graph (a linear extension of
the reachability order). Each is simulated on the buffers' cells: every write stores a value of
its own; a read observes the values it reads, a write observes the values it overwrites (so two
unordered writes disagree even when a later write hides both). A cell also counts the frees that
reached it, and accesses observe that count too; a free changes it and observes nothing, so two
frees commute (no race between them, rule 9) while an access on either side of a free does not.
Two executions *disagree* when an access observes different values or the final bytes differ.
The search is a depth-first walk over (placed accesses, memory) states with memoisation; it stops
at the first disagreement.

Kept small on purpose: it refuses traces with more than ``max_accesses`` access nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvverify.check.model import (
    Copy,
    CopyBatch,
    HostRead,
    HostWrite,
    Acquire,
    Free,
    Kernel,
    QueryEvent,
    Record,
    Release,
    SyncDevice,
    SyncEvent,
    SyncStream,
    Trace,
    WaitEvent,
    WaitStream,
)


@dataclass(frozen=True)
class AccessNode:
    """One atomic access of the oracle: a kernel (all its reads and writes at once), one host
    op, one free (``free``: its writes give the bytes back), or one side (``src`` / ``dst``) of
    one copy."""

    id: int                                   # node id in the graph
    op: int
    label: str                                # e.g. "op 2 copy 0 src"
    rank: tuple                               # issue order: (op, copy, 0 for src / 1 for dst)
    reads: tuple[tuple[str, int, int], ...]   # (buffer, start, end)
    writes: tuple[tuple[str, int, int], ...]
    free: bool = False


@dataclass
class Graph:
    names: list[str]                    # node id -> name ("call 3", "begin 3", "op 3 src 0" ...)
    succ: list[list[int]]               # edges; node ids are a topological order
    accesses: list[AccessNode]

    def reach(self) -> list[int]:
        """Per node, the bit set of nodes reachable from it (strictly after it)."""
        out = [0] * len(self.names)
        for u in range(len(self.names) - 1, -1, -1):
            r = 0
            for v in self.succ[u]:
                r |= out[v] | (1 << v)
            out[u] = r
        return out


def build_graph(trace: Trace) -> Graph:
    """The graph of moments of ``trace`` (see the module docstring)."""
    builder = _GraphBuilder(trace)
    for i, op in enumerate(trace.ops):
        builder.op(i, op)
    return Graph(builder.names, builder.succ, builder.accesses)


class _GraphBuilder:
    """Adds each op's moments and edges, in program order (node ids are a topological order)."""

    def __init__(self, trace: Trace):
        self.names: list[str] = []
        self.succ: list[list[int]] = []
        self.accesses: list[AccessNode] = []
        self.space = {name: b.space for name, b in trace.buffers.items()}
        self.last: dict[str, int | None] = {s: None for s in trace.streams}   # last item end per stream
        self.capture: dict[str, int] = {}                                      # event -> its latest record node
        self.first_thread = trace.threads[0] if trace.threads else None
        self.prev_ret: dict[str | None, int] = {}         # thread -> the ret of its latest op
        self.released: dict[str, list[int]] = {}          # sync name -> the rets of its releases so far

    def node(self, name: str) -> int:
        self.names.append(name)
        self.succ.append([])
        return len(self.names) - 1

    def edge(self, u: int | None, v: int) -> None:
        if u is not None:
            assert u < v, "edges go forward in creation order"
            self.succ[u].append(v)

    def access(self, i: int, label: str, rank: tuple, reads, writes, free: bool = False) -> int:
        n = self.node(label)
        self.accesses.append(AccessNode(n, i, label, rank,
                                        tuple((r.buffer, r.offset, r.offset + r.length) for r in reads),
                                        tuple((r.buffer, r.offset, r.offset + r.length) for r in writes), free))
        return n

    def item(self, stream: str, call: int, begin: int, end: int) -> None:
        self.edge(call, begin)              # nothing starts before it is issued
        self.edge(self.last[stream], begin)      # stream order
        self.last[stream] = end

    def op(self, i: int, op) -> None:
        thread = op.thread or self.first_thread
        call = self.node(f"call {i}")
        self.edge(self.prev_ret.get(thread), call)
        later_ret = self._moments(i, op, call)      # nodes that must come before this op's ret
        ret = self.node(f"ret {i}")
        self.edge(call, ret)
        for u in later_ret:
            self.edge(u, ret)
        self.prev_ret[thread] = ret
        if isinstance(op, Release):
            self.released.setdefault(op.sync, []).append(ret)

    def _moments(self, i: int, op, call: int) -> list[int]:
        if isinstance(op, Kernel):
            begin = self.node(f"begin {i}")
            k = self.access(i, f"op {i} kernel", (i, 0, 0), op.reads, op.writes)
            end = self.node(f"end {i}")
            self.item(op.stream, call, begin, end)
            self.edge(begin, k)
            self.edge(k, end)
            return []
        if isinstance(op, (Copy, CopyBatch)):
            return self._copies(i, op, call)
        if isinstance(op, Record):
            r = self.node(f"record {i}")
            self.item(op.stream, call, r, r)
            self.capture[op.event] = r
        elif isinstance(op, WaitEvent) and op.event in self.capture:   # never recorded: a no-op, no item
            w = self.node(f"wait {i}")
            self.item(op.stream, call, w, w)
            self.edge(self.capture[op.event], w)
        elif isinstance(op, WaitStream):
            r = self.node(f"record {i} (wait_stream)")
            self.item(op.on, call, r, r)
            w = self.node(f"wait {i}")
            self.item(op.stream, call, w, w)
            self.edge(r, w)
        elif isinstance(op, SyncEvent) or (isinstance(op, QueryEvent) and op.result):
            return [self.capture[op.event]] if op.event in self.capture else []
        elif isinstance(op, SyncStream):
            return [self.last[op.stream]] if self.last[op.stream] is not None else []
        elif isinstance(op, SyncDevice):
            return [e for e in self.last.values() if e is not None]
        elif isinstance(op, (HostWrite, HostRead)):
            ranges = op.ranges
            h = self.access(i, f"op {i} host", (i, 0, 0), () if isinstance(op, HostWrite) else ranges,
                            ranges if isinstance(op, HostWrite) else ())
            self.edge(call, h)
            return [h]
        elif isinstance(op, Free):
            f = self.access(i, f"op {i} free", (i, 0, 0), (), op.ranges, free=True)
            self.edge(call, f)
            return [f]
        elif isinstance(op, Acquire):
            return list(self.released.get(op.sync, ()))
        return []

    def _copies(self, i: int, op, call: int) -> list[int]:
        order = op.order if isinstance(op, CopyBatch) else "STREAM"
        begin = self.node(f"begin {i}")
        sides = []
        for c, tr in enumerate(op.copies):
            s = self.access(i, f"op {i} copy {c} src", (i, c, 0), (tr.src,), ())
            d = self.access(i, f"op {i} copy {c} dst", (i, c, 1), (), (tr.dst,))
            sides.append((tr, s, d))
        end = self.node(f"end {i}")
        self.item(op.stream, call, begin, end)
        later_ret = []
        for tr, s, d in sides:
            self.edge(begin, d)             # the destination is written in stream order
            self.edge(d, end)
            if self.space[tr.src.buffer] == "host_pageable" or order == "DURING_API_CALL":
                self.edge(call, s)          # read during the call (rule 6 / rule 5)
                later_ret.append(s)
            elif order == "STREAM":
                self.edge(begin, s)
            else:                           # ANY: from the call until the copy completes
                self.edge(call, s)
            self.edge(s, end)
            # A pageable destination is written in stream order like any other (rule 6 as
            # amended: no completion at return; docs/checker.md).
        return later_ret


# ------------------------------------------------------------------------------------------


@dataclass
class OracleResult:
    disagree: bool
    states: int                                   # (placed, memory) states explored
    witness: dict | None = None                   # on disagreement: the two executions and where
    unordered: dict = field(default_factory=dict)  # (op, op) -> kinds of conflicting unordered nodes

    @property
    def verdict(self) -> str:
        return "RACY" if self.disagree else "SAFE"


class _Disagree(Exception):
    pass


def _overlaps(xs, ys) -> bool:
    return any(b == b2 and lo < hi2 and lo2 < hi for b, lo, hi in xs for b2, lo2, hi2 in ys)


def unordered_conflicts(trace: Trace, graph: Graph | None = None) -> dict[tuple[int, int], set[str]]:
    """Pairs of ops with two conflicting access nodes that the graph leaves unordered, with the
    kinds (RAW / WAR / WAW, by issue order; FREE where one is a free; two frees never conflict)
    those nodes show."""
    g = graph or build_graph(trace)
    reach = g.reach()
    out: dict[tuple[int, int], set[str]] = {}
    acc = sorted(g.accesses, key=lambda a: a.rank)
    for x in range(len(acc)):
        for y in range(x + 1, len(acc)):
            a, b = acc[x], acc[y]
            if reach[a.id] >> b.id & 1 or reach[b.id] >> a.id & 1:
                continue
            kinds = set()
            if a.free or b.free:
                if not (a.free and b.free) and _overlaps(a.reads + a.writes, b.reads + b.writes):
                    kinds.add("FREE")
            elif _overlaps(a.writes, b.writes):
                kinds.add("WAW")
            if _overlaps(a.writes, b.reads):
                kinds.add("RAW")
            if _overlaps(a.reads, b.writes):
                kinds.add("WAR")
            if kinds:
                out.setdefault((a.op, b.op), set()).update(kinds)
    return out


def explore(trace: Trace, max_accesses: int = 10) -> OracleResult:
    """Run every execution of ``trace`` the rules allow; report whether two can disagree."""
    g = build_graph(trace)
    nodes = g.accesses
    n = len(nodes)
    if n > max_accesses:
        raise ValueError(f"the oracle enumerates at most {max_accesses} accesses; this trace has {n}")
    reach = g.reach()
    preds = [0] * n
    for x in range(n):
        for y in range(n):
            if reach[nodes[x].id] >> nodes[y].id & 1:
                preds[y] |= 1 << x
    search = _Search(nodes, preds)
    unordered = unordered_conflicts(trace, g)
    try:
        search.dfs(0, search.initial, [])
    except _Disagree:
        w = {
            "observed_at": search.witness["at"],
            "execution_1": [nodes[x].label for x in search.ref_path],
            "execution_2": [nodes[x].label for x in search.witness["path"]],
        }
        return OracleResult(True, len(search.seen), w, unordered)
    return OracleResult(False, len(search.seen), None, unordered)


def _cells(nodes: list[AccessNode]) -> list[tuple[str, int, int]]:
    """The elementary intervals between the range ends used on each buffer."""
    pts: dict[str, set] = {}
    for a in nodes:
        for b, lo, hi in a.reads + a.writes:
            pts.setdefault(b, set()).update((lo, hi))
    cells: list[tuple[str, int, int]] = []
    for b in sorted(pts):
        p = sorted(pts[b])
        cells += [(b, p[k], p[k + 1]) for k in range(len(p) - 1)]
    return cells


class _Search:
    """A depth-first walk over (placed accesses, memory) states, memoised, that simulates the bytes
    of every execution and stops at the first access (or final memory) two executions disagree on."""

    def __init__(self, nodes: list[AccessNode], preds: list[int]):
        self.nodes, self.preds = nodes, preds
        cells = _cells(nodes)

        def cover(ranges) -> tuple[int, ...]:
            return tuple(sorted({c for c, (b, lo, hi) in enumerate(cells)
                                 for b2, lo2, hi2 in ranges if b == b2 and lo2 <= lo and hi <= hi2}))

        self.reads = [cover(a.reads) for a in nodes]
        self.writes = [cover(a.writes) for a in nodes]
        self.full = (1 << len(nodes)) - 1
        # per cell (value, frees so far): a distinct value per cell before any write
        self.initial = tuple((-1 - c, 0) for c in range(len(cells)))
        self.ref: dict = {}            # what each access observed in the first execution; "final": its memory
        self.ref_path: list[int] = []
        self.seen: set = set()
        self.witness: dict = {}

    def step(self, x: int, mem: tuple) -> tuple[tuple, tuple]:
        if self.nodes[x].free:
            m = list(mem)
            for c in self.writes[x]:
                m[c] = (m[c][0], m[c][1] + 1)
            return (), tuple(m)
        obs = (tuple(mem[c] for c in self.reads[x]), tuple(mem[c] for c in self.writes[x]))
        if self.writes[x]:
            m = list(mem)
            for c in self.writes[x]:
                m[c] = (x, m[c][1])            # the value this write stores: its own
            mem = tuple(m)
        return obs, mem

    def dfs(self, placed: int, mem: tuple, path: list[int]) -> None:
        ref = self.ref
        if placed == self.full:
            if "final" not in ref:
                ref["final"] = mem
                self.ref_path[:] = path
            elif ref["final"] != mem:
                self.witness.update(at="final bytes", path=list(path))
                raise _Disagree
            return
        key = (placed, mem)
        if key in self.seen:
            return
        for x in range(len(self.nodes)):
            if placed >> x & 1 or self.preds[x] & ~placed:
                continue
            obs, mem2 = self.step(x, mem)
            if x in ref and ref[x] != obs:
                self.witness.update(at=self.nodes[x].label, path=path + [x])
                raise _Disagree
            ref.setdefault(x, obs)
            path.append(x)
            self.dfs(placed | 1 << x, mem2, path)
            path.pop()
        self.seen.add(key)
