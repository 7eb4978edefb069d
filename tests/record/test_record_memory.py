"""The address map: which allocation a byte range lies in, fresh memory against memory learnt late,
and ranges that lie in none (never dropped)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvverify.record.trace.memory import MemoryMap


def test_a_range_resolves_to_the_allocation_it_lies_in():
    m = MemoryMap()
    a = m.fresh(0x1000, 0x1000, "device", "test")
    b = m.fresh(0x3000, 0x100, "host_pinned", "test")
    assert m.resolve(0x1800, 0x800) == (a.index, 0x800, 0x800)
    assert m.resolve(0x3000, 0x100) == (b.index, 0, 0x100)
    assert m.resolve(0x1800, 0x801) is None  # runs past the end
    assert m.resolve(0x2000, 1) is None  # between the two
    assert "runs 1 bytes past the end of device allocation of 4096 bytes" in m.why_not(0x1800, 0x801)
    assert m.why_not(0x2000, 1) == "lies in no allocation the recording knows"


def test_fresh_memory_retires_what_was_there_and_gets_a_new_index():
    m = MemoryMap()
    old = m.fresh(0x1000, 0x1000, "device", "first tensor")
    new = m.fresh(0x1000, 0x800, "device", "second tensor")  # the allocator reused the block
    assert new.index != old.index
    assert m.resolve(0x1000, 0x10)[0] == new.index
    assert m.resolve(0x1900, 0x10) is None  # the old tensor's tail is no longer known


def test_known_memory_never_displaces_and_grows_an_allocation_it_starts():
    m = MemoryMap()
    a = m.fresh(0x1000, 0x100, "device", "storage")
    assert m.known(0x1000, 0x400, "device", "allocator block") is a
    assert a.size == 0x400  # the block is larger than the storage seen first
    m.fresh(0x2000, 0x100, "device", "other")
    b = m.known(0x1800, 0x1000, "device", "block")  # cut short where the next one begins
    assert (b.base, b.end) == (0x1800, 0x2000)


def test_retire_forgets_only_the_allocation_starting_there():
    m = MemoryMap()
    a = m.fresh(0x1000, 0x100, "device", "t")
    assert m.retire(0x1010) is None
    assert m.retire(0x1000) is a
    assert m.find(0x1000) is None


def test_unresolved_ranges_share_one_placeholder_and_are_absorbed_by_memory_learnt_later():
    m = MemoryMap()
    s1 = m.unresolved_span(0x5000, 0x100, "first", "f.py:1 in g")
    s2 = m.unresolved_span(0x5100, 0x100, "second, touching", None)  # merges with the first
    s3 = m.unresolved_span(0x5080, 0x10, "inside", None)
    p1, p2, p3 = (m.allocations[s[0]] for s in (s1, s2, s3))
    assert p1.placeholder and p1.final()[0] is p3.final()[0] is p2.final()[0]
    top, shift = p1.final()
    assert (top.base, top.end) == (0x5000, 0x5200) and shift == 0
    assert len(m.still_unresolved()) == 3
    real = m.known(0x4000, 0x4000, "host_pinned", "cudaHostAlloc")
    for s in (s1, s2, s3):
        a, shift = m.allocations[s[0]].final()
        assert a is real
        assert s[1] + shift + a.base in (0x5000, 0x5100, 0x5080)
    assert m.still_unresolved() == []


def test_a_range_running_past_an_allocation_gets_its_own_placeholder_outside_the_map():
    m = MemoryMap()
    a = m.fresh(0x1000, 0x100, "device", "t")
    s = m.unresolved_span(0x10F0, 0x20, "overrun", None)
    assert m.allocations[s[0]].placeholder
    assert m.find(0x1000) is a  # the real allocation stays where it is
    assert len(m.still_unresolved()) == 1


def test_fresh_memory_over_a_placeholder_does_not_absorb_it():
    # new memory at an address the program used before is other memory: the old accesses keep
    # their placeholder
    m = MemoryMap()
    s = m.unresolved_span(0x5000, 0x100, "before", None)
    new = m.fresh(0x5000, 0x100, "device", "allocated later")
    assert m.allocations[s[0]].final()[0] is not new
    assert m.still_unresolved()


def test_an_unknown_space_is_refused():
    with pytest.raises(ValueError, match="unknown memory space 'gpu'"):
        MemoryMap().fresh(0, 1, "gpu", "t")


intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 10)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(fresh=intervals, known=intervals, probes=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 12)), max_size=20))
def test_the_live_allocations_stay_disjoint_and_batch_lookups_agree_with_single_ones(fresh, known, probes):
    m = MemoryMap()
    for (b, n), (kb, kn) in zip(fresh, known):
        m.fresh(b * 16, n * 16, "device", "f")
        m.unresolved_span(kb * 16 + 3, kn * 8, "probe", None)
        m.known(kb * 16, kn * 16, "host_pinned", "k")
    live = sorted((a.base, a.end) for a in m.allocations if m.find(a.base) is a)
    for (_, e1), (b2, _) in itertools.pairwise(live):
        assert e1 <= b2
    addresses = np.array([p * 8 for p, _ in probes], dtype=np.int64)
    lengths = np.array([n * 8 for _, n in probes], dtype=np.int64)
    index, offset, found = m.resolve_batch(addresses, lengths)
    for k, (a, n) in enumerate(zip(addresses.tolist(), lengths.tolist())):
        single = m.resolve(a, n)
        real = single is not None and not m.allocations[single[0]].placeholder
        assert bool(found[k]) == real
        if real:
            assert (int(index[k]), int(offset[k])) == single[:2]


operations = st.lists(st.tuples(st.sampled_from(["fresh", "known", "unresolved", "retire"]), st.integers(0, 8),
                                st.integers(1, 6)), max_size=25)


@settings(max_examples=200, deadline=None)
@given(ops=operations, probes=st.lists(st.tuples(st.integers(-2, 30), st.integers(1, 12)), min_size=1, max_size=12))
@example(ops=[("fresh", 0, 1), ("known", 0, 4)], probes=[(2, 1)])  # known memory grows an allocation
def test_lookups_after_every_change_agree_with_the_live_allocations(ops, probes):
    # resolve_batch keeps its arrays between calls and resolve_known reads the map's own lists:
    # neither may answer from a state the map has left (a grown, retired or absorbed allocation)
    m = MemoryMap()
    addresses = np.array([p * 8 for p, _ in probes], dtype=np.int64)
    lengths = np.array([n * 8 for _, n in probes], dtype=np.int64)
    for op, b, n in ops:
        if op == "fresh":
            m.fresh(b * 16, n * 16, "device", "f")
        elif op == "known":
            m.known(b * 16, n * 16, "host_pinned", "k")
        elif op == "unresolved":
            m.unresolved_span(b * 16 + 3, n * 8, "probe", None)
        else:
            m.retire(b * 16)
        live = [a for a in m.allocations if m.find(a.base) is a and not a.placeholder]
        index, offset, found = m.resolve_batch(addresses, lengths)
        for k, (a, length) in enumerate(zip(addresses.tolist(), lengths.tolist())):
            holder = next((x for x in live if x.base <= a and a + length <= x.end), None)
            expected = None if holder is None else (holder.index, a - holder.base, length)
            assert m.resolve_known(a, length) == expected
            assert bool(found[k]) == (holder is not None)
            if holder is not None:
                assert (int(index[k]), int(offset[k])) == expected[:2]
