"""Nested recordings (``kvverify.record.session``: ``start`` / ``_pause`` / ``_resume`` / ``stop`` /
``_attach`` / ``_detach``), on the CUDA stand-in. A recording started inside another pauses it: each
level records its own ops, and the outer decides nothing across the pause (it says it is not
complete) yet keeps what its threads did meanwhile (a join, a thread the inner started, their device
work). A start, pause, resume or stop that fails partway raises its error and leaves the outer
recording, with no dispatch mode or hook left behind; a refused start leaves nothing half set; a
program's own recording or dispatch mode under ``kvverify record`` neither hides its exit status
nor the tests after it. Every test leaves the process as it found it (the ``clean`` fixture takes
away what a failure would leave behind: dispatch modes, hooks, a recording still active). A
docstring that starts "Was:" tells the defect its test holds off, as the code had it."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from fake_cuda import FakeCuda
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode_stack,
)
from witness_harness import REFILL

import kvverify.record as record
from kvverify.record import cli
from kvverify.record.capture.threads import _ACQUIRES, _LOCK_TYPES, _RELEASES

BLOCK = 4096
HERE = Path(__file__).resolve().parent


def _lock_methods() -> dict:
    return {(cls, name): cls.__dict__.get(name) for cls in _LOCK_TYPES for name in (*_ACQUIRES, *_RELEASES)}


def _hooks() -> dict:
    """What a recording changes in the process, to compare before and after."""
    import queue

    return {"modes": list(_get_current_dispatch_mode_stack()), "freeze": gc.get_freeze_count(),
            "active": record.session._active, "start": threading.Thread.start,
            "bootstrap": threading.Thread._bootstrap_inner, "join": threading.Thread.join,
            "put": queue.Queue.put, "preadv": getattr(os, "preadv", None), "readv": getattr(os, "readv", None),
            "locks": _lock_methods()}


@pytest.fixture(autouse=True)
def clean():
    """Undo what a failing test left behind, so that the next tests start from a clean process."""
    import queue

    before = _hooks()
    yield before
    for _ in range(10):  # recordings left running: stop the innermost first
        rec = record.session._active
        if rec is None:
            break
        try:
            rec.stop()
        except Exception:
            record.session._active = rec._outer
            rec.running = False
    record.session._active = None
    while len(_get_current_dispatch_mode_stack()) > len(before["modes"]):
        torch._C._pop_torch_dispatch_stack(None)
    for (cls, name), original in before["locks"].items():
        current = cls.__dict__.get(name)
        if original is not None and current is not original:  # a lock method left patched
            import ctypes

            (table,) = [d for d in gc.get_referents(cls.__dict__) if isinstance(d, dict) and d.get(name) is current]
            table[name] = original
            ctypes.pythonapi.PyType_Modified.argtypes = [ctypes.py_object]
            ctypes.pythonapi.PyType_Modified(cls)
    threading.Thread.start, threading.Thread._bootstrap_inner = before["start"], before["bootstrap"]
    threading.Thread.join, queue.Queue.put = before["join"], before["put"]
    for name in ("preadv", "readv"):
        if before[name] is not None:
            setattr(os, name, before[name])
    while gc.get_freeze_count() and not before["freeze"]:
        gc.unfreeze()


def _fills(rec) -> list[str]:
    return [op["name"] for op in rec.recorder.ops if op.get("name") == "aten.fill_.Scalar"]


# -- a recording inside another ----------------------------------------------------------------


def test_a_recording_started_inside_another_pauses_it_and_the_outer_decides_nothing_across_the_pause(fake):
    """A test that records itself, run under ``kvverify record -- pytest``: the inner recording
    gets the ops made while it runs, the outer one neither those nor a race between an op before
    the pause and one after it (the inner run may have ordered them: it is not seen); the outer's
    summary names the pause as work not recorded, so it cannot say SAFE for the whole run; after
    the pause it records again, memory learnt anew."""
    kv, host, other = fake.device(BLOCK), fake.pinned(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake) as outer:
        kv.fill_(1)
        fake.synchronize()
        with fake.use(side):
            host.copy_(kv, non_blocking=True)  # would race with the host write below, were it seen
        with record.recording(platform=fake) as inner:
            kv.fill_(2)
            with fake.use(side):
                other.copy_(kv, non_blocking=True)  # RAW with the fill: the inner's race
        record.host_write(host)  # unordered with the store above, but a pause lies between
        kv.fill_(3)
        with fake.use(side):
            other.copy_(kv, non_blocking=True)  # RAW with this fill: the outer's own race, after the pause
        fake.synchronize()
    assert [r.kind for r in inner.check().races] == ["RAW"]
    inner_fills = [op for op in inner.recorder.ops if op.get("name") == "aten.fill_.Scalar"]
    assert len(inner_fills) == 1
    outer_fills = [op for op in outer.recorder.ops if op.get("name") == "aten.fill_.Scalar"]
    assert len(outer_fills) == 2  # before and after the pause, not the inner's
    races = outer.check().races
    assert [r.kind for r in races] == ["RAW"], [r.render() if hasattr(r, "render") else r for r in races]
    assert not outer.complete() and inner.complete()
    assert any("recordings nested in this one" in n for n in outer.summary().notes)
    assert any(op["op"] == "sync_device" for op in outer.recorder.ops)
    assert record.session._active is None


def test_a_paused_recording_stops_the_ones_nested_in_it_first(fake):
    """A program that ends without stopping its own recording, under ``kvverify record``: the
    outer's stop stops the inner first, so nothing stays installed and the outer's trace is
    written."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    outer = record.recording(platform=fake).start()
    inner = record.recording(platform=fake).start()
    fake.device(BLOCK).fill_(1)
    outer.stop()
    assert not outer.running and not inner.running and record.session._active is None
    assert _get_current_dispatch_mode_stack() == []
    assert len([op for op in inner.recorder.ops if op.get("name") == "aten.fill_.Scalar"]) == 1
    assert not outer.complete()


