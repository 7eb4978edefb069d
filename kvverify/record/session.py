"""A recording: start the hooks, run the program, stop, write the trace, check it.

``recording()`` is the Python entry point (``kvverify record`` and the pytest plugin use it too)::

    with kvverify.record.recording() as rec:
        run_my_offload_step()
    verdict = rec.check()          # kvverify.check.Verdict: .verdict "SAFE" / "RACY", .races
    rec.write("trace.json")

The annotation functions (``host_write``, ``host_read``, ``host_buffer``) tell the recorder what
the dispatcher cannot see; outside a recording they do nothing, so they can stay in production code.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
from collections.abc import Callable, Iterable

from kvverify.errors import RecordingError
from kvverify.record.capture.frames import Locator
from kvverify.record.capture.processes import ChildWatch
from kvverify.record.capture.threads import (
    NOT_RECORDED,
    OTHER_THREAD_WORK,
    ThreadCapture,
    unordered_sharing,
    waits_first,
)
from kvverify.record.trace.recorder import INSIDE, Recorder, busy
from kvverify.record.trace.writer import Summary, build
from kvverify.terms import DEVICE_SPACE, HOST_SPACE

_active: Recording | None = None
CAPTURE_OFF = "native capture off"
# What ``op_log=False`` trades, as both faces of the recorder say it (``kvverify record --no-op-log``,
# the pytest plugin's ``--kvverify-no-op-log``).
NO_OP_LOG_HELP = ("record ops by a dispatch mode as they run instead of the op log (C++, logged after the "
                  "program): the same trace, slower (docs/record.md)")
LATE_WORK = f"{NOT_RECORDED} (driver calls made after the last op the thread logged, as the recording stopped), thread"
UNWATCHED = (f"{NOT_RECORDED} (host bytes device work read or wrote while the host watch did not hold them: host "
             "accesses to them outside torch's dispatcher, while that work was pending, are not seen)")
BLIND_SPOTS = ("kernels launched outside torch's dispatcher (Triton, pybind11, JIT kernels), torch's device work "
               "outside ops, CUDA graph launches, and the device work of threads the recording does not follow")
_lock = threading.Lock()


def _set_active(rec: Recording | None) -> None:
    """``rec`` is the recording that records now; an op that a dispatch mode of a recording not
    recording now sees (a thread it followed, still running) is that one's missed work."""
    global _active
    from kvverify.record.capture import dispatch

    _active = rec
    dispatch.unfollowed = None if rec is None else rec._missed


def _enter(mode, depth: int | None) -> None:
    """Enter the dispatch ``mode`` at ``depth`` of this thread's stack (None: on top); the modes
    above that depth stay above it, in their order."""
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode_stack,
        _pop_mode,
        _push_mode,
    )

    above = []
    if depth is not None:
        while len(_get_current_dispatch_mode_stack()) > depth:
            above.append(_pop_mode())
    try:
        mode.__enter__()
    finally:
        for m in reversed(above):
            _push_mode(m)


def _leave(mode) -> None:
    """Leave the dispatch ``mode`` where it lies on this thread's stack: modes the program entered
    after it stay, in their order (leaving a mode pops the top of the stack, whichever mode that
    is). Raises RecordingError where the mode is not on the stack."""
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode,
        _pop_mode,
        _push_mode,
    )

    if _get_current_dispatch_mode() is mode:
        mode.__exit__(None, None, None)
        return
    above = []
    try:
        while (top := _get_current_dispatch_mode()) is not mode:
            if top is None:
                raise RecordingError("the recording's dispatch mode is no longer on this thread's stack: the program "
                                     "left it (a mode's __exit__ out of order)")
            above.append(_pop_mode())
        _pop_mode()
        # what its __enter__ kept to restore at its __exit__; the modes above keep the process's flags set
        for name in ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                     "old_without_ignore_compile_internals_dispatch_mode_flags"):
            kept = getattr(mode, name, None)
            if kept:
                kept.pop()
    finally:
        for m in reversed(above):
            _push_mode(m)


