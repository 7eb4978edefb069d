"""Host threads (trace format 1.2): every thread a recording starts is recorded, with the host
synchronization that orders its work against the others'.

The dispatch mode that records ops, and the recorder's hooks, are per thread (torch keeps modes in
thread-local state). ``ThreadCapture`` extends a recording to the threads the program starts while
it runs, and writes what orders them as ``release`` / ``acquire`` ops (rule 8):

- ``Thread.start`` releases a name the new thread acquires before its ``run()``; the thread's end
  releases one its ``join()`` acquires (``Thread._bootstrap_inner``, where every thread begins and
  ends, is wrapped while recording; the new thread gets its own recording dispatch mode there);
- locks: ``acquire`` / ``release`` (and ``with``) of ``threading.Lock`` and ``threading.RLock``,
  observed on their C types in place (``patching.patch_method``: every lock stays what it is), one
  sync name per lock object; ``threading.Event``, ``Condition`` and ``Semaphore`` are built on
  them, so an event's ``set`` orders the threads as it does in the program;
- queues: one sync name per item, a get ordered after the put of the item it returned, not by the
  queue's own locks: ``queue.Queue`` by position (``_wrap_queue``), ``queue.SimpleQueue`` by the
  object returned (``_wrap_simple_queue``, which says what it does not follow);
- ``concurrent.futures``: a task starts after its ``submit`` (the executor's work queue is a
  ``SimpleQueue``) and ends before what returns its future done (the future's condition); two
  orderings the executor's own locks add by this run's timing are left out, one is not
  (``_wrap_futures``).

Host bookkeeping (a flag, a list) that no lock guards orders nothing: the trace says so, and so
does the checker.

What stays unseen is named: threads already running when the recording started (the summary lists
them; their device work is seen only through the observed event methods and the allocator's
reports, noted as missed), and device work outside torch's dispatcher (native capture sees it). Each note of missed
work starts with ``NOT_RECORDED``: ``Recording.complete()`` is then false, and ``kvverify record``
exits 2 rather than call the rest SAFE.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from kvverify.record.trace.recorder import Depth, busy

NOT_RECORDED = "NOT RECORDED"
RECORDER_ERROR = f"{NOT_RECORDED} (a recorder error; the trace misses these ops):"
OTHER_THREAD_WORK = (f"{NOT_RECORDED} (device work of a thread the recording does not follow: one that was "
                     "running before it started; see docs/record.md):")

# per thread: how deep in a hand-off's own code (a queue's put or get, a task's start), whose locks
# are left out
_IN_HAND_OFF = Depth()
_LOCK_TYPES = (type(threading.Lock()), getattr(threading, "_CRLock", None) or type(threading.RLock()))
# threading's own locks, taken as every thread begins and ends (``_active_limbo_lock``: also by
# ``Thread.start``, ``enumerate()``): observed, they would order a thread started after another
# ended after everything that one did, which the program never asked for
_BOOKKEEPING = tuple(lock for lock in (getattr(threading, "_active_limbo_lock", None),
                                        getattr(threading, "_shutdown_locks_lock", None)) if lock is not None)
_ACQUIRES = ("acquire", "acquire_lock", "__enter__", "_acquire_restore")
_RELEASES = ("release", "release_lock", "__exit__", "_release_save")


class ThreadCapture:
    """Follows the threads a recording starts and the locks between them.

    ``recorder``: the ``kvverify.record.trace.recorder.Recorder`` (its ``threads``, ``exclusive()``,
    ``host_synchronized``); ``enter_thread``: called in each new thread before its ``run()``, returns
    what to call at its end (the session pushes a dispatch mode there and pops it then);
    ``before_start``: called in the parent before a followed thread starts (the session's dispatch
    mode takes over from the op log there).
    """

    def __init__(self, recorder, enter_thread: Callable[[], Callable[[], None]],
                 before_start: Callable[[], None] = lambda: None) -> None:
        self.recorder = recorder
        self.enter_thread = enter_thread
        self.before_start = before_start
        self.active = False
        self.running_before: list[str] | None = None  # at the first start (again after a pause: not)
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Thread -> its start and end names
        self._syncs: dict[int, tuple[object, str]] = {}  # id(lock) -> (lock, name): held, so no id is reused
        # id(lock) -> lock, for locks that order nothing the program asked for (threading's
        # bookkeeping, an executor's count of idle workers): held, as _syncs
        self._unobserved: dict[int, object] = {id(lock): lock for lock in _BOOKKEEPING}
        self._items = 0  # queue items named so far (over every start: no name is released twice)
        self._undo: list[Callable[[], None]] = []
        self.starting = 0  # threads started and not yet running (not in recorder.threads)

    # -- lifetime ----------------------------------------------------------------------------

    def start(self) -> None:
        """Name the threads running now (at the first start); from now on, follow new threads and
        every lock."""
        from kvverify.record.capture.patching import patch_method

        if self.running_before is None:
            current = threading.get_ident()
            self.running_before = sorted(t.name for t in threading.enumerate() if t.ident != current and t.is_alive())
        self._wrap_thread()
        self._wrap_queue()
        self._wrap_simple_queue()
        self._wrap_futures()
        for cls in _LOCK_TYPES:
            for name in (*_ACQUIRES, *_RELEASES):
                original = cls.__dict__.get(name)
                if original is not None:
                    self._undo.append(patch_method(cls, name, self._observed(name, original), original))
        self.active = True

    def stop(self) -> None:
        """Stop following (threads started meanwhile record nothing more)."""
        self.active = False
        while self._undo:
            self._undo.pop()()

    def _replace(self, cls: type, name: str, fn: Callable) -> None:
        """Put ``fn`` in place of ``cls.<name>`` (a class defined in Python) until ``stop()``."""
        original = cls.__dict__[name]
        fn.__name__, fn.__qualname__, fn.__doc__ = original.__name__, original.__qualname__, original.__doc__
        setattr(cls, name, fn)
        self._undo.append(lambda: setattr(cls, name, original))

    def lines(self) -> list[str]:
        """What the summary says of threads this recording did not follow."""
        if not self.running_before:
            return []
        return ["threads running beside the recording one when it started, whose dispatcher work is not seen: "
                + ", ".join(self.running_before)]

    # -- threads -----------------------------------------------------------------------------

    def _wrap_thread(self) -> None:
        cls = threading.Thread
        start, bootstrap, join = cls.start, cls._bootstrap_inner, cls.join
        capture = self

        def started(thread) -> None:
            # in the parent, before the thread can run: what it did so far happens before the thread
            if not capture._following():
                return start(thread)
            capture.before_start()
            n = len(capture._names) + 1
            capture._names[thread] = (f"start of thread {n} ({thread.name})", f"end of thread {n} ({thread.name})")
            capture._sync("release", capture._names[thread][0])
            # from now on this thread's locks may order it against the new one, which registers
            # itself only once it runs
            with capture.recorder.exclusive():
                capture.starting += 1
            try:
                start(thread)
            except BaseException:
                with capture.recorder.exclusive():
                    capture.starting -= 1
                raise

        def bootstrap_inner(thread) -> None:
            names = capture._names.get(thread)
            if names is None or not capture.active:
                return bootstrap(thread)
            with capture.recorder.exclusive():
                capture.recorder.thread_started(threading.get_ident(), thread.name)
                capture.starting -= 1
            capture._sync("acquire", names[0])
            leave = capture.enter_thread()
            try:
                return bootstrap(thread)
            finally:
                leave()
                capture._sync("release", names[1])
                with capture.recorder.exclusive():
                    capture.recorder.thread_ended(threading.get_ident())

        def joined(thread, timeout=None):
            out = join(thread, timeout)
            names = capture._names.get(thread)
            if names is not None and not thread.is_alive():
                capture._sync("acquire", names[1])
            return out

        for name, fn in (("start", started), ("_bootstrap_inner", bootstrap_inner), ("join", joined)):
            self._replace(cls, name, fn)

    # -- queues ------------------------------------------------------------------------------

    def _wrap_queue(self) -> None:
        """A ``queue.Queue`` orders each ``get`` after the ``put`` of the item it returns: ``_put``
        (called under the queue's mutex, in the order items enter) releases a name of the item's
        own, and ``_get`` (in the order they leave) acquires it. The queue's own locks (its mutex,
        its conditions' waiters) are left out during ``put`` and ``get``: they would order a get
        after every earlier put, whatever item it got (this run's timing, not the program's
        ordering). Subclasses that keep items in another order (``LifoQueue``,
        ``PriorityQueue``) get no item names: their hand-offs order nothing (a report too many,
        never a race hidden)."""
        import collections
        import queue

        cls = queue.Queue
        put, get = cls._put, cls._get
        capture = self
        pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # queue -> names, in item order

        def fifo(q) -> bool:
            return type(q)._put is put_item and type(q)._get is get_item

        def put_item(q, item):  # under the queue's mutex
            if not fifo(q):
                return put(q, item)
            names = pending.get(q)
            if names is None:  # items put before the recording have no name
                names = pending[q] = collections.deque([None] * len(q.queue))
            name = capture._item_put()
            put(q, item)
            names.append(name)

        def get_item(q):  # under the queue's mutex
            item = get(q)
            names = pending.get(q) if fifo(q) else None
            capture._item_got(names.popleft() if names else None)
            return item

        for name in ("put", "get"):
            self._replace(cls, name, _own_locks_left_out(cls.__dict__[name]))
        self._replace(cls, "_put", put_item)
        self._replace(cls, "_get", get_item)

    def _wrap_simple_queue(self) -> None:
        """A ``queue.SimpleQueue`` orders each ``get`` after a ``put`` of the object it returns (its
        methods observed in place on the C type, ``patching.patch_method``).

        Its own lock is no threading lock and orders nothing. Nor does it run under the recorder:
        two gets may reach the recorder in the other order than they left the queue, so a get is
        matched by the object it returned, not by its position. One object may be in the queue
        more than once: per object, ``_Puts`` counts the puts not yet got back, with the one
        followed thread that made them all and the first one's name, which a get acquires (program
        order puts it before that thread's later puts, among them the one whose copy the get
        returned). Puts of several threads, or of one the recording does not follow, order no get
        of the object until every put counted is got back. A put is counted before its object
        enters the queue and a get after it left: the count never falls below the copies a get can
        still return.

        Not followed: a queue that held items when the recording first used it (any of them may be
        an object a later put puts again: none of its gets is ordered); puts and gets through
        methods bound before the recording (``put = q.put``). Such a get leaves its put counted
        (an ordering too few); such a put of an object that followed puts also put may order a get
        after the wrong put (bind no queue method before the recording).
        """
        import _queue

        from kvverify.record.capture.patching import patch_method

        cls = _queue.SimpleQueue
        recorder = self.recorder
        capture = self
        held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # queue -> {id(object): _Puts}, or None

        def puts_of(q) -> dict[int, _Puts] | None:  # holding the recorder
            if q not in held:
                held[q] = None if q.qsize() else {}
            return held[q]

        def counted(original):
            def put(q, item, *args, **kwargs):
                name = capture._item_put()
                with recorder.exclusive():
                    puts = puts_of(q)
                    if puts is not None:
                        thread = recorder.threads.get(threading.get_ident())
                        seen = puts.setdefault(id(item), _Puts(0, thread, name))
                        seen.count += 1
                        if seen.thread != thread:
                            seen.thread = None
                return original(q, item, *args, **kwargs)
            return put

        def got_back(original):
            def get(q, *args, **kwargs):
                with recorder.exclusive():
                    puts_of(q)  # first seen by this get: what it holds now was put unseen
                item = original(q, *args, **kwargs)
                with recorder.exclusive():
                    puts = held[q]
                    seen = puts.get(id(item)) if puts else None
                    if seen is not None:
                        seen.count -= 1
                        if not seen.count:
                            del puts[id(item)]
                    capture._item_got(seen.name if seen is not None and seen.thread is not None else None)
                return item
            return get

        for name, wrap in (("put", counted), ("put_nowait", counted), ("get", got_back), ("get_nowait", got_back)):
            original = cls.__dict__[name]
            self._undo.append(patch_method(cls, name, wrap(original), original))

    def _item_put(self) -> str | None:
        """Release a name of its own for the item this thread puts in a queue now; returns it (None
        where it orders nothing: a thread the recording does not follow, or no second thread yet)."""
        if not (self._following() and len(self.recorder.followed) + self.starting >= 2):
            return None
        with self.recorder.exclusive():
            self._items += 1
            name = f"queue item {self._items}"
            self.recorder.host_synchronized("release", name)
        return name

    def _item_got(self, name: str | None) -> None:
        """This thread got the item ``_item_put`` named ``name`` (None: one nothing orders)."""
        if name is not None and self._following():
            self._sync("acquire", name)

    # -- concurrent.futures ------------------------------------------------------------------

    def _wrap_futures(self) -> None:
        """``concurrent.futures``: a task starts after its ``submit`` through the item the executor
        puts in its work queue (a ``queue.SimpleQueue``), and ends before what returns its future
        done through the future's condition (released once the result is set; ``result()`` takes
        it, ``wait`` and ``as_completed`` take it or their waiter's lock). Two orderings of the
        executor's own locks are this run's timing, not the program's, and are left out: the
        task's start takes nothing from threads already waiting for its future
        (``set_running_or_notify_cancel`` takes the lock their wait released: what they did after
        the submit would pass for ordered before the task), and the count of idle workers (a
        semaphore a worker releases after each task and ``submit`` takes) orders no submit after a
        worker's last task, nor the worker's next task after a submit.

        Still taken: at a task's end the worker takes the future's lock (``set_result``), which a
        thread waiting for the future released, so what that thread did before it waited passes for
        ordered before the worker's next tasks. A callback added with ``add_done_callback`` and run
        by the worker needs that ordering; leaving it out needs the callbacks followed apart
        (tests/record/test_record_threads.py, the strict xfail)."""
        from concurrent.futures import Future, ThreadPoolExecutor

        submit = ThreadPoolExecutor.submit
        unobserved = self._unobserved

        def submitted(executor, fn, /, *args, **kwargs):
            # the semaphore's lock, found before a worker of this executor can take it
            idle = getattr(getattr(executor, "_idle_semaphore", None), "_cond", None)
            lock = getattr(idle, "_lock", None)
            if lock is not None:
                unobserved.setdefault(id(lock), lock)
            return submit(executor, fn, *args, **kwargs)

        self._replace(Future, "set_running_or_notify_cancel", _own_locks_left_out(Future.set_running_or_notify_cancel))
        self._replace(ThreadPoolExecutor, "submit", submitted)

    # -- locks -------------------------------------------------------------------------------

    def _observed(self, name: str, original) -> Callable:
        capture = self
        if name in _RELEASES:
            def release(lock, *args):
                # logged before the lock is free, holding the recorder until it is: an acquire
                # elsewhere comes later in the trace; a release that raises (the lock not held, an
                # RLock of another thread) released nothing, and its op is taken back
                if not capture._observing(lock):
                    return original(lock, *args)
                with capture.recorder.exclusive():
                    ops = capture.recorder.ops
                    capture._log_lock("release", lock)
                    logged = len(ops)
                    try:
                        return original(lock, *args)
                    except BaseException:
                        if len(ops) == logged:
                            ops.pop()
                        raise
            return release

        def acquire(lock, *args, **kwargs):
            got = original(lock, *args, **kwargs)
            if got is not False:  # __enter__ returns the lock's own answer; _acquire_restore None
                capture._lock("acquire", lock)
            return got
        return acquire

    def _observing(self, lock) -> bool:
        # until a second thread is started, locks order nothing program order and the start of the
        # next thread (a release it acquires) do not; from then on they may, even once that thread
        # ended (its releases order what acquires the lock later). threading's own bookkeeping locks
        # order nothing the program asked for (start and join are written as such)
        recorder = self.recorder
        return (self.active and len(recorder.followed) + self.starting >= 2 and not busy()
                and not _IN_HAND_OFF.depth and threading.get_ident() in recorder.threads
                and id(lock) not in self._unobserved)

    def _lock(self, kind: str, lock) -> None:
        if not self._observing(lock):
            return
        with self.recorder.exclusive():
            self._log_lock(kind, lock)

    def _log_lock(self, kind: str, lock) -> None:
        """Log ``kind`` of ``lock`` (holding the recorder)."""
        entry = self._syncs.get(id(lock))
        if entry is None:
            entry = self._syncs[id(lock)] = (lock, f"lock{len(self._syncs) + 1}")
        self.recorder.host_synchronized(kind, entry[1])

    def _sync(self, kind: str, name: str) -> None:
        with self.recorder.exclusive():
            self.recorder.host_synchronized(kind, name)

    def _following(self) -> bool:
        return self.active and threading.get_ident() in self.recorder.threads


@dataclass
class _Puts:
    """The puts of one object in a ``SimpleQueue`` not yet got back: how many, the one followed
    thread that made them all (None: several, or one not followed), and the first one's name."""

    count: int
    thread: str | None
    name: str | None


