"""Ends of a program recorded by ``kvverify record`` that never return to it: ``os._exit`` (how
multiprocessing's children end, and some servers) and SIGTERM (a service manager's or a CI
runner's stop). Either would end the process with the recording still running: no verdict, no
trace, and the status the program chose, 0 included, which a CI job reads as SAFE.

``HardEnds`` catches both in the process that started the recording (a child forked from it ends
as it asks, untouched): the recording is stopped, the command's own end runs (the trace, the
report, ``--json``, the exit status) and the process exits with the status that end gives. What
no process can catch in itself (SIGKILL, a fatal signal in native code) is not covered
(docs/record.md, "How a recorded program may end").
"""

from __future__ import annotations

import contextlib
import operator
import os
import posix
import signal
import sys
import threading
from collections.abc import Callable

from kvverify.record.capture.frames import Locator

NOT_RUN = "what it would have run after that point did not run and is not recorded"


class HardEnds:
    """While installed (``install`` to ``remove``): ``os._exit`` (and ``posix._exit``, the same
    function) and, where its disposition was the default, SIGTERM end the recording ``rec``
    before the process ends.

    ``finish(status, signum=None, how=None)``: the command's end after the recording stopped
    (writes the trace, prints the report, returns the exit status); ``status``: the program's own
    (``os._exit``'s), ``signum``: the signal that ended it, ``how``: how it ended (``os._exit(N)``,
    ``SIGTERM``). ``no_verdict(line)``: prints ``line`` as the only verdict and returns 2, for an
    end where the recording cannot be stopped.
    """

    def __init__(self, rec, finish: Callable[..., int], no_verdict: Callable[[str], int]) -> None:
        """Made before ``rec`` starts; installed after."""
        self._rec = rec
        self._finish = finish
        self._no_verdict = no_verdict
        self._pid = os.getpid()
        self._real_exit = os._exit
        self._os_exit = self._exit_called  # (one bound method: ``remove`` knows its own by identity)
        self._locator = Locator()
        self._sigterm = False
        # Held by the thread that ends the process, for good: another thread's end waits on it
        # while the first one's report is written; reentrant for a signal handler run inside it.
        # Bound before the recording starts, which observes the lock types: the recorder's own.
        self._acquire = threading.RLock().acquire
        self._ending = False

    def install(self) -> None:
        """Take over ``os._exit``, and SIGTERM where the program would die of it silently (its
        default) and this is the recording's thread, the main one (a Python signal handler runs
        on the main thread only); a handler installed before is left alone."""
        os._exit = posix._exit = self._os_exit
        if (threading.current_thread() is threading.main_thread() and threading.get_ident() == self._rec.thread
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm = True

    def remove(self) -> None:
        """Put back what ``install`` replaced, where the program has not replaced it since (on the
        thread that installed it, as the recording stops)."""
        for module in (os, posix):
            if module._exit is self._os_exit:
                module._exit = self._real_exit
        self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        """SIGTERM's default again, where ``install`` took it (on the main thread, where this is
        called then) and the program has not replaced the handler since."""
        if self._sigterm and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._sigterm = False

    def _exit_called(self, status, /):
        """``os._exit(status)`` while installed."""
        if os.getpid() != self._pid:  # a forked child, which ends as it asked
            self._real_exit(status)
        code = operator.index(status)  # (a status os._exit refuses raises its TypeError, with its message)
        at = self._locator.frame_at(sys._getframe(1))
        how = f"os._exit({code})"
        if not self._begin():  # (a finalizer run by the report, on the thread already ending)
            self._real_exit(code)
        if threading.get_ident() != self._rec.thread:
            thread = threading.current_thread().name
            self._rec.abandon()
            self._leave(self._no_verdict(
                f"NOT RECORDED: the program ended by {how} at {at} on thread {thread!r}, where the recording "
                "cannot be stopped (only on the thread that started it: torch's dispatch modes are per thread): "
                f"no trace, no verdict; {NOT_RUN}. End the program from its main thread to have them"))
        self._end(f"the program ended by {how} at {at}", lambda: self._finish(code, how=how), failed=2)

    def _on_sigterm(self, signum: int, frame) -> None:
        """The SIGTERM handler: the recording ends where the main thread was, as soon as it is
        settled (``Recording.settled``: not inside the recorder's own code), which it is but for
        the few steps the recorder takes per op."""
        if os.getpid() != self._pid:  # a forked child: the default, death
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        stack = []
        while frame is not None:
            stack.append((frame.f_code, frame.f_lineno))
            frame = frame.f_back
        at = self._locator.locate_frames(stack) or "an unknown line"

        def end() -> None:
            if self._begin():
                self._end(f"the program was ended by {name} at {at} (where its main thread was)",
                          lambda: self._finish(0, signum=signum, how=name), failed=128 + signum)

        if self._rec.settled():
            end()
            return

        def watch(frame, event, arg) -> None:
            if self._rec.settled():
                sys.setprofile(None)
                end()

        sys.setprofile(watch)  # (a profile function runs at every call and return of this thread)

    def _begin(self) -> bool:
        """Whether this end is the first: it goes on, and holds the lock until the process exits
        (another thread's end waits for that). False on the thread already ending."""
        self._acquire()
        if self._ending:
            return False
        self._ending = True
        return True

    def _end(self, line: str, finish: Callable[[], int], failed: int) -> None:
        """Stop the recording, run ``finish`` and exit with the status it returns (``failed`` where
        it cannot finish: never 0)."""
        # A second SIGTERM meanwhile kills as it would have; os._exit stays taken: another thread's
        # call waits for this end instead of ending the process with its own status, 0 maybe.
        self._restore_sigterm()
        print(f"kvverify record: {line}; {NOT_RUN}", file=sys.stderr, flush=True)
        try:
            self._rec.stop()
            status = finish()
        except BaseException as exc:  # (any: the process ends here, and not with the program's status)
            print(f"kvverify record: the recording could not be finished: {type(exc).__name__}: {exc}: no "
                  f"verdict; exit status {failed}. Report this to kvverify's maintainers with the command",
                  file=sys.stderr)
            status = failed
        self._leave(status)

    def _leave(self, status: int) -> None:
        """Exit the process now with ``status``, its output written out first (``os._exit``
        writes out nothing)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # (a closed output must not keep the status from the shell)
                stream.flush()
        self._real_exit(status)
