"""Holding a stream until the host lets it go: the adversarial executor's "latest" moment.

A copy whose order lets it run late is held until the host is about to observe its
completion (a sync, a poll), which is the latest moment stream order allows; any host op
in between (a rewrite of a source, a read of a destination) then falls inside the window.

The hold is ``cuStreamWaitValue32`` on a flag word in pinned host memory, set by the host
at release: deterministic on any GPU. Where cuda-python is missing, a spin kernel of
``fallback_ns`` stands in (timing-based; the report says so through ``mechanism``).

Every host wait in the executors releases all holds first, and waits with a deadline, so a
held stream can never hang the process.
"""

from __future__ import annotations

import sys

MAX_HOLDS = 4096


class StreamGate:
    def __init__(self, device, fallback_ns: int = 20_000_000) -> None:
        import torch

        self.device = device
        self.fallback_ns = fallback_ns
        self._open: list[int] = []
        self._next = 0
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
        if self._driver is not None:  # flag words the device polls: pinned, so mapped for the GPU
            self._flags = torch.zeros(MAX_HOLDS, dtype=torch.int32, pin_memory=True)
            self._view = self._flags.numpy()

    def hold(self, stream) -> None:
        """Make later work on ``stream`` wait until ``release_all``."""
        if self._driver is None:
            from kvverify import kernels

            kernels.spin(self.fallback_ns, stream=stream)
            return
        if self._next >= MAX_HOLDS:
            raise RuntimeError(f"more than {MAX_HOLDS} stream holds in one trial; raise MAX_HOLDS")
        i = self._next
        self._next += 1
        self._view[i] = 0
        d = self._driver
        (err,) = d.cuStreamWaitValue32(
            d.CUstream(stream.cuda_stream), d.CUdeviceptr(self._flags.data_ptr() + 4 * i), 1, self._geq
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
        self._open.append(i)

    @property
    def holding(self) -> bool:
        return bool(self._open)

    def release_all(self) -> None:
        for i in self._open:
            self._view[i] = 1
        self._open.clear()

    def reset(self) -> None:
        """Between trials, once the device is idle: flag words can be reused."""
        self.release_all()
        self._next = 0