def _own_locks_left_out(fn: Callable) -> Callable:
    """``fn``, with the locks it takes left out (a hand-off's own: they order by this run's timing)."""
    def left_out(*args, **kwargs):
        _IN_HAND_OFF.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _IN_HAND_OFF.depth -= 1
    return left_out


STREAM_OPS = frozenset(("kernel", "copy", "copy_batch", "record", "wait_event", "sync_stream"))
EVENT_OPS = frozenset(("record", "wait_event", "sync_event", "query_event"))
HOST_WAITS = frozenset(("sync_stream", "sync_event", "query_event", "sync_device"))
"""Ops where the host waits for (or asks after) device work: which work one covers depends on
what reached the driver before it, and taking it as earlier than it was only orders less."""


def waits_first(log: list[dict]) -> None:
    """Move each timed host wait (``HOST_WAITS``) of the log, in place, before the ops of other
    threads logged ahead of it that did not return before it began: which of them the wait
    covered is not known (a thread that releases the GIL to wait lets others issue meanwhile), and
    the wait taken as the earlier one covers none of them, a report too many at worst, never a
    race hidden. Nothing moves past an op of its own thread."""
    k = 0
    while k < len(log):
        op = log[k]
        when = op.get("when")
        if op["op"] not in HOST_WAITS or when is None:
            k += 1
            continue
        thread, j = op.get("thread"), k
        while j > 0 and log[j - 1].get("thread") != thread:
            j -= 1
        # (back to just after its thread's last op; from there on, the first op not known to be earlier)
        while j < k and _driver_ordered(log[j].get("when"), when):
            j += 1
        if j < k:
            log.insert(j, log.pop(k))
        k += 1


