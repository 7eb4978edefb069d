"""Scenario catalogue on the CPU: programs are consistent, and the checker's contract verdict
of every scenario, per order and host memory kind, is what the trace rules say (docs/trace-format.md).

The expectations live here, in the test, on purpose: scenarios never say which orders make
them racy (that is the checker's job); this table is the independent statement of intent.
"""

from __future__ import annotations

import pytest

from kvverify.scenarios import SCENARIOS, Params, contract, get, select, to_trace
from kvverify.scenarios.program import (
    GPU,
    HOST,
    BlockCopy,
    Blocks,
    Expect,
    HostFill,
    Program,
    ProgramError,
    Swap,
    Write,
    reference_contents,
    validate,
)
from kvverify.stress.executors.adversarial import batch_rounds

ORDERS = ("STREAM", "DURING_API_CALL", "ANY")
R, S = "RACY", "SAFE"

# (scenario, direction) -> {host kind: (STREAM, DURING_API_CALL, ANY)}; "*" = every host kind.
EXPECTED = {
    # no barrier: the store's source read races the writer whatever the order.
    ("H1-broken", "store"): {"*": (R, R, R)},
    # behind wait_stream(compute): safe only when the source is read in stream order.
    ("H1-fixed", "store"): {"*": (S, R, R)},
    ("H2-broken", "load"): {"*": (R, R, R)},
    ("H2-fixed", "load"): {"*": (S, S, S)},
    # the staging block is read during the call under DURING_API_CALL, and always when pageable.
    ("H3-broken", "load"): {"pinned": (R, S, R), "registered": (R, S, R), "pageable": (S, S, S)},
    ("H3-fixed", "load"): {"*": (S, S, S)},
    # a pageable destination is not complete when the call returns either (rule 6 as amended).
    ("H4-broken", "store"): {"*": (R, R, R)},
    ("H4-fixed", "store"): {"*": (S, R, R)},
    # the reload's source read escapes the device event under DURING_API_CALL / ANY; a pageable
    # source is read during the call whatever the order, while the store into it may be pending.
    ("H5-broken", "load"): {"pinned": (S, R, R), "registered": (S, R, R), "pageable": (R, R, R)},
    ("H5-fixed", "load"): {"*": (S, S, S)},
    ("H6-broken", "load"): {"*": (R, R, R)},
    ("H6-fixed", "load"): {"*": (S, S, S)},
    ("H7-broken", "store"): {"*": (R, R, R)},
    ("H7-broken", "load"): {"*": (R, R, R)},
    ("H7-fixed", "store"): {"*": (S, R, R)},
    ("H7-fixed", "load"): {"*": (S, S, S)},
    ("P1", "store"): {"*": (S, R, R)},
    ("P2", "load"): {"*": (S, S, S)},
}
HOSTS = ("pinned", "registered", "pageable")


def test_the_table_covers_the_catalogue():
    assert set(EXPECTED) == {(s.name, d) for s in SCENARIOS.values() for d in s.directions}
    hazards = {s.hazard for s in SCENARIOS.values()}
    assert hazards == {f"H{i}" for i in range(1, 8)} | {"P1", "P2"}
    for h in (f"H{i}" for i in range(1, 8)):
        assert {s.form for s in SCENARIOS.values() if s.hazard == h} == {"broken", "fixed"}


@pytest.mark.parametrize("key", sorted(EXPECTED), ids=lambda k: f"{k[0]}-{k[1]}")
@pytest.mark.parametrize("host", HOSTS)
def test_contract_verdict_per_order(key, host):
    name, direction = key
    program = get(name).program(direction, Params(blocks_per_transfer=3, transfers=3))
    want = EXPECTED[key].get(host, EXPECTED[key].get("*"))
    got = tuple(contract(to_trace(program, o, host, 4096, 2)).verdict for o in ORDERS)
    assert got == want, f"{name} {direction} {host}: STREAM/DURING/ANY = {got}, expected {want}"


@pytest.mark.parametrize("tensors", [1, 3])
@pytest.mark.parametrize("params", [Params(1, 2), Params(5, 4)])
def test_verdict_does_not_depend_on_tensor_count_or_pipeline_shape(tensors, params):
    for (name, direction), per_host in EXPECTED.items():
        program = get(name).program(direction, params)
        for host in ("pinned", "pageable"):
            want = per_host.get(host, per_host.get("*"))
            got = tuple(contract(to_trace(program, o, host, 64, tensors)).verdict for o in ORDERS)
            assert got == want, (name, direction, host, tensors, params)


