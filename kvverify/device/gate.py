"""Holding a stream until the host lets it go: the adversarial executor's "latest" moment.

A copy whose order lets it run late is held until the host is about to observe its
completion (a sync, a poll), which is the latest moment stream order allows; any host op
in between (a rewrite of a source, a read of a destination) then falls inside the window.

The hold is ``cuStreamWaitValue32`` (GEQ) on one flag word in pinned host memory. Releases
are monotonic: the host writes an ever-growing epoch into the flag, and each hold waits for
the epoch after the one current when it was issued, so any later release frees every hold
issued before it, also one that the host lost track of (an interrupt between issuing a hold
and noting it). Flag words are never reset, so a wait the device has not reached yet can
never be re-armed. Where cuda-python is missing, a spin kernel of ``fallback_ns`` stands in
(timing-based; the report says so through ``mechanism``).

Nothing can stay held for ever:
- every host wait of the executors releases all holds first, and waits with a deadline;
- a watchdog thread releases a hold that stayed open longer than ``deadline_s`` (the host
  is then blocked in a call that waits for the held stream); ``expired`` counts those, and
  the executor turns it into an error of the trial;
- ``release_everything()`` frees the holds of every live gate: the stress command calls it
  from its signal watcher the moment SIGINT / SIGTERM arrives, even while the main thread
  is blocked in a CUDA call, and on every exit path.
"""

from __future__ import annotations

import sys
import threading
import time

_REGISTRY_LOCK = threading.Lock()
_LIVE: set[StreamGate] = set()
_watchdog: threading.Thread | None = None
WATCH_INTERVAL_S = 0.05


def release_everything(disarm: bool = False) -> None:
    """Release every hold of every live gate; ``disarm``: later holds become no-ops (an
    interrupted run must not hold streams again while it unwinds)."""
    with _REGISTRY_LOCK:
        gates = list(_LIVE)
    for gate in gates:
        if disarm:
            gate.disarmed = True
        gate.release_all()


def _watch() -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        with _REGISTRY_LOCK:
            gates = list(_LIVE)
        now = time.monotonic()
        for gate in gates:
            try:
                gate._expire(now)
            except Exception:  # pragma: no cover - never let the watchdog die
                pass


def _start_watchdog() -> None:
    global _watchdog
    with _REGISTRY_LOCK:
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch, name="kvverify-gate-watchdog", daemon=True)
            _watchdog.start()


class StreamGate:
    def __init__(self, device, fallback_ns: int = 20_000_000, deadline_s: float = 5.0) -> None:
        import torch

        self.device = device
        self.fallback_ns = fallback_ns
        self.deadline_s = deadline_s
        self.disarmed = False
        self.expired = 0  # holds released by the watchdog (the host was blocked while they were open)
        self._lock = threading.RLock()  # re-entrant: a signal handler may release inside hold()
        self._epoch = 0  # the value last written to the flag
        self._open_since: float | None = None  # when the oldest unreleased hold was issued
        try:
            from cuda.bindings import driver

            if torch.device(device).type != "cuda":  # tests' stand-in device: nothing to hold
                raise ImportError
            self._driver = driver
            self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ.value
            self.mechanism = "cuStreamWaitValue32 on a host flag, released at the host's next wait"
        except ImportError:
            self._driver = None
            self.mechanism = f"spin kernel of {fallback_ns / 1e6:.0f} ms (no cuda-python or no CUDA device: timing-based)"
        if self._driver is not None:  # the flag word the device polls: pinned, so mapped for the GPU
            self._flags = torch.zeros(16, dtype=torch.int32, pin_memory=True)
            self._view = self._flags.numpy().view("uint32")
            _start_watchdog()
        with _REGISTRY_LOCK:
            _LIVE.add(self)

    def hold(self, stream) -> None:
        """Make later work on ``stream`` wait until the next ``release_all``."""
        if self.disarmed:
            return
        if self._driver is None:
            from kvverify.device import kernels

            kernels.spin(self.fallback_ns, stream=stream)
            return
        with self._lock:
            target = (self._epoch + 1) & 0xFFFFFFFF
        d = self._driver
        (err,) = d.cuStreamWaitValue32(
            d.CUstream(stream.cuda_stream), d.CUdeviceptr(self._flags.data_ptr()), target, self._geq
        )
        if err != d.CUresult.CUDA_SUCCESS:
            # Stream memory operations refused (an old driver, a platform without them): fall
            # back to the timed hold for the rest of the run, and say so in the report.
            self._driver = None
            self.mechanism = (f"spin kernel of {self.fallback_ns / 1e6:.0f} ms (cuStreamWaitValue32 failed: {err}; "
                              "timing-based)")
            print(f"kvverify: {self.mechanism}", file=sys.stderr)
            self.hold(stream)
            return
        with self._lock:
            if self._open_since is None:
                self._open_since = time.monotonic()

    @property
    def holding(self) -> bool:
        return self._open_since is not None

    def release_all(self) -> None:
        """Free every hold issued so far (cheap; safe from any thread, and when nothing is held)."""
        with self._lock:
            self._open_since = None
            if self._driver is not None:
                self._epoch = (self._epoch + 1) & 0xFFFFFFFF
                self._view[0] = self._epoch

    def _expire(self, now: float) -> None:
        """Watchdog: release holds open longer than ``deadline_s``."""
        with self._lock:
            if self._open_since is not None and now - self._open_since > self.deadline_s:
                self.expired += 1
                self.release_all()

    def reset(self) -> None:
        """Between trials: release everything (flag words are never re-armed)."""
        self.release_all()

    def close(self) -> None:
        """Release every hold and stop watching this gate."""
        self.release_all()
        with _REGISTRY_LOCK:
            _LIVE.discard(self)
