"""Hostile tests of ``kvverify record --confirm`` (``kvverify.record.confirm.witness``) on the CUDA stand-in:
each test shows one defect of the witness runs and fails until it is fixed."""

from __future__ import annotations

import argparse
import json
import textwrap
import threading
import types
from pathlib import Path

import pytest
from fake_cuda import FakeCuda, FakeTools, shared
from witness_harness import plans_of, plugin_run, record_run, recorded, witness_lines

import kvverify.record as record
from kvverify.record import cli
from kvverify.record.confirm import witness
from kvverify.record.confirm.witness import (
    FORCED,
    IN_ORDER,
    NO_WITNESS,
    Observation,
    Plan,
    Target,
)

BLOCK = 4096


# -- ops found again ------------------------------------------------------------------------------


def store_on_a_worker_thread(fake):
    """A store copied to pinned memory on its own stream right after compute wrote the block, both
    issued by a worker thread with Python's default thread name ("Thread-N (worker)")."""
    kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()

    def worker():
        kv.fill_(1)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    fake.synchronize()


def test_a_pair_issued_by_a_thread_with_a_default_name_is_found_again_in_a_witness_run_in_this_process(fake):
    """Witness runs in the recording's process (``kvverify corpus --confirm``, ``witness_runs`` with a
    platform), and the pytest plugin's child of one test out of a session, number Python's default
    thread names on from where the recording left them: the Target's thread ("Thread-1 (worker)")
    never matches the witness run's ("Thread-2 (worker)"), and every race of a thread is "no
    witness"."""
    rec = recorded(fake, store_on_a_worker_thread)
    (plan,), left = plans_of(rec)
    assert left == [] and plan.first.thread is not None
    obs = witness.observe(lambda: (store_on_a_worker_thread(fake), 0)[1], plan, IN_ORDER,
                          platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second, (plan.first.thread, obs)


def test_a_call_is_counted_into_the_ops_of_the_thread_that_issued_it(fake):
    """``Forcer.after`` runs outside the recorder's lock and writes its count into every op logged
    since its own at its line, whichever thread logged it: another thread running the same line
    in between gets this thread's count. Here thread b's only fill is call 0 of thread b, but is
    logged as call 1 (thread a's), so no witness run finds it again (or finds another op)."""
    a_logged, b_done = threading.Event(), threading.Event()

    class Interleaved(witness.Forcer):
        # only timing: thread a's second fill reaches after() once thread b's fill is logged (a
        # switch of the GIL between the end of the recorder's lock and after())
        def after(self, issued, stream=None):
            if threading.current_thread().name == "a" and issued[0].call == 1:
                a_logged.set()
                b_done.wait(5)
            super().after(issued, stream)

    def work(block, times, go=None, done=None):
        if go is not None:
            go.wait(5)
        for _ in range(times):
            block.fill_(1)
        if done is not None:
            done.set()

    blocks = [fake.device(64), fake.device(64)]

    def program(fake):
        ta = threading.Thread(target=work, args=(blocks[0], 2), name="a")
        tb = threading.Thread(target=work, args=(blocks[1], 1, a_logged, b_done), name="b")
        ta.start()
        tb.start()
        ta.join()
        tb.join()

    with record.recording(platform=fake, skip=fake.skip()) as rec:
        rec.follow_calls(Interleaved(rec.recorder))
        program(fake)
    calls = [(op["thread"], op["call"]) for op in rec.recorder.ops if op["op"] == "kernel"]
    assert sorted(calls) == [("a", 0), ("a", 1), ("b", 0)], calls


def test_an_op_of_the_dispatcher_with_no_user_line_is_not_called_native_capture(fake):
    """A thread whose target is a torch method has no user frame (``at`` None): ``Forcer.before``
    counts it at "" and ``after`` looks for ops at "", so it never gets a call, and ``plans``
    says the op "was seen only by native capture", which it was not (it went through torch's
    dispatcher)."""
    kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()

    def program(fake):
        kv.fill_(1)
        with fake.use(side):
            store = threading.Thread(target=host.copy_, args=(kv,), kwargs={"non_blocking": True}, name="store")
            store.start()
            store.join()
        fake.synchronize()

    rec = recorded(fake, program)
    plans, left = plans_of(rec)
    assert len(plans) + len(left) == 1
    assert all("native capture" not in o.detail for o in left), [o.detail for o in left]


# -- plans ----------------------------------------------------------------------------------------


class Attr:
    def __init__(self, order: int):
        self.srcAccessOrder = order


@pytest.fixture
def batch_stand_in(monkeypatch):
    """cuda-python's ``cuMemcpyBatchAsync`` as a stand-in that succeeds (no copy): what is under test
    is what the recording and the witness make of the call."""
    driver = pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setattr(driver, "cuMemcpyBatchAsync", lambda *args: (driver.CUresult.CUDA_SUCCESS,))
    return driver


def test_a_race_between_two_groups_of_one_batched_call_is_not_planned_as_a_pair(fake, batch_stand_in):
    """One ``cuMemcpyBatchAsync`` of two attribute groups (STREAM a -> b, ANY b -> c) logs two
    ``copy_batch`` ops, racing with each other (RAW). Both have the same Target (one call at one
    line), so the plan's first and second are one op: a witness run never finds a "second", and
    the outcome says the program "did not issue the pair again", which it did (three runs for
    nothing; ``plans`` leaves out a pair that is one op only when it is the same trace op)."""
    driver = batch_stand_in

    def program(fake):
        a, b, c = fake.device(64), fake.device(64), fake.device(64)
        copy = fake.stream()
        driver.cuMemcpyBatchAsync([b.data_ptr(), c.data_ptr()], [a.data_ptr(), b.data_ptr()], [64, 64], 2,
                                  [Attr(1), Attr(3)], [0, 1], 2, copy.handle)
        fake.synchronize()

    rec = recorded(fake, program)
    assert [r.kind for r in rec.check().races] == ["RAW"]
    plans, left = plans_of(rec)
    assert all(p.first != p.second for p in plans), plans
    assert len(left) == 1 and left[0].status == NO_WITNESS


class WriteSpy(FakeCuda):
    """The stand-in, keeping the addresses a witness run writes (an early read's bytes)."""

    def witness_tools(self, internal):
        tools = FakeTools(self)
        self.writes = []
        original = tools.write

        def write(address, data, device):
            self.writes.append((address, len(data)))
            original(address, data, device)

        tools.write = write
        return tools


def test_an_early_read_gives_old_bytes_only_to_the_copies_that_may_read_early(batch_stand_in):
    """A batched call whose first group is STREAM order (behind the copy stream's wait for compute:
    it reads the fill's bytes) and whose second is ANY (may read at the call, before the fill: the
    race). The forced run writes the bytes from before the fill into the destination of every copy
    of the call whose source the fill wrote, the STREAM group's too: on a device that fabricates
    differing bytes where no order CUDA permits gives them (and reports the first of them)."""
    driver = batch_stand_in
    fake = WriteSpy()
    result = {}

    def program(fake):
        src, dst = fake.device(128), fake.device(128)
        compute, copy = fake.stream(), fake.stream()
        with fake.use(compute):
            src.fill_(9)
        copy.wait_stream(compute)
        driver.cuMemcpyBatchAsync([dst.data_ptr(), dst.data_ptr() + 64], [src.data_ptr(), src.data_ptr() + 64],
                                  [64, 64], 2, [Attr(1), Attr(3)], [0, 1], 2, copy.handle)
        fake.synchronize()
        result["dst"] = dst

    rec = recorded(fake, program)
    (plan,), left = plans_of(rec)
    assert left == [] and plan.early_read
    obs = witness.observe(lambda: (program(fake), 0)[1], plan, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second
    base = result["dst"].data_ptr()
    written = sorted((address - base, n) for address, n in fake.writes)
    assert written == [(64, 64)], written  # the ANY group's destination alone


# -- the verdict of three runs --------------------------------------------------------------------


PLAN = Plan((1,), "RAW", Target(None, "a.py:1 in f", "aten.fill_.Scalar", 0),
            Target(None, "a.py:2 in f", "aten.copy_.default", 0), False, False)


def test_runs_that_read_ranges_of_other_sizes_are_not_compared_byte_for_byte():
    """``judge`` compares the total length of the bytes read only: runs in issue order that read
    4 bytes of the first op and 12 of the second, and a forced run that read 12 and 4, are
    compared position by position (the first op's bytes against the second's) and CONFIRMED.
    The pair wrote other ranges in the forced run: the program is not deterministic here."""
    same = bytes([1]) * 4 + bytes([2]) * 12
    in_order = [Observation(IN_ORDER, True, True, ranges=[("device1+0x0", 4), ("pinned1+0x0", 12)], data=same)
                for _ in range(2)]
    forced = Observation(FORCED, True, True, ranges=[("device1+0x0", 12), ("pinned1+0x0", 4)],
                         data=bytes([1]) * 12 + bytes([2]) * 4)
    out = witness.judge(PLAN, "a.py:1 in f", "a.py:2 in f", *in_order, forced)
    assert out.status == NO_WITNESS, out.line()


# -- the command line, the corpus and the pytest plugin -------------------------------------------


MANY_RACES = textwrap.dedent("""\
    import fake_cuda

    fake = fake_cuda.shared()
    kv, host = fake.device(4096), fake.pinned(4096)
    side = fake.stream()
    for step in range(25):  # one racing pair of lines, 25 races
        kv.fill_(step)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        fake.synchronize()
    other = fake.device(64)
    with fake.use(side):
        other.copy_(host[:64], non_blocking=True)
    host.fill_(3)  # another pair of lines: a WAR with the copy above
    fake.synchronize()
    """)


def test_every_racing_pair_of_lines_gets_a_witness_whatever_max_races_lists(tmp_path, monkeypatch, capsys):
    """``--max-races`` (default 20) bounds the races listed, and "the verdict does not depend on
    it"; ``--confirm`` plans its witnesses from the listed races only, so a pair of lines whose
    races come after the 20th (here the WAR at the end of a program that races 25 times at
    another pair) gets no witness, and neither the output nor the JSON report says so."""
    status, report, _ = record_run(tmp_path, monkeypatch, capsys, "--confirm", program=MANY_RACES)
    assert status == 1
    assert sorted(w["kind"] for w in report["witnesses"]) == ["RAW", "WAR"], report["witnesses"]


@pytest.mark.parametrize("spec", ["garbage", "bogus:plan.json:out.json"])
def test_a_malformed_witness_spec_is_refused_with_one_line(tmp_path, monkeypatch, capsys, spec):
    """The hidden ``--witness MODE:PLAN:OUT``: a spec without its three parts raises a ValueError
    (a traceback from ``kvverify record``) where every other bad command line gives status 2 and
    one line; a mode that is neither in-order nor forced runs the program as neither (no hold,
    no wait) and writes an observation a parent would judge."""
    (tmp_path / "prog.py").write_text("x = 1\n")
    plan = {"races": [1], "kind": "RAW", "first": {"thread": None, "at": "prog.py:1 in <module>", "name": "n", "call": 0},
            "second": {"thread": None, "at": "prog.py:1 in <module>", "name": "m", "call": 0},
            "second_on_host": False, "early_read": False}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    status = cli.run(parser.parse_args(["--witness", spec, "--", "python", "prog.py"]), platform=shared())
    assert status == 2
    assert "kvverify record:" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_a_witness_run_that_raises_keeps_the_recorded_verdict_of_a_corpus_case(monkeypatch):
    """``kvverify corpus --confirm`` runs the witness runs in-process, inside the try that guards
    the recording: a witness run that raises (a program checking what it loaded fails once the
    forced order corrupts it: the race is real) turns the recorded RACY verdict into an error,
    with no verdict and no races."""
    import kvverify.record.session as session
    from kvverify.record.corpus import runner

    fake = FakeCuda()

    def on_the_stand_in(**kwargs):
        kwargs["platform"], kwargs["skip"] = fake, fake.skip()
        return session.Recording(**kwargs)

    monkeypatch.setattr(session, "recording", on_the_stand_in)
    runs = []

    def run(form):
        runs.append(form)
        kv, host = fake.device(64), fake.pinned(64)
        side = fake.stream()
        kv.fill_(1)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        fake.synchronize()
        if len(runs) == 4:  # the forced witness run: the program's own check of the stored block fails
            raise AssertionError("the stored block differs")

    case = types.SimpleNamespace(name="store", keep_all=False, capture="dispatch", kind="RAW",
                                 file=Path(__file__).name, pair=("run", "run"), run=run, not_run=None, unseen=None)
    assert runner.recorded(case, "broken").verdict == "RACY"
    runs.clear()
    confirmed = runner.recorded(case, "broken", confirm=True)
    assert confirmed.verdict == "RACY" and confirmed.races == 1, confirmed


TESTS = textwrap.dedent("""\


    @pytest.fixture(scope="module")
    def warm():
        refill(128, True)  # the engine's warm-up step, before the test's recording starts


    @pytest.mark.kvverify_record
    def test_marked_racy():
        refill(64, False)


    def test_after_warm_up_racy(warm):
        refill(64, False)
    """)


def test_pytest_confirm_finds_the_pair_of_a_marked_test_again(tmp_path):
    """``pytest --kvverify-confirm`` runs ``pytest TEST`` as each witness run, under the witness
    run's recording: a test marked ``kvverify_record`` (or using the ``kvverify_record`` fixture)
    starts a recording of its own there, which was refused when recordings did not nest (the test
    errored before its body) and now pauses the witness run's recording (the pair is never seen):
    either way every race of every marked test would be "no witness"."""
    out = plugin_run(tmp_path, TESTS, "-k", "marked")
    assert "races" in out and "witnesses:" in out, out[-3000:]
    found = witness_lines(out, "test_marked_racy")
    assert found and not found[0].startswith("no witness"), found


def test_pytest_confirm_counts_calls_from_where_the_tests_recording_starts(tmp_path):
    """The plugin's recording starts at the test's first function fixture; the witness run's
    recording covers the child's whole pytest session, module fixtures included. A module
    fixture that calls the test's helper (a warm-up step) shifts every call count at its lines:
    the witness runs hold and read the warm-up's copy (128-byte blocks, synchronized), not the
    test's (64-byte blocks), and judge the wrong pair (on a device: the warm-up's synchronize
    blocks on the held stream, and a real race comes out "not confirmed")."""
    out = plugin_run(tmp_path, TESTS, "--kvverify-record", "-k", "after_warm_up")
    found = witness_lines(out, "test_after_warm_up_racy")
    assert found, out[-3000:]
    assert "of 128 " in found[0], found  # the test's pair: 64 device bytes and 64 pinned ones
