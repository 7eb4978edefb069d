"""What the recording cannot see: device work issued by threads other than the recording one.

The dispatch mode that records ops is per thread (torch keeps modes in thread-local state), and so
are the recorder's hooks. A worker thread's transfers would be missing from the trace, and a trace
that misses work must not be called SAFE. ``OtherThreads`` makes such work visible as *missed*:

- threads started while the recording runs get a pass-through dispatch mode (through
  ``threading.setprofile``, which runs a function in each new thread before its ``run()``) that
  notes every op on CUDA tensors and every op of kvverify's library they dispatch;
- torch's GPU-trace callbacks from any other thread are noted by the hooks' guard
  (``kvverify.record.hooks.thread_guard``);
- threads already running when the recording started are named in the summary: the dispatcher
  work they do is seen by neither (native capture is what sees it).

Each note starts with ``NOT_RECORDED``: ``Recording.complete()`` is then false, and ``kvverify
record`` exits 2 rather than call the rest SAFE.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter

NOT_RECORDED = "NOT RECORDED"
OTHER_THREAD_WORK = (f"{NOT_RECORDED} (device work of another thread; record from the thread that issues it, "
                     "or see docs/record.md):")


class OtherThreads:
    """Watches the threads beside ``recording_thread`` while it records; notes go to ``notes``;
    ``where`` tells device tensors (``kvverify.record.dispatch.Platform.where``)."""

    def __init__(self, notes: Counter, recording_thread: int, where) -> None:
        self.notes = notes
        self.recording_thread = recording_thread
        self.where = where  # the platform's: "device", "host" or None for a tensor
        self.active = False
        self._previous = None
        self.running_before: list[str] = []

    def start(self) -> None:
        """Begin watching: name the threads running now, hook the threads started from now on."""
        self.running_before = sorted(t.name for t in threading.enumerate()
                                     if t.ident != self.recording_thread and t.is_alive())
        self._previous = threading.getprofile()
        threading.setprofile(self._enter)
        self.active = True

    def stop(self) -> None:
        """Stop watching (threads started meanwhile keep a mode that does nothing from now on)."""
        self.active = False
        threading.setprofile(self._previous)

    def lines(self) -> list[str]:
        """What the summary says of threads this recording did not see."""
        if not self.running_before:
            return []
        return [f"threads running beside the recording one when it started, whose dispatcher work is not seen: "
                f"{', '.join(self.running_before)}"]

    def _enter(self, frame, event, arg):
        # runs once, in the new thread, before its run(): hand the profiler back, then watch
        sys.setprofile(self._previous)
        _witness_class()(self).__enter__()
        if self._previous is not None:
            return self._previous(frame, event, arg)
        return None

    def noted(self, what: str) -> None:
        self.notes[f"{OTHER_THREAD_WORK} {what} from thread {threading.current_thread().name!r}"] += 1


@functools.cache
def _witness_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Witness(TorchDispatchMode):
        """Passes every op through; while the recording runs, notes those that are device work."""

        def __init__(self, owner: OtherThreads) -> None:
            super().__init__()
            self.owner = owner

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if self.owner.active and _device_work(func, args, kwargs, self.owner.where):
                self.owner.noted(str(func))
            return func(*args, **kwargs)

    return Witness


def _device_work(func, args, kwargs, where) -> bool:
    """An op of kvverify's library (swaps, kernels: raw pointers), or one on device tensors."""
    import torch

    if func.namespace == "kvverify":
        return True
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(t, torch.Tensor) and where(t) == "device" for t in items):
            return True
    return False

