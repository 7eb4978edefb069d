"""meta-pytorch/torchrec#4231: a device block released without ``record_stream`` while a side stream reads it.

Public source: https://github.com/meta-pytorch/torchrec/pull/4231 (closed: a benchmark that
reproduces the bug; the fix itself is an internal diff to ``memory_stashing.py``). Root cause:
activation stashing copied a tensor to host memory with a non-blocking D2H on a side stream, then
released its GPU memory (``untyped_storage().resize_(0)``); the caching allocator knows only the
stream the block was allocated on, so it handed the block to the next allocation on the default
stream, whose kernel overwrote it while the copy was still reading (NaNs in training). The fix
calls ``tensor.record_stream(side_stream)`` before the release, so that the allocator defers the
reuse until the side stream has caught up. Training stashes, not a KV cache; the device ops are
the same as an offload's.

Re-created: a tensor made on the compute stream, copied to pinned memory on a side stream behind a
spin (the copies queued ahead), released; the next allocation of the same size on the compute
stream is filled at once.
"""

from __future__ import annotations

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
    DEVICE,
    PAGE_BYTES,
    PAGES,
    is_fixed,
    pinned_pages,
    spin,
    witness,
)

CASE = Case(
    name="torchrec-4231", source="meta-pytorch/torchrec#4231", url="https://github.com/meta-pytorch/torchrec/pull/4231",
    root_cause="a block read by a side stream's D2H is released without record_stream and reused on the compute stream",
    hazard="release", capture="recorded", kind="WAR", pair=("stash", "next_forward"),
    witness="host pages of the stash that hold the next tensor's bytes", module=__name__)

STASHED, NEXT = 0x42, 0xFF
NOT_REUSED = "the caching allocator did not hand the block out again: the window did not open"


def stash(activation, host, side, compute, fixed: bool) -> None:
    """Copy ``activation`` to ``host`` on ``side`` and release its device memory; the fixed stash
    tells the allocator that ``side`` uses the block first."""
    import torch

    side.wait_stream(compute)
    spin(side)
    with torch.cuda.stream(side):
        host.copy_(activation, non_blocking=True)
    if fixed:
        activation.record_stream(side)
    activation.untyped_storage().resize_(0)


def next_forward(compute):
    """The next layer allocates a tensor of the same size on ``compute`` and writes it."""
    import torch

    with torch.cuda.stream(compute):
        following = torch.empty((PAGES, PAGE_BYTES), dtype=torch.uint8, device=DEVICE)
        following.fill_(NEXT)
    return following


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the stashed pages that got the next tensor's bytes."""
    import torch

    fixed = is_fixed(form)
    host = pinned_pages(PAGES)
    compute, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    # Streams come from a pool and keep their cached blocks across runs: with none cached, the
    # block the stash releases is the one the next allocation on compute gets.
    torch.cuda.empty_cache()
    with torch.cuda.stream(compute):
        activation = torch.full((PAGES, PAGE_BYTES), STASHED, dtype=torch.uint8, device=DEVICE)
    released = activation.data_ptr()
    stash(activation, host, side, compute, fixed)
    following = next_forward(compute)
    torch.cuda.synchronize()
    reused = following.data_ptr() == released
    return witness(host, STASHED, None if fixed or reused else NOT_REUSED)