def test_a_recording_inside_another_with_a_dispatch_mode_entered_between_them_leaves_that_mode_in_place(fake):
    """Pausing the outer recording leaves its dispatch mode where it lies: a mode entered after it
    (a sanitizer's, a test fixture's) stays on torch's stack in its place, and the program's own
    ``__exit__`` of it, which pops the top of the stack, still pops that mode."""
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _get_current_dispatch_mode_stack,
    )

    class Between(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    kv = fake.device(BLOCK)
    with record.recording(platform=fake) as outer:
        between = Between()
        with between:
            with record.recording(platform=fake) as inner:
                assert _get_current_dispatch_mode_stack() == [between, inner._mode]
                kv.fill_(1)
            assert _get_current_dispatch_mode_stack() == [outer._mode, between]
            kv.fill_(2)
        assert _get_current_dispatch_mode_stack() == [outer._mode]
        kv.fill_(3)
    assert _get_current_dispatch_mode_stack() == []
    assert len([op for op in outer.recorder.ops if op.get("name") == "aten.fill_.Scalar"]) == 2
    assert len([op for op in inner.recorder.ops if op.get("name") == "aten.fill_.Scalar"]) == 1


def test_a_recording_started_again_records_its_new_run(fake):
    """Was: ``start()`` resets the results (``_built``, ``_verdict``) and makes a new
    ``Recorder``, so a Recording may be started again after ``stop()``. Since nesting, ``_attach``
    builds the dispatch mode, driver ops, thread capture and bindings only when ``self._mode is
    None`` ("first"): a second ``start()`` keeps the first run's mode, which logs into the FIRST
    run's recorder. The second run's trace has none of its ops: SAFE and complete about work it
    never saw (here a racing pair would be dropped just the same)."""
    kv = fake.device(BLOCK)
    rec = record.recording(platform=fake)
    with rec:
        kv.fill_(1)
    with rec:
        kv.fill_(2)
        kv.fill_(3)
    assert len(_fills(rec)) == 2, "the second run's ops went to the first run's recorder"


def test_three_levels_restore_every_hook_and_each_level_records_its_own(fake, clean):
    """Three levels of nesting: each recording gets exactly its own ops, the two paused
    ones say they are incomplete, and afterwards torch's mode stack, gc.freeze, the thread, queue
    and lock patches and os.preadv are what they were."""
    kv = fake.device(BLOCK)
    with record.recording(platform=fake) as a:
        kv.fill_(1)
        with record.recording(platform=fake) as b:
            kv.fill_(2)
            with record.recording(platform=fake) as c:
                kv.fill_(3)
            kv.fill_(4)
        kv.fill_(5)
    assert (len(_fills(a)), len(_fills(b)), len(_fills(c))) == (2, 2, 1)
    assert (a.complete(), b.complete(), c.complete()) == (False, False, True)
    assert _hooks() == clean


def test_an_exception_in_the_inner_block_propagates_unchanged_and_the_outer_goes_on(fake, clean):
    """An exception raised in the inner ``with`` leaves it as raised; the outer resumes
    (records the next op) and every hook is gone at the end."""
    kv = fake.device(BLOCK)
    with record.recording(platform=fake) as outer:
        with pytest.raises(KeyError, match="boom"):
            with record.recording(platform=fake) as inner:
                kv.fill_(1)
                raise KeyError("boom")
        assert record.session._active is outer and not inner.running
        kv.fill_(2)
    assert len(_fills(outer)) == 1 and len(_fills(inner)) == 1
    assert _hooks() == clean


# -- what the outer keeps of its threads across the pause --------------------------------------


def test_a_join_during_the_pause_does_not_become_a_race_across_it(fake):
    """Was: The pause is meant to decide nothing across it: the resume logs a ``sync_device``.
    That orders device work, not another thread's host accesses. A worker the outer follows
    writes the staging buffer, then the main thread joins it while an inner recording runs (the
    join's acquire is not logged: the thread patches are off during the pause; the worker's end
    release still is, its bootstrap wrapper was already on its stack). After the pause the main
    thread copies from the buffer. The program is correct (join orders the write first), yet the
    outer reports a RAW race between an op before the pause and one after it, exit 1 with a
    'fix' to apply: a race across the pause decided, and decided wrong."""
    host, kv = fake.pinned(BLOCK), fake.device(BLOCK)
    side = fake.stream()
    worker = threading.Thread(target=lambda: record.host_write(host), name="worker")
    with record.recording(platform=fake) as outer:
        worker.start()
        with record.recording(platform=fake):
            worker.join()  # the worker's write happens before everything below
        with fake.use(side):
            kv.copy_(host, non_blocking=True)
        fake.synchronize()
    assert len(outer.check().races) == 0, outer.check().render()


def _d2h_when_told(fake):
    """A device block and a worker's body: once ``go`` is set, a D2H copy reading the block on a
    side stream, then ``done`` set. Returns ``(block, body, go, done)``."""
    kv, host, side = fake.device(BLOCK), fake.pinned(BLOCK), fake.stream()
    go, done = threading.Event(), threading.Event()

    def work():
        go.wait()
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        done.set()

    return kv, work, go, done


def test_a_thread_started_by_the_inner_that_outlives_it_is_not_lost_by_the_outer(fake):
    """Was: A thread started while the inner recording runs is followed by the inner only: it
    carries the inner's (now inactive) dispatch mode, and the outer never follows it, never
    lists it among threads beside it (``running_before`` is taken at the first start only). Its
    device work after the inner stopped, racing with the outer's own work after the pause, is in
    no trace, and the outer's note even says "what ran while each ran is in its own trace". The
    same program without the inner recording is RACY; with it the outer says SAFE (exit 2 instead
    of 1) and the summary never names the thread."""
    kv, work, go, done = _d2h_when_told(fake)
    with record.recording(platform=fake) as outer:
        with record.recording(platform=fake):
            worker = threading.Thread(target=work, name="worker")
            worker.start()
        go.set()
        done.wait()
        kv.fill_(7)  # WAR with the worker's D2H: both after the pause
        worker.join()
    text = "\n".join(outer.summary().lines())
    assert outer.check().verdict == "RACY" or "worker" in text, text


def test_device_work_of_the_outers_thread_during_the_pause_is_not_dropped_unnoticed(fake):
    """Was: A thread the outer follows keeps running while an inner recording runs on the main
    thread. Its ops still go through the outer's forked dispatch mode, which sees them and drops
    them (``is_active()`` is false while paused) without a note anywhere; the inner does not follow
    the thread. Here that thread's D2H copy races with the inner's own fill: the inner says SAFE
    and complete() (exit 0 under the CLI), the outer's note claims what ran is in the inner's
    trace. Without native capture (witness runs, another CUPTI subscriber: ``native=False``) nothing
    else flags it."""
    kv, work, go, done = _d2h_when_told(fake)
    with record.recording(platform=fake, native=False):
        worker = threading.Thread(target=work, name="worker")
        worker.start()
        with record.recording(platform=fake, native=False) as inner:
            go.set()
            done.wait()
            kv.fill_(7)  # WAR with the worker's read: a real race while the inner runs
        worker.join()
    assert inner.check().verdict == "RACY" or not inner.complete(), inner.report()


# -- a start, pause, resume or stop that fails partway -----------------------------------------


class _FailsOn(FakeCuda):
    """The stand-in, with one method that raises on the given calls (counted from 1)."""

    def __init__(self, method: str, calls: set[int]) -> None:
        super().__init__()
        self.method, self.calls, self.count = method, calls, 0

    def _maybe_fail(self, method: str) -> None:
        if method == self.method:
            self.count += 1
            if self.count in self.calls:
                raise RuntimeError(f"{method} failed (call {self.count})")

    def install(self, *args, **kwargs):
        self._maybe_fail("install")
        return super().install(*args, **kwargs)

    def on_launch(self, report) -> None:
        self._maybe_fail("on_launch")

    def native_leftover(self):
        self._maybe_fail("native_leftover")
        return super().native_leftover()


def test_an_inner_start_that_fails_after_its_mode_is_entered_leaves_no_mode_behind(clean):
    """Was: ``_attach`` guards only ``install`` and the mode's ``__enter__``: a failure after
    them (``platform.on_launch`` here, or ``on_graph_replay``, ``ThreadCapture.start``,
    ``Bindings.install``) leaves the inner's RecordingMode on torch's stack, still ``active``. Nested,
    ``start`` then resumes the outer on top of it; when the outer stops it pops its own, and the
    dead inner's mode stays in every later op of the program, recording into a recording no one
    will read (torch's dispatch mode stack is changed for good)."""
    fake = _FailsOn("on_launch", {2})
    outer = record.recording(platform=fake).start()
    with pytest.raises(RuntimeError, match="on_launch failed"):
        record.recording(platform=fake).start()
    outer.stop()
    assert list(_get_current_dispatch_mode_stack()) == clean["modes"]


def test_a_failed_resume_leaves_an_outer_that_stops_cleanly(clean):
    """Was: When the outer's resume fails (its platform's ``install`` raises as the inner stops),
    the exception leaves the inner's ``stop`` and the outer stays "running" with no capture at
    all: it records nothing more and says nothing of it, ``_active`` still names it (so a later
    recording is refused with "a dispatch mode entered after it is still active (NoneType)"),
    and its own ``stop()`` then leaves a mode it never entered: IndexError from torch out of the
    program's ``with`` block (or, on a stack with a mode of the program's, it would pop that)."""
    fake = _FailsOn("install", {3})  # outer start, inner start, outer resume
    outer = record.recording(platform=fake).start()
    inner = record.recording(platform=fake).start()
    with pytest.raises(RuntimeError, match="install failed"):
        inner.stop()
    outer.stop()  # IndexError: pop from an empty deque
    assert record.session._active is None
    assert list(_get_current_dispatch_mode_stack()) == clean["modes"]


def test_a_pause_that_fails_leaves_the_outer_recording(clean):
    """The outer's pause failing partway (collecting its native leftovers raises as the inner
    starts): the start raises that error, and the outer records again, its capture whole."""
    fake = _FailsOn("native_leftover", {1})  # the outer's pause
    kv = fake.device(BLOCK)
    outer = record.recording(platform=fake).start()
    with pytest.raises(RuntimeError, match="native_leftover failed"):
        record.recording(platform=fake).start()
    assert record.session._active is outer
    kv.fill_(1)
    outer.stop()
    assert len(_fills(outer)) == 1
    assert _hooks() == clean


def test_an_inner_stop_that_fails_partway_still_takes_its_capture_away(clean):
    """Was: ``_detach`` runs its steps one after another in a ``try`` whose ``finally`` only
    unfreezes and uninstalls the platform: when collecting the native leftovers raises, the
    inner's cuda-python / ``os.preadv`` wrappers, its thread and lock patches and its dispatch mode
    all stay installed, and ``stop`` skips the outer's resume. The outer's own stop then fails as
    well (IndexError), and the process keeps the inner's hooks after every recording stopped."""
    fake = _FailsOn("native_leftover", {2})  # the inner's stop
    outer = record.recording(platform=fake).start()
    inner = record.recording(platform=fake).start()
    with pytest.raises(RuntimeError, match="native_leftover failed"):
        inner.stop()
    assert record.session._active is outer and not inner.running
    outer.stop()
    after = _hooks()
    assert after["modes"] == clean["modes"]
    assert after["locks"] == clean["locks"] and after["start"] is clean["start"]


def test_an_inner_whose_install_fails_leaves_the_outer_recording(clean):
    """The platform's ``install`` raising on the inner's start: the error reaches the
    caller, the outer resumes and records, and nothing stays installed after it stops."""
    fake = _FailsOn("install", {2})
    kv = fake.device(BLOCK)
    with record.recording(platform=fake) as outer:
        with pytest.raises(RuntimeError, match="install failed"):
            record.recording(platform=fake).start()
        kv.fill_(1)
    assert len(_fills(outer)) == 1 and not outer.complete()
    assert _hooks() == clean


def test_a_refused_nested_recording_says_nothing_was_recorded(fake):
    """A nested start that is refused (here: on another thread than the running recording's)
    leaves nothing half set: its ``trace()`` raises the documented RecordingError ("nothing was
    recorded: start() the recording first"), not an AttributeError."""
    from kvverify.errors import RecordingError

    refused = record.recording(platform=fake)
    errors = []

    def start():
        try:
            refused.start()
        except RecordingError as exc:
            errors.append(str(exc))

    with record.recording(platform=fake):
        t = threading.Thread(target=start)
        t.start()
        t.join()
    assert errors and "already running" in errors[0]
    with pytest.raises(RecordingError, match="nothing was recorded"):
        refused.trace()


# -- a program's own recording or dispatch mode under kvverify record --------------------------


def test_a_program_that_leaves_its_own_recording_running_still_gets_an_exit_status(tmp_path, monkeypatch, capsys):
    """Was: ``kvverify record -- python prog.py`` where prog.py starts a recording of its own
    and exits (an error, sys.exit) before stopping it: the program's recording nests, and the
    CLI's ``rec.stop()`` is refused ("stop() the recording nested in this one first"). The
    RecordingError escapes ``cli.run``: no trace written, no verdict, a traceback and exit 1 (which
    the CLI documents as "races") instead of the program's status 3; the program's recording stays
    active with its dispatch mode on torch's stack and every hook installed. Before nesting, the
    program's own start was refused and the run ended normally."""
    import fake_cuda

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""\
        import fake_cuda
        import kvverify.record as record

        fake = fake_cuda.shared()
        rec = record.recording(platform=fake).start()  # its stop() is never reached
        fake.device(64).fill_(1)
        raise SystemExit(3)
        """))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    status = cli.run(parser.parse_args(["--", "python", str(prog)]), platform=fake_cuda.shared())
    assert status == 3
    assert (tmp_path / "kvverify-trace.json").exists()
    assert record.session._active is None


CONFTEST = textwrap.dedent("""\
    import fake_cuda
    import pytest
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    @pytest.fixture
    def kvverify_platform():
        return fake_cuda.shared()

    @pytest.fixture
    def counting():
        with Counting() as mode:  # a fixture of the program's own that enters a dispatch mode
            yield mode
    """)

TESTS = REFILL + textwrap.dedent("""\

    def test_a_safe_with_a_mode(counting):
        refill(64, True)

    def test_b_racy():
        refill(64, False)
    """)


def test_a_dispatch_mode_fixture_under_kvverify_record_pytest_does_not_break_the_next_tests(tmp_path, monkeypatch,
                                                                                             capsys):
    """Was: ``kvverify record -- pytest --kvverify-record`` where a SAFE test uses a fixture that
    enters a dispatch mode (set up after the recording, torn down after the test body). The plugin
    stops the test's recording after the body, while the fixture's mode is on top: ``stop`` (unlike
    ``_pause``) does not check that its mode is the top one, so it pops the fixture's mode and
    leaves its own; the outer resumes on top of that stale mode; the fixture's teardown then pops
    the outer's mode. From there on the outer records nothing, and every later test errors with
    "cannot start a recording ... a dispatch mode entered after it is still active
    (RecordingMode)": the racy test_b is never checked. Under plain ``pytest --kvverify-record``
    test_b fails with its race."""
    import fake_cuda

    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_nested_mode_fixture.py").write_text(TESTS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    xml = tmp_path / "out.xml"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    try:
        cli.run(parser.parse_args(["--", "pytest", "-q", "-p", "no:cacheprovider", "--kvverify-record",
                                   f"--junitxml={xml}", str(tmp_path)]), platform=fake_cuda.shared())
    finally:
        # the in-process pytest leaves its modules imported: another in-process run would collide with them
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", "") or "").startswith(str(tmp_path)):
                del sys.modules[name]
    capsys.readouterr()
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    bad = cases["test_b_racy"].find("failure")
    if bad is None:
        bad = cases["test_b_racy"].find("error")
    message = "" if bad is None else bad.get("message", "") + (bad.text or "")
    assert "cannot start a recording" not in message, message
    assert "races" in message