def unordered_sharing(log: list[dict]) -> tuple[int, str | None]:
    """Pairs of ops of two threads on one stream (or on one event, one of them a record) with no
    host ordering between them (``release`` / ``acquire``, rule 8) and no driver order either, in a
    recorder's op log; returns their count and a description of the first.

    Each op is logged after its CUDA call returned, not atomically with it: two threads' ops that
    nothing orders on the host may have reached the driver in the other order than the log's, and
    on one stream that order decides what a later event captures (or which record a wait reads).
    Such a pair is decided where both calls were timed (``when``: ``Recorder.when``) and the
    earlier one in the log had returned before the later one began (the driver saw them in the
    log's order), and where the earlier one is a host wait (``waits_first`` put it there: it covers
    less). Any other such pair (calls that overlapped, a log order the clock contradicts, a call
    not timed) makes the recording not a complete account of the program (``NOT_RECORDED``)."""
    clocks: dict[object, dict[object, int]] = {}  # thread -> its vector clock
    syncs: dict[str, dict[object, int]] = {}  # sync name -> the clock its releases carry
    last: dict[tuple[str, str], dict[object, tuple[int, dict]]] = {}  # (kind, name) -> thread -> (tick, op)
    count, first = 0, None

    def check(key: tuple[str, str], thread, clock: dict, op: dict, against: tuple[str, str]) -> None:
        nonlocal count, first
        when = op.get("when")
        for other, (tick, earlier) in last.get(against, {}).items():
            if (other != thread and clock.get(other, 0) < tick and earlier["op"] not in HOST_WAITS
                    and not _driver_ordered(earlier.get("when"), when)):
                count += 1
                if first is None:
                    first = (f"{key[0]} {key[1]!r}: {earlier['op']} at {earlier.get('at') or '?'} "
                             f"({other or 'the first thread'}) and {op['op']} at {op.get('at') or '?'} "
                             f"({thread or 'the first thread'})")

    for op in log:
        thread, kind = op.get("thread"), op["op"]
        clock = clocks.setdefault(thread, {})
        clock[thread] = clock.get(thread, 0) + 1
        if kind == "release":
            carried = syncs.setdefault(op["sync"], {})
            for t, c in clock.items():
                carried[t] = max(carried.get(t, 0), c)
            continue
        if kind == "acquire":
            for t, c in syncs.get(op["sync"], {}).items():
                clock[t] = max(clock.get(t, 0), c)
            continue
        tick = clock[thread]
        if kind == "sync_device":  # a wait for every stream
            for key in [key for key in last if key[0] == "stream"]:
                check(key, thread, clock, op, key)
            continue
        if kind in STREAM_OPS and "stream" in op:
            key = ("stream", op["stream"])
            check(key, thread, clock, op, key)
            last.setdefault(key, {})[thread] = (tick, op)
        if kind in EVENT_OPS and "event" in op:
            key, records = ("event", op["event"]), ("record of event", op["event"])
            # a record against every op on the event; anything else against its records only
            check(key, thread, clock, op, key if kind == "record" else records)
            if kind == "record":
                last.setdefault(records, {})[thread] = (tick, op)
            last.setdefault(key, {})[thread] = (tick, op)
    return count, first


def _driver_ordered(earlier: tuple[int, int] | None, later: tuple[int, int] | None) -> bool:
    """Whether a call that ran in ``earlier`` reached the driver before one that ran in ``later``:
    it returned before the other began (CLOCK_MONOTONIC is one clock for every CPU)."""
    return earlier is not None and later is not None and earlier[1] < later[0]
