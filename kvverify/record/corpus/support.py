"""What every corpus case needs, defined once: pages of device and pinned memory with a known byte,
the pointers of a page-for-page swap, a spin that holds a stream, a count of corrupted pages, and a
worker thread fed by a queue.

The racing ops themselves are issued in each case's own functions, never here: a recording names
the line of the innermost frame outside the recorder, and the case's expected pair is two of its
own functions. torch is imported inside the functions: listing the corpus needs no torch.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvverify.record.corpus.case import FORMS, Witness

if TYPE_CHECKING:
    import torch

DEVICE = "cuda:0"
PAGES = 16
PAGE_BYTES = 64 * 1024  # a buffer of PAGES pages is 1 MiB
SPIN_MS = 50.0  # how long a writer's or reader's stream is held: the window the race needs natively
CLOCK_KHZ_FALLBACK = 1_980_000  # an H200's SM clock, where torch does not report the device's
CLOCK_KHZ_PLAUSIBLE = 100_000  # below 100 MHz the reported figure is not a clock in kHz: use the fallback


def is_fixed(form: str) -> bool:
    """True for ``"fixed"``, False for ``"broken"``; ValueError for any other form."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; use one of {', '.join(FORMS)}")
    return form == "fixed"


def device_pages(n: int, value: int = 0) -> torch.Tensor:
    """``n`` pages on ``cuda:0``: a uint8 tensor of shape ``(n, PAGE_BYTES)``, every byte ``value``,
    filled on the current stream (synchronize before another stream uses it)."""
    import torch

    return torch.full((n, PAGE_BYTES), value, dtype=torch.uint8, device=DEVICE)


def pinned_pages(n: int, value: int = 0) -> torch.Tensor:
    """``n`` pages of pinned host memory from torch's caching host allocator: a uint8 CPU tensor of
    shape ``(n, PAGE_BYTES)``, every byte ``value``."""
    import torch

    return torch.full((n, PAGE_BYTES), value, dtype=torch.uint8, pin_memory=True)


def _base(memory) -> int:
    return memory.data_ptr() if hasattr(memory, "data_ptr") else int(memory)


def swap_args(src, dst, n: int = PAGES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src_ptrs, dst_ptrs, sizes)`` for ``kvverify.device.ops.swap_blocks_batch`` that copy page
    ``i`` of ``src`` to page ``i`` of ``dst`` for ``i < n``: int64 CPU tensors of shape ``(n,)``,
    addresses in bytes, every size ``PAGE_BYTES``. ``src`` and ``dst``: contiguous tensors of at
    least ``n`` pages, or raw addresses (ints). Raises ValueError for a tensor too small or not
    contiguous."""
    import torch

    for memory in (src, dst):
        if hasattr(memory, "data_ptr") and (not memory.is_contiguous()
                                            or memory.numel() * memory.element_size() < n * PAGE_BYTES):
            raise ValueError(f"a swap of {n} pages needs contiguous memory of {n * PAGE_BYTES} bytes, got a "
                             f"{'contiguous' if memory.is_contiguous() else 'strided'} tensor of "
                             f"{memory.numel() * memory.element_size()} bytes")
    offsets = torch.arange(n, dtype=torch.int64) * PAGE_BYTES
    return offsets + _base(src), offsets + _base(dst), torch.full((n,), PAGE_BYTES, dtype=torch.int64)


@functools.cache
def _cycles_per_ms() -> int:
    import torch

    # CUDA 13 dropped cudaDeviceProp::clockRate, which torch's clock_rate reported in kHz
    khz = int(getattr(torch.cuda.get_device_properties(DEVICE), "clock_rate", 0) or 0)
    return khz if khz >= CLOCK_KHZ_PLAUSIBLE else CLOCK_KHZ_FALLBACK  # kHz: cycles per millisecond


def spin(stream: torch.cuda.Stream, ms: float = SPIN_MS) -> None:
    """Hold ``stream`` for about ``ms`` milliseconds with a kernel that spins on the SM clock and
    touches no memory (``torch.cuda._sleep``): work queued behind it waits, other streams do not."""
    import torch

    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * _cycles_per_ms()))


def witness(pages: torch.Tensor, expected: int, note: str | None = None) -> Witness:
    """Count the pages of ``pages`` (shape ``(n, PAGE_BYTES)``, uint8, host or device) holding any
    byte other than ``expected``. Call it after synchronizing: a device tensor is copied to the host."""
    host = pages.cpu() if pages.is_cuda else pages
    corrupted = int((host != expected).any(dim=1).sum())
    return Witness(corrupted=corrupted, total=int(host.shape[0]), unit="pages", note=note)


_STOP = object()


class Worker:
    """A background thread that calls ``handle(job)`` for each ``put(job)``, in order: an engine's
    copy or I/O thread fed by a queue. Use it as a context manager: leaving joins the thread and
    raises the first exception a job raised (the jobs after it are dropped)."""

    def __init__(self, handle: Callable[[object], None], name: str = "corpus-worker") -> None:
        self._handle = handle
        self._jobs: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        # a daemon: a hung device call in a job must not keep the process alive
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def put(self, job: object) -> None:
        """Queue ``job`` for the thread (it runs after the jobs put before it)."""
        self._jobs.put(job)

    def __enter__(self) -> Worker:
        self._thread.start()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self._jobs.put(_STOP)
        self._thread.join()
        if self._errors and kind is None:
            raise self._errors[0]

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            if self._errors:
                continue
            try:
                self._handle(job)
            except BaseException as exc:  # handed to the thread that leaves the with-block
                self._errors.append(exc)