def test_in_batch_overlap_is_reported_inside_one_copy_batch():
    program = get("H7-broken").program("load", Params(2, 2))
    report = contract(to_trace(program, "STREAM", "pinned", 4096, 2))
    assert any(r.first == r.second and r.kind == "WAW" for r in report.races)


def test_broken_store_witness_names_the_writer_and_the_swap():
    program = get("H1-broken").program("store", Params(2, 2))
    doc = to_trace(program, "STREAM", "pinned", 4096, 2)
    race = contract(doc).races[0]
    kinds = {doc["ops"][race.first]["op"], doc["ops"][race.second]["op"]}
    assert kinds == {"kernel", "copy_batch"} and race.kind in ("RAW", "WAR")


def test_trace_ranges_stay_inside_buffers_and_use_the_host_kind():
    program = get("P1").program("store", Params(4, 3))
    doc = to_trace(program, "ANY", "registered", 8192, 2)
    assert doc["buffers"]["cpu_kv"]["space"] == "host_registered"
    for op in doc["ops"]:
        ranges = op.get("reads", []) + op.get("writes", []) + op.get("ranges", [])
        ranges += [r for c in op.get("copies", []) for r in (c["src"], c["dst"])]
        for buf, off, n in ranges:
            assert 0 <= off and off + n <= doc["buffers"][buf]["bytes"]


def test_every_program_validates_and_checks_agree_with_the_reference_model():
    for s in SCENARIOS.values():
        for d in s.directions:
            program = s.program(d, Params(2, 3))
            validate(program)
            assert program.max_generation() < 64


def test_validate_catches_a_wrong_expected_generation():
    g, h = Blocks(GPU, (0,)), Blocks(HOST, (0,))
    program = Program(("compute", "x"), 1, 1, (Write("compute", g, 2), Swap("x", (BlockCopy(g, h),)), Expect(h, 3)))
    with pytest.raises(ProgramError, match="expects generation 3"):
        validate(program)


def test_validate_catches_unknown_streams_and_pools():
    g = Blocks(GPU, (0,))
    with pytest.raises(ProgramError, match="unknown stream"):
        validate(Program(("compute",), 1, 0, (Write("other", g, 2),)))
    with pytest.raises(ProgramError, match="host touches host blocks only"):
        validate(Program(("compute",), 1, 0, (HostFill(g, 2),)))
    with pytest.raises(ProgramError, match="outside the pool"):
        validate(Program(("compute",), 1, 0, (Write("compute", Blocks(GPU, (3,)), 2),)))


def test_reference_model_reads_batch_sources_before_the_batch_and_lets_the_last_copy_win():
    a, b = Blocks(GPU, (0,)), Blocks(GPU, (1,))
    h = Blocks(HOST, (0,))
    program = Program(("compute", "x"), 2, 1, (Write("compute", b, 5), Swap("x", (BlockCopy(a, h), BlockCopy(b, h)))))
    after = reference_contents(program)[-1]
    assert after[(HOST, 0)] == (1, 5)  # content of GPU slot 1, generation 5


def test_select_by_name_hazard_and_all():
    assert [s.name for s in select("H3")] == ["H3-broken", "H3-fixed"]
    assert [s.name for s in select(["P2", "H1-fixed"])] == ["P2", "H1-fixed"]
    assert len(select(["all"])) == len(SCENARIOS)
    with pytest.raises(ValueError, match="unknown scenario 'H9'"):
        select("H9")


def test_params_reject_pipelines_without_overlap():
    with pytest.raises(ValueError, match="transfers"):
        Params(4, 1)
    with pytest.raises(ValueError, match="blocks_per_transfer"):
        Params(0, 2)


def test_a_scenario_refuses_a_direction_it_does_not_have():
    with pytest.raises(ValueError, match="runs load"):
        get("P2").program("store", Params())


def test_batch_rounds_reverse_conflicting_copies_only():
    g, h = (lambda s: (GPU, s)), (lambda s: (HOST, s))
    assert batch_rounds([(g(0), h(5)), (g(1), h(5))]) == [1, 0]
    assert batch_rounds([(g(0), h(1)), (g(2), h(3))]) == [0, 0]
    # a block stored and then overwritten by a load in the same batch: the load runs first
    assert batch_rounds([(g(0), h(1)), (h(2), g(0))]) == [1, 0]
    assert batch_rounds([(g(0), h(5)), (g(1), h(6)), (g(2), h(5)), (g(3), h(6))]) == [1, 1, 0, 0]
