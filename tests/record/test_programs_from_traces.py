"""Programs from traces, on the CPU stand-in (``fake_cuda``): a random trace of the shapes one torch
call can issue becomes a program with one line per op (``trace_programs``), the program runs under
``kvverify.record.recording()``, and the recording races on exactly the pairs of lines that
``kvverify.check`` finds racing in the trace itself; with two threads, taking turns as the trace
interleaves them. Every disagreement found is kept as an example (``HANDED_ON``: with two threads,
stream ops the trace writer once left out as ordering nothing). The GPU twin,
``test_programs_from_traces_gpu.py``, runs the programs on CUDA."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, example, find, given, settings
from trace_programs import (
    HANDED_ON,
    FakeDevice,
    disagreement,
    generate,
    racing_lines,
    realizable_traces,
)

from kvverify.check import check

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
DEV = {"space": "device", "bytes": 16}
PIN = {"space": "host_pinned", "bytes": 16}


@SETTINGS
@given(trace=realizable_traces())
# the worker's first op ran while the main thread was still in Thread.start, whose locks then
# ordered it (the main thread now lets the worker's turns begin once start returned)
@example(trace={"version": 1, "buffers": {"dev0": DEV, "reg": {"space": "host_registered", "bytes": 16}, "pin": PIN},
                "streams": ["s0", "s1"], "threads": ["main", "worker"],
                "ops": [{"op": "kernel", "stream": "s1", "reads": [], "writes": [["dev0", 8, 4]], "thread": "worker"},
                        {"op": "record", "event": "e0", "stream": "s1", "thread": "worker"},
                        {"op": "wait_event", "stream": "s1", "event": "e0", "thread": "worker"},
                        {"op": "release", "sync": "h0", "thread": "worker"},
                        {"op": "acquire", "sync": "h0"},
                        {"op": "kernel", "stream": "s0", "reads": [["dev0", 0, 4], ["dev0", 8, 4]],
                         "writes": [["dev0", 4, 4]]},
                        {"op": "wait_event", "stream": "s1", "event": "e0", "thread": "main"},
                        {"op": "release", "sync": "h1"},
                        {"op": "acquire", "sync": "h1", "thread": "worker"},
                        {"op": "record", "event": "e0", "stream": "s1", "thread": "worker"},
                        {"op": "sync_event", "event": "e0", "thread": "main"}]})
# the stand-in's buffers were made where its own dtype probe (a 1-byte CPU tensor, recorded and
# freed unseen) had been, so that a swap's raw pointer ran past that allocation
@example(trace={"version": 1, "buffers": {"dev0": DEV, "dev1": DEV, "reg": {"space": "host_registered", "bytes": 16},
                                          "pin": PIN},
                "streams": ["s0", "s1"],
                "ops": [{"op": "copy_batch", "stream": "s1", "order": "STREAM",
                         "copies": [{"src": ["reg", 8, 8], "dst": ["dev0", 0, 8]}]},
                        {"op": "record", "event": "e0", "stream": "s1"},
                        {"op": "sync_event", "event": "e0"},
                        {"op": "host_write", "ranges": [["reg", 12, 4], ["reg", 8, 8]]},
                        {"op": "record", "event": "e1", "stream": "s1"},
                        {"op": "sync_device"},
                        {"op": "kernel", "stream": "s0", "reads": [], "writes": [["dev0", 0, 4]]},
                        {"op": "query_event", "event": "e1", "result": True},
                        {"op": "copy_batch", "stream": "s0", "order": "STREAM",
                         "copies": [{"src": ["pin", 0, 4], "dst": ["dev0", 0, 4]},
                                    {"src": ["reg", 12, 4], "dst": ["dev0", 12, 4]}]},
                        {"op": "record", "event": "e0", "stream": "s0"},
                        {"op": "wait_event", "stream": "s1", "event": "e0"}]})
def test_a_program_made_from_a_trace_races_recorded_on_the_lines_the_trace_races_on(trace, tmp_path_factory):
    found = disagreement(trace, FakeDevice(), tmp_path_factory.mktemp("program"))
    assert found is None, found


@pytest.mark.parametrize("name", list(HANDED_ON))
def test_a_stream_op_that_orders_nothing_itself_still_orders_another_threads_later_work(name, tmp_path):
    found = disagreement(HANDED_ON[name], FakeDevice(), tmp_path)
    assert found is None, found


def test_a_racy_program_races_recorded_between_the_two_lines_that_issued_the_pair(tmp_path):
    # a D2H copy on s0 and a host write of its destination that nothing orders after it
    trace = {"version": 1, "buffers": {"dev0": DEV, "pin": PIN}, "streams": ["s0", "s1"],
             "ops": [{"op": "copy", "stream": "s0", "src": ["dev0", 0, 8], "dst": ["pin", 0, 8]},
                     {"op": "record", "event": "e0", "stream": "s1"},
                     {"op": "host_write", "ranges": [["pin", 4, 4]]}]}
    program = generate(trace)
    lines = program.source.splitlines()
    assert racing_lines(trace, program) == {(program.lines[0], program.lines[2])}
    copy_line = "with api.on(stream0): buf1[0:8].copy_(buf0[0:8], non_blocking=True)"
    assert lines[program.lines[0] - 1].strip() == copy_line
    assert lines[program.lines[2] - 1].strip() == "buf1[4:8].fill_(3)"
    assert disagreement(trace, FakeDevice(), tmp_path) is None


def test_each_op_is_one_line_and_two_threads_take_turns_in_the_traces_order():
    trace = {"version": 1, "buffers": {"dev0": DEV, "dev1": DEV, "pin": PIN}, "streams": ["s0", "s1"],
             "threads": ["main", "worker"],
             "ops": [{"op": "kernel", "stream": "s0", "reads": [["dev0", 0, 4], ["dev1", 0, 4]],
                      "writes": [["dev1", 8, 4]]},
                     {"op": "copy_batch", "stream": "s1", "order": "ANY", "thread": "worker",
                      "copies": [{"src": ["dev1", 8, 4], "dst": ["pin", 0, 4]}]},
                     {"op": "record", "event": "e0", "stream": "s1", "thread": "worker"},
                     {"op": "release", "sync": "h0", "thread": "worker"},
                     {"op": "acquire", "sync": "h0"},
                     {"op": "query_event", "event": "e0", "result": True},
                     {"op": "free", "ranges": [["pin", 0, 4], ["dev0", 0, 4]]}]}
    program = generate(trace)
    source = program.source.splitlines()
    assert [source[n - 1].strip() for n in program.lines] == [
        "with api.on(stream0): torch.add(buf0[0:4], buf1[0:4], out=buf1[8:12])",
        "with api.on(stream1): api.swap([buf1[8:12].data_ptr()], [buf2[0:4].data_ptr()], [4], 'ANY')",
        "event0.record(stream1)",
        "handoff0.put(None)",
        "handoff0.get()",
        "while not event0.query(): pass",
        "reuse(buf2[0:4], buf0[0:4])"]
    turns = [line.strip() for line in source if line.strip().startswith(("wait(", "turn[0] ="))]
    # the main thread's body, the worker's, then the first turn, given once the worker has started
    assert turns == ["wait(0)", "turn[0] = 1", "wait(2)", "turn[0] = 3", "wait(1)", "turn[0] = 2", "turn[0] = 0"]


@pytest.mark.parametrize("op, why", [
    ({"op": "query_event", "event": "e0", "result": False}, "not yet complete"),
    ({"op": "copy", "stream": "s0", "src": ["dev0", 0, 4], "dst": ["dev0", 8, 4]}, "between host and device memory"),
    ({"op": "copy_batch", "stream": "s0", "order": "ANY", "copies": [{"src": ["pin", 0, 4], "dst": ["pin", 8, 4]}]},
     "host-to-host"),
    ({"op": "kernel", "stream": "s0", "reads": [["dev0", 0, 8]], "writes": [["dev0", 8, 4]]}, "no torch call"),
    ({"op": "kernel", "stream": "s0", "reads": [["dev0", 0, 8]], "writes": [["dev0", 4, 8]]}, "partly overlaps"),
    ({"op": "kernel", "stream": "s0", "reads": [], "writes": [["pin", 0, 4]]}, "not in device memory"),
    ({"op": "host_write", "ranges": [["dev0", 0, 4]]}, "not in host memory"),
    ({"op": "acquire", "sync": "h0"}, "with no release"),
], ids=lambda value: value["op"] if isinstance(value, dict) else None)
def test_an_op_no_line_can_issue_is_refused_by_name(op, why):
    trace = {"version": 1, "buffers": {"dev0": DEV, "pin": PIN}, "streams": ["s0"], "ops": [op]}
    with pytest.raises(ValueError, match=why):
        generate(trace)


def test_the_strategy_reaches_races_between_the_ops_of_two_threads():
    def crossing(trace: dict) -> bool:
        ops = trace["ops"]
        return any(ops[r.first].get("thread", "main") != ops[r.second].get("thread", "main")
                   for r in check(trace).races)

    # (found, not shrunk: the first one will do)
    trace = find(realizable_traces(), crossing,
                 settings=settings(database=None, derandomize=True, phases=[Phase.generate]))
    assert trace["threads"] == ["main", "worker"]
