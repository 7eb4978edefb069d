"""sgl-project/sglang#20611: a write-through D2H backup on its own stream racing the forward stream.

Public source: https://github.com/sgl-project/sglang/pull/20611 (closed in the stored copy; whether
it was merged is not shown). Root cause (the first of the two races it names): HiCache's
write-through backup copied KV pages to host memory on its write stream without waiting for the
forward stream, so it could back up pages whose KV the forward pass had not finished writing. The
fix makes the write stream ``wait_stream(forward_stream)`` before the backup. (The report's crash,
an illegal memory access, also needs its second race, the persistent attention kernel running
beside a kernel copy, and a reference-count leak fixed elsewhere; neither is a memory-order race
this case could show.)

Re-created: the forward stream writes the pages behind a spin; the backup copies them to pinned
host memory with ``Tensor.copy_(non_blocking=True)``, an aten op on CUDA tensors, which PyTorch's
CUDA Stream Sanitizer sees too.
"""

from __future__ import annotations

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
    PAGES,
    device_pages,
    is_fixed,
    pinned_pages,
    spin,
    witness,
)

CASE = Case(
    name="sglang-20611", source="sgl-project/sglang#20611", url="https://github.com/sgl-project/sglang/pull/20611",
    root_cause="the write-through backup's D2H copy does not wait for the forward stream writing the pages",
    hazard="forward-race", capture="recorded", kind="RAW", pair=("forward", "write_through"),
    witness="host pages of the backup that do not hold the bytes the forward pass wrote", module=__name__)

WRITTEN = 0x2B


def forward(pages, forward_stream) -> None:
    """The forward pass writes the KV ``pages`` on ``forward_stream``, behind its earlier layers."""
    import torch

    spin(forward_stream)
    with torch.cuda.stream(forward_stream):
        pages.fill_(WRITTEN)


def write_through(pages, host, write_stream, forward_stream, fixed: bool) -> None:
    """Back ``pages`` up to ``host`` on ``write_stream``; the fixed controller waits on the forward first."""
    import torch

    with torch.cuda.stream(write_stream):
        if fixed:
            write_stream.wait_stream(forward_stream)
        host.copy_(pages, non_blocking=True)


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the backed-up pages that missed the write."""
    import torch

    fixed = is_fixed(form)
    kv = device_pages(2 * PAGES)
    pages = kv[:PAGES]
    host = pinned_pages(PAGES)
    forward_stream, write_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    forward(pages, forward_stream)
    write_through(pages, host, write_stream, forward_stream, fixed)
    torch.cuda.synchronize()
    return witness(host, WRITTEN)
