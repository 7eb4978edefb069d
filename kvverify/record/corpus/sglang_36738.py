"""sgl-project/sglang#36738: a load-back into pages freed under overlap scheduling, still being written.

Public source: https://github.com/sgl-project/sglang/pull/36738 (merged). Root cause: with overlap
scheduling, a finished or retracted request's KV pages go back to the allocator on the host while
the forward round launched for it is still writing them; a consumer on the forward stream is
ordered after those writes, but HiCache's load-back writes the reallocated pages from a transfer
stream, so the old round's write can land after the restore and corrupt the restored prefix. The
fix makes the host-to-device stream wait on the forward stream (``load_fence_stream``) before the
load's copies.

Re-created: logical reuse inside one large KV tensor. The forward stream writes request A's pages
behind a spin; the pages go to request B, whose prefix is loaded into them from pinned host memory.
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
    name="sglang-36738", source="sgl-project/sglang#36738", url="https://github.com/sgl-project/sglang/pull/36738",
    root_cause="a load-back into freed pages does not wait for the forward round still writing them",
    hazard="block-reuse", capture="recorded", kind="WAW", pair=("forward", "load_back"),
    witness="pages of request B's restored prefix that hold request A's late write", module=__name__)

A_KV, B_PREFIX = 0x31, 0x72


def forward(pages, forward_stream) -> None:
    """Request A's round writes its KV ``pages`` on ``forward_stream``, behind its earlier layers."""
    import torch

    spin(forward_stream)
    with torch.cuda.stream(forward_stream):
        pages.fill_(A_KV)


def load_back(pages, host, h2d_stream, forward_stream, fixed: bool) -> None:
    """Restore request B's prefix ``host`` into ``pages`` on ``h2d_stream``; the fixed controller
    fences the load behind the forward stream."""
    import torch

    with torch.cuda.stream(h2d_stream):
        if fixed:
            h2d_stream.wait_stream(forward_stream)
        pages.copy_(host, non_blocking=True)


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the restored pages the old round overwrote."""
    import torch

    fixed = is_fixed(form)
    kv = device_pages(4 * PAGES)
    pages = kv[PAGES:2 * PAGES]
    host = pinned_pages(PAGES, B_PREFIX)
    forward_stream, h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    forward(pages, forward_stream)
    # request A finishes while its round still runs: its pages are freed and reallocated to request B
    load_back(pages, host, h2d_stream, forward_stream, fixed)
    torch.cuda.synchronize()
    return witness(pages, B_PREFIX)