class Recording:
    """One recording of the current thread's device work (see ``recording``).

    Use it as a context manager, or call ``start()`` and ``stop()``. After ``stop()``:
    ``trace()`` (a trace-format dict), ``summary()``, ``check()`` (a ``kvverify.check.Verdict``),
    ``write(path)``, ``report()`` (the verdict and the summary as text).
    """

    def __init__(self, *, swap_ops: Iterable[str] = (), keep_all: bool = False, platform=None,
                 skip: Iterable[str] | None = None, native: bool = True, op_log: bool = True) -> None:
        self.swap_ops = tuple(swap_ops)
        self.native = native
        self.op_log = op_log
        self._replayer = None  # kvverify.record.capture.oplog.Replayer, where the platform has an op log
        self._logging = False  # the op log, not the dispatch mode, captures this thread's ops now
        self.capture_off: str | None = None
        self.keep_all = keep_all
        self._platform = platform
        self._skip = skip
        self.recorder: Recorder | None = None
        self._mode = None
        self._mode_entered = False
        self._froze = False
        self._bindings = self._threads = None
        self._outer: Recording | None = None
        self._first_pause: str | None = None
        self._pauses = 0
        self._depth: int | None = None  # the mode's place on the stack of dispatch modes when it paused
        self._built: tuple[dict, Summary] | None = None
        self._verdict = None
        self._covered: list[tuple[int, int]] = []  # host bytes the host watch held (across pauses)
        self._watch_losses: dict[str, int] = {}
        self._children = ChildWatch()
        self.running = False

    # -- lifetime ----------------------------------------------------------------------------

    def start(self) -> Recording:
        """Start recording this thread. A recording started on the thread of one already running
        nests: the outer one pauses until this one stops (see ``recording``). Raises
        RecordingError when there is no CUDA device, this torch lacks the hooks, or a recording
        runs on another thread; whatever the error, nothing stays installed and a paused outer
        recording goes on."""
        with _lock:
            outer = _active
            if outer is not None and outer.thread != threading.get_ident():
                raise RecordingError(
                    f"a recording is already running in this process, on thread {outer.thread}: stop it first, or "
                    "start this one on that thread (a recording nests only on the thread of the one it pauses)")
            platform = self._platform
            if platform is None:
                from kvverify.device.extension import cuda_refusal

                reason = cuda_refusal()  # before the hooks' import, which needs torch
                if reason is not None:
                    raise RecordingError(f"nothing to record: {reason}")
            from kvverify.record.capture import hooks

            if platform is None:
                platform = hooks.CudaPlatform()
            if outer is not None:
                try:
                    outer._pause()
                except BaseException:
                    outer._resume()  # what the pause took away goes back; the error is this start's
                    raise
            try:
                self._platform_in_use = platform
                self._locator = Locator(self._skip)
                self.recorder = Recorder(self._locator.locate)
                self.thread = threading.get_ident()
                self._attach(fresh=True)
            except BaseException:
                self.recorder = None  # nothing was recorded
                if outer is not None:
                    outer._resume()
                raise
            self._outer = outer
            self._built = self._verdict = None
            self._covered, self._watch_losses = [], {}
            self.running = True
            self._children.start()
            _set_active(self)
        return self

    def _attach(self, fresh: bool) -> None:
        """Install the capture on this thread: made anew at a start (``fresh``), the same again
        where a recording nested in this one stopped. On an error, what it installed is taken
        away again before the error is raised."""
        from kvverify.record.capture import hooks
        from kvverify.record.capture.bindings import Bindings
        from kvverify.record.capture.dispatch import RecordingMode
        from kvverify.record.capture.driver import DriverOps
        from kvverify.record.capture.oplog import KINDS, Replayer

        platform = self._platform_in_use
        try:
            if fresh:
                self._mode = RecordingMode(self.recorder, platform, self.swap_ops, internal=self.internal)
                self._oplog_kinds = KINDS
                if self.op_log:
                    self._replayer = Replayer(self._mode, self._locator.locate_frames, self._locator.library_code)
            guard = hooks.thread_guard(self.recorder, busy, self._replayer, platform.last_call)
            platform.install(self.recorder, guard, native=self.native)
            if fresh:
                if self._replayer is not None:
                    self._replayer.log = platform.op_log()  # (the platform's native log is made by install)
                self._driver = DriverOps(self.recorder, self._mode, platform.handle_key,
                                         self._locator.locate_frames, platform.function_name,
                                         self._locator.locate_text)
                self._threads = ThreadCapture(self.recorder, self._enter_thread, self._go_live)
                self._bindings = Bindings(self._driver, self._follows, self._missed, platform.suppressed,
                                          platform.host_watch)
            self._mode.active = True
            self._capture_ops(None if fresh else self._depth)
            self.capture_off = getattr(platform, "capture_off", None)
            self.recorder.native = self._native
            if self.capture_off is None:
                platform.on_launch(guard(self._driver.launch_site))
                platform.on_graph_replay(guard(self._driver.graph_site))
            self._threads.start()
            self._bindings.install()
            # The log grows by a few objects per op, and the collector's full passes would walk
            # the whole heap (torch's included, hundreds of thousands of objects) over and over:
            # what existed before the recording is left out of them until it stops. A program that
            # froze its own objects already (a server after start-up) keeps them so: unfreeze()
            # would give it back every one of them, so the recording then freezes nothing.
            self._froze = gc.get_freeze_count() == 0
            if self._froze:
                gc.freeze()
        except BaseException:
            with contextlib.suppress(Exception):  # the error that stopped the start is the one to see
                self._detach()
            raise

    def _capture_ops(self, depth: int | None) -> None:
        """Capture this thread's ops: with the op log where it can (the platform has one, this is
        the only thread the recording follows, no witness run forces ops), else with the dispatch
        mode, entered at ``depth`` of the stack of dispatch modes (None: on top)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        replayer = self._replayer
        if (replayer is not None and replayer.log is not None and self._mode.forcer is None
                and len(self.recorder.followed) == 1
                and replayer.start(threading.get_ident(), None if depth is None else replayer.below) is None):
            self._logging = True
            if depth is None:  # where the mode goes if it takes over (after a pause: where it was, kept)
                self._depth = len(_get_current_dispatch_mode_stack())
            return
        _enter(self._mode, depth)
        self._mode_entered = True

    def _go_live(self) -> None:
        """The dispatch mode takes over from the op log (a second thread is about to be followed, a
        witness run forces ops): what the log holds is logged first."""
        if not self._logging:
            return
        self._logging = False
        self._replayer.stop()
        with self.recorder.exclusive():
            self.recorder.collect()
        _enter(self._mode, self._depth)
        self._mode_entered = True

    def _native(self, record) -> None:
        """A record of the native log that is not the allocator's: the op log's, or a driver call's."""
        if record.kind in self._oplog_kinds:
            self._replayer.replay(record)
        elif self.capture_off is None:
            self._driver.record(record)

    def _detach(self) -> None:
        """Take away what ``_attach`` installed (at the stop, and where a nested recording
        starts): every part, even where an earlier one fails; then raises the first error."""
        errors: list[BaseException] = []

        def step(call: Callable[[], object]) -> None:
            try:
                call()
            except Exception as exc:
                errors.append(exc)

        logged = self._logging
        if logged:
            self._logging = False
            step(self._replayer.stop)
        if self._mode_entered or logged:
            step(self._collect_leftover)
        watch = self._platform_in_use.host_watch
        if watch is not None:  # (what it covered, before it stops and forgets)
            step(lambda: self._keep_coverage(watch))
        if self._bindings is not None:
            step(self._bindings.uninstall)
        if self._threads is not None:
            step(self._threads.stop)
        if self._mode is not None:
            self._mode.active = False  # the modes of threads still running record nothing more
        if self._mode_entered:
            self._mode_entered = False
            step(lambda: _leave(self._mode))
        if self._froze:
            self._froze = False
            gc.unfreeze()
        step(self._platform_in_use.uninstall)
        if errors:
            raise errors[0]

    def _keep_coverage(self, watch) -> None:
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(self._covered + watch.covered()):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self._covered = merged
        for what, n in watch.losses().items():
            self._watch_losses[what] = self._watch_losses.get(what, 0) + n

    def _pause(self) -> None:
        """A recording nested in this one starts: record nothing until it stops. What runs
        meanwhile is in its trace, not this one's: the summary counts the pauses as work not
        recorded, and the trace orders everything before a pause before everything after it
        (``Recorder.unseen``), so that no pair across it is decided either way; memory is learnt
        again after it (the program may have freed and reallocated any)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        rec = self.recorder
        at = rec.locate()
        # where the mode goes back at the resume: under the modes the program enters meanwhile,
        # which it leaves after the resume by popping the top of the stack
        if not self._logging:  # (the op log's place is kept from its start)
            self._depth = next((k for k, m in enumerate(_get_current_dispatch_mode_stack()) if m is self._mode), None)
        self._detach()
        self._pauses += 1
        self._first_pause = self._first_pause or at
        with rec.exclusive():
            rec.notes[f"{NOT_RECORDED} (recordings nested in this one, the first at {self._first_pause}: what ran "
                      "while each ran is in its own trace; nothing across one is decided)"] += 1

    def _resume(self) -> None:
        """The recording nested in this one stopped: go on recording. Where the capture cannot be
        installed again, this recording ends here (its summary says so, and a recording it paused
        goes on in its place) and the error is raised."""
        rec = self.recorder
        with rec.exclusive():
            rec.unseen(f"the end of pause {self._pauses} (a recording nested in this one)", rec.locate())
            rec.memory.forget_all()
        try:
            self._attach(fresh=False)
        except BaseException as exc:
            with rec.exclusive():
                rec.notes[f"{NOT_RECORDED} (the recording could not go on after a recording nested in it stopped, "
                          f"and ended there: {type(exc).__name__}: {exc})"] += 1
            self.running = False
            self._end_children()
            _set_active(self._outer)
            if self._outer is not None:
                self._outer._resume()
            raise

    def stop(self) -> None:
        """Stop recording (idempotent); recordings nested in this one and still running (a program
        that ended without stopping its own) are stopped first, and a recording this one paused
        goes on. Raises RecordingError on another thread than the one that started it (torch's
        dispatch modes are per thread: only that one can leave it); an error of the capture's
        removal is raised after everything was removed."""
        if not self.running:
            return
        if threading.get_ident() != self.thread:
            raise RecordingError(f"stop() the recording on the thread that started it ({self.thread}), not on this "
                                 f"one ({threading.get_ident()}): the recording is still running")
        while _active is not None and _active is not self and self in _active._outers():
            _active.stop()
        if not self.running:  # (its resume failed: it ended there)
            return
        with _lock:
            try:
                self._detach()
            finally:
                self.running = False
                self._end_children()
                _set_active(self._outer)
                if self._outer is not None:
                    self._outer._resume()

    def abandon(self) -> None:
        """The process ends without ``stop()`` (``kvverify.record.ends``: on a thread that cannot
        stop it): remove what would outlive the process, the child processes' marker folder
        (``kvverify.record.capture.processes``)."""
        self._children.stop()

    def _end_children(self) -> None:
        """The recording ends: the child processes that used CUDA while it ran are work it missed
        (``kvverify.record.capture.processes``); the environment is the program's again."""
        lines = self._children.stop()
        with self.recorder.exclusive():
            self.recorder.notes.update(lines)

    def settled(self) -> bool:
        """Whether ``stop()`` can be called where this thread is now: not inside the recorder's own
        code (its log may be half written there), nor an op it has yet to log, nor its dispatch
        mode's handler (torch takes the mode off the stack meanwhile, where the stop could not
        leave it). A stop made where the thread was interrupted (a signal handler:
        ``kvverify.record.ends``) waits for this."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        if busy() or self.recorder.in_op():
            return False
        return not self._mode_entered or any(m is self._mode for m in _get_current_dispatch_mode_stack())

    def _outers(self) -> list[Recording]:
        """The recordings this one paused, innermost first."""
        out, rec = [], self._outer
        while rec is not None:
            out.append(rec)
            rec = rec._outer
        return out

    def _collect_leftover(self) -> None:
        """The native log's records still there as the recording stops: this thread's are logged;
        those of threads the recording never followed are its missed work, and so are the driver
        calls a followed thread made after the last op it logged (its frees then change nothing)."""
        rec = self.recorder
        with rec.exclusive():
            rec.collect()
            for (ident, kind), n in self._platform_in_use.native_leftover().items():
                thread = threading._active.get(ident)
                name = thread.name if thread is not None else f"ident {ident:#x}, ended"
                if ident not in rec.followed:
                    rec.notes[f"{OTHER_THREAD_WORK} torch's allocator and driver calls from thread {name!r}"] += n
                elif kind not in ("alloc", "free"):
                    rec.notes[f"{LATE_WORK} {name!r}"] += n

    def __enter__(self) -> Recording:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @contextlib.contextmanager
    def internal(self):
        """Work of the recorder itself on this thread: the hooks report nothing meanwhile, and
        what the allocator reports meanwhile (the read-back's own blocks) is dropped."""
        rec = self.recorder
        rec.collect()
        INSIDE.depth += 1
        logging = self._logging
        if logging:
            self._replayer.quiet(1)  # its own ops (a read-back) are not the program's
        watch = self._platform_in_use.host_watch
        try:
            with watch.internal() if watch is not None else contextlib.nullcontext():  # (nor its touches)
                yield
        finally:
            if logging:
                self._replayer.quiet(-1)
            rec.take(threading.get_ident())
            INSIDE.depth -= 1

    def follow_calls(self, forcer) -> None:
        """Count each op's calls at its line into what it logs (the dispatcher's ops, cuda-python's
        copies, ``os.preadv``), and in a witness run force the pair of a race
        (``kvverify.record.confirm.witness.Forcer``). Call right after ``start()``: the threads the program
        starts later share it."""
        self._mode.forcer = self._bindings.forcer = forcer
        self._go_live()

    def witness_tools(self):
        """The device side of a witness run on this recording's platform."""
        return self._platform_in_use.witness_tools(self.internal)

    def _follows(self) -> bool:
        """Whether this thread's work is recorded now."""
        return self._mode.active and threading.get_ident() in self.recorder.threads and not busy()

    def _missed(self, what: str) -> None:
        with self.recorder.exclusive():
            self.recorder.notes[f"{OTHER_THREAD_WORK} {what} from thread {threading.current_thread().name!r}"] += 1

    def _enter_thread(self):
        """In a thread the program started while recording, before its ``run()``: record its ops
        with a dispatch mode of its own (modes are per thread); returns what its end calls."""
        mode = self._mode.fork()
        mode.__enter__()
        watch = self._platform_in_use.host_watch
        if watch is not None:  # (another thread may touch host memory now: touches are single-stepped)
            watch.threads(threading.active_count())

        def end() -> None:
            mode.__exit__(None, None, None)
            if watch is not None and watch.running:
                watch.threads(threading.active_count() - 1)  # (this thread still counts as active here)

        return end

    # -- results -----------------------------------------------------------------------------

    def _results(self) -> tuple[dict, Summary]:
        if self.recorder is None:
            raise RecordingError("nothing was recorded: start() the recording first")
        if self.running:
            raise RecordingError("the recording is still running: stop() it (or leave its with-block) first")
        if self._built is None:
            waits_first(self.recorder.ops)  # (before the writer reads the log)
            doc, summary = build(self.recorder, keep_all=self.keep_all)
            summary.notes += [f"{what}: {n}" for what, n in sorted(self.recorder.notes.items())]
            summary.notes += self._threads.lines()
            if self.capture_off is not None:
                summary.notes.append(f"{CAPTURE_OFF} ({self.capture_off}); not seen: {BLIND_SPOTS}")
            unordered, example = unordered_sharing(self.recorder.ops)
            if unordered:
                summary.notes.append(f"{NOT_RECORDED} (ops of two threads on one stream or event with no host "
                                     f"ordering between them, whose calls overlapped in time or were not timed: "
                                     f"the driver may have seen them the other way round; the first: {example}): "
                                     f"{unordered}")
            summary.notes += self._unwatched_notes()
            if self.recorder.memory.overruns:
                # their placeholder shares no bytes with the allocation they run into: a race there is not decided
                summary.notes.append(f"{NOT_RECORDED} (ranges that run past the allocation they start in, listed "
                                     f"above; races on their bytes are not decided): {self.recorder.memory.overruns}")
            self._built = (doc, summary)
        return self._built

    def _unwatched_notes(self) -> list[str]:
        """NOT RECORDED lines for host bytes device work touched that the host watch did not hold
        while the work was pending (host accesses to them outside the dispatcher are not seen),
        and for what the watch lost; nothing on a platform whose device work completes at its call."""
        from kvverify.record.capture.watch import unwatched

        platform = self._platform_in_use
        if platform.watch_off is None and platform.host_watch is None:
            return []
        covered = self._covered if platform.watch_off is None else None
        count, first = unwatched(self.recorder.ops, self.recorder.memory, covered)
        notes = []
        if count:
            why = f"host watch off: {platform.watch_off}" if platform.watch_off is not None else "not watched"
            notes.append(f"{UNWATCHED} ({why}; the first: {first}): {count}")
        notes += [f"{NOT_RECORDED} (host watch: {what}): {n}" for what, n in self._watch_losses.items()]
        return notes

    def trace(self) -> dict:
        """The trace (format version 1, ``docs/trace-format.md``) as a JSON-ready dict."""
        return self._results()[0]

    def summary(self) -> Summary:
        return self._results()[1]

    def check(self):
        """Decide the trace with ``kvverify.check``; returns its ``Verdict`` (``.verdict``,
        ``.races``, ``.render()``)."""
        if self._verdict is None:
            from kvverify.check import check

            self._verdict = check(self.trace())
        return self._verdict

    def write(self, path: str | os.PathLike) -> None:
        """Write the trace as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.trace(), f, indent=1)
            f.write("\n")

    def complete(self) -> bool:
        """False when the recording missed device work it knows of (the summary names it): an op
        the recorder failed on, device work or host accesses of another thread, a child process
        that used CUDA. A SAFE verdict then covers only what was recorded."""
        return not any(note.startswith(NOT_RECORDED) for note in self.summary().notes)

    def report(self, source: str | None = None) -> str:
        """The checker's report of the trace, then the summary of the recording."""
        text = self.check().render(source=source)
        return text.rstrip("\n") + "\n\n" + "\n".join(self.summary().lines()) + "\n"


def recording(*, swap_ops: Iterable[str] = (), keep_all: bool = False, platform=None,
              skip: Iterable[str] | None = None, native: bool = True, op_log: bool = True) -> Recording:
    """A recording of what the current thread asks the CUDA device to do, as a trace.

    ``swap_ops``: qualified names (``"ns::name"``) of batched-swap ops with the schema of
    ``kvverify::swap_blocks_batch`` under another name (a serving engine's own).
    ``keep_all``: write kernels' accesses to every buffer (default: not to buffers only kernels of one
    stream touch, which cannot race; written are buffers a copy touches, those kernels of two streams touch,
    or both the host and the device). ``platform``: the device layer (default: the CUDA device
    through torch; tests pass a stand-in). ``skip``: folders whose frames are library code when
    locating ops (default: torch and kvverify's recorder and op wrappers). ``native``: capture
    the driver calls of every thread through CUPTI too (``kvverify.record.capture.native``; False: the
    dispatcher-level capture alone, as under another CUPTI subscriber). ``op_log``: write the ops
    of the recording thread down in C++ as they are called and log them after the program
    (``kvverify.record.capture.oplog``), for as long as it is the only thread followed and no
    witness run forces ops (False: a dispatch mode logs each op as it runs, at a Python call per op).

    Use as ``with recording() as rec: ...``; starting raises RecordingError where no CUDA device
    is visible, torch's allocator does not report to kvverify's native log (another allocator),
    or a recording runs on another thread. Started on the thread of a running recording (a test
    that records itself, run under ``kvverify record -- pytest``), it nests: the outer one pauses
    until the inner one stops, and its summary names each pause as work it did not record
    (nothing across a pause is decided; its verdict cannot be SAFE for the whole run).
    """
    return Recording(swap_ops=swap_ops, keep_all=keep_all, platform=platform, skip=skip, native=native,
                     op_log=op_log)


# -- annotations ---------------------------------------------------------------------------------


def _current(what: str = "") -> Recording | None:
    """The recording of this thread; None outside one. An annotation (``what``) made on another
    thread while one runs is noted as missed: the trace cannot place it."""
    rec = _active
    if rec is None or not rec.running:
        return None
    if threading.get_ident() not in rec.recorder.threads:
        if what:
            with rec.recorder.exclusive():
                rec.recorder.notes[f"{OTHER_THREAD_WORK} {what} from thread {threading.current_thread().name!r}"] += 1
        return None
    rec.recorder.collect()  # what the native log holds of this thread happened before the annotation
    return rec


def _address_range(obj) -> tuple[int, int]:
    """``(address, bytes)`` of a numpy array, a buffer, an ``(address, bytes)`` pair or a
    ``kvverify.device.host_memory.HostBuffer``."""
    if isinstance(obj, tuple) and len(obj) == 2:
        return int(obj[0]), int(obj[1])
    if hasattr(obj, "ptr") and hasattr(obj, "nbytes"):
        return int(obj.ptr), int(obj.nbytes)
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:
        return int(interface["data"][0]), int(obj.nbytes)
    raise TypeError(f"cannot tell the bytes of a {type(obj).__name__}: pass a tensor, a numpy array, a HostBuffer "
                    "or an (address, bytes) pair")


def _spans(rec: Recording, objs: tuple, at: str | None, device: bool = False) -> list:
    """The spans of ``objs`` (see ``host_write``); ``device``: CUDA tensors are allowed too."""
    out = []
    for obj in objs:
        if hasattr(obj, "untyped_storage"):  # a tensor
            where = rec._platform_in_use.where(obj)
            if where is None or (where == "device" and not device):
                raise ValueError(f"host_write / host_read take host memory; this tensor is on {obj.device}")
            span = rec._mode.span(obj, where, at)
            if span is not None:
                out.append(span)
            continue
        address, nbytes = _address_range(obj)
        if nbytes > 0:
            out.append(rec._mode.host_span(address, nbytes, at))
    return out


def _annotate(what: str, name: str, log: Callable[[Recording, str | None], None]) -> None:
    """Log an annotation of this thread's recording with ``log(recording, at)``; a witness run
    finds it again by ``name`` as it does an op."""
    rec = _current(f"kvverify.record.{what}")
    if rec is None:
        return
    forcer = rec._mode.forcer
    issued = None if forcer is None else forcer.before(name)
    at = rec.recorder.locate()
    with rec.recorder.exclusive():
        rec.recorder.collect()  # the memory map as of now: what the program did before is logged first
        log(rec, at)
    if issued is not None:
        forcer.after(issued)


def _host_access(kind: str, objs: tuple, name: str | None) -> None:
    _annotate(kind, name or kind, lambda rec, at: rec.recorder.host_access(kind, _spans(rec, objs, at), name, at))


def host_write(*objs, name: str | None = None) -> None:
    """The host thread writes these bytes now (numpy, ``preadv`` into a pinned buffer, a ctypes
    memmove: writes the dispatcher cannot see).

    ``objs``: CPU tensors, numpy arrays, ``HostBuffer`` objects or ``(address, bytes)`` pairs;
    memory the recording does not know yet becomes a pageable host buffer (declare pinned memory
    first with ``host_buffer``). Outside a recording (or on another thread): does nothing.
    Raises ValueError for a CUDA tensor, TypeError for an object whose bytes cannot be told.
    """
    _host_access("host_write", objs, name)


def host_read(*objs, name: str | None = None) -> None:
    """The host thread reads these bytes now (e.g. a D2H destination consumed by numpy). As
    ``host_write``."""
    _host_access("host_read", objs, name)


def _release(what: str, objs: tuple, name: str | None) -> None:
    _annotate(what, name or what, lambda rec, at: rec.recorder.released(
        _spans(rec, objs, at, device=True), name or what, at, after="reused" if what == "reuse" else None))


def free(*objs, name: str | None = None) -> None:
    """These bytes are released now, with no ordering of their own (trace format 1.2 ``free``):
    device work on them that is not ordered before this point races with it, kind ``FREE`` (use
    after free). For memory the recorder cannot see released: a pool of the program's own that
    frees a slot, an unmap, a raw free.

    ``objs``: tensors (CPU or CUDA; views name exactly their elements' span), numpy arrays,
    ``HostBuffer`` objects or ``(address, bytes)`` pairs. Outside a recording: does nothing. Raises
    TypeError for an object whose bytes cannot be told.
    """
    _release("free", objs, name)


def reuse(*objs, name: str | None = None) -> None:
    """A pool of the program's own hands these bytes to a new owner now (a KV block given to another
    request, a host slot to another backup): written as ``free`` (see there), so that the old
    owner's device work not ordered before the hand-over races with it, as with the new owner's
    accesses after it. Call it where the pool hands the block out. As ``free`` otherwise."""
    _release("reuse", objs, name)


@contextlib.contextmanager
def kernel(*, reads=(), writes=(), reads_through=None, writes_through=None, name: str | None = None):
    """Declare what the kernels this thread launches inside the ``with`` block read and write,
    where torch's dispatcher does not see them (a Triton kernel, a pybind11 extension's): native
    capture then writes each such launch with these accesses, not with the whole of every
    allocation its arguments point into (the default: a report too many, never a race missed).

    ``reads`` / ``writes``: tensors (CUDA or pinned; views name exactly their span), numpy arrays
    or ``(address, bytes)`` pairs. ``reads_through`` / ``writes_through``: ``(table, nbytes)``, a
    table of pointers (an int64 tensor, on the device when a host copy the recording saw filled
    it) and the bytes each pointed-to block holds: a copy kernel's source and destination tables,
    ``kernel(reads_through=(src_ptrs, block_bytes), writes_through=(dst_ptrs, block_bytes))``.
    ``name``: the kernels' name in the trace. Outside a recording: does nothing. A wrong
    declaration hides races: declare what the kernel can touch, not what it usually touches.
    Raises TypeError for an object whose bytes cannot be told.
    """
    rec = _current("kvverify.record.kernel")
    if rec is None:
        yield
        return
    at = rec.recorder.locate(3)
    with rec.recorder.exclusive():
        rec.recorder.collect()
        declared = (_spans(rec, reads, at, device=True) + _through(rec, reads_through, at),
                    _spans(rec, writes, at, device=True) + _through(rec, writes_through, at), name)
    outer = rec._driver.declare(declared)
    try:
        yield
    finally:
        rec.recorder.collect()  # the launches inside are taken while the declaration holds
        rec._driver.declare(outer)  # an enclosing kernel(...)'s holds again


def _through(rec: Recording, table, at: str | None) -> list:
    """The spans a table of pointers names (see ``kernel``)."""
    if table is None:
        return []
    import numpy as np

    pointers, nbytes = table
    values = rec._mode.values(pointers)
    if values is None:
        raise TypeError("a declared pointer table must be a tensor that holds memory, not a meta or fake tensor")
    addresses = values.astype(np.int64, copy=False)
    if not len(addresses):
        return []
    lengths = np.full(len(addresses), int(nbytes), dtype=np.int64)
    index, offset = rec._mode.resolve(addresses, lengths, "a declared pointer table", at)
    return [(i, o, int(nbytes)) for i, o in zip(index.tolist(), offset.tolist())]


def host_buffer(obj, kind: str = "pinned", *, name: str | None = None) -> None:
    """Declare memory the recorder cannot learn of by itself (allocated by ctypes, another
    library's ``cudaHostAlloc``), so that swaps into it resolve to a named buffer.

    ``obj`` as for ``host_write``; ``kind``: ``"pinned"``, ``"registered"``, ``"pageable"`` (host
    memory kinds, ``kvverify.terms.HOST_MEMORY_KINDS``) or ``"device"``; ``name``: the buffer's
    name in the trace. Outside a recording: does nothing. Raises ValueError for an unknown kind.
    """
    space = DEVICE_SPACE if kind == "device" else HOST_SPACE.get(kind)
    if space is None:
        raise ValueError(f"unknown memory kind {kind!r}; use one of {', '.join([*HOST_SPACE, 'device'])}")
    rec = _current("kvverify.record.host_buffer")
    if rec is None:
        return
    if hasattr(obj, "untyped_storage"):
        storage = obj.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
    else:
        address, nbytes = _address_range(obj)
    at = rec.recorder.locate()
    with rec.recorder.exclusive():
        rec.recorder.collect()
        rec.recorder.memory.fresh(address, nbytes, space, "declared with host_buffer", at, name)
