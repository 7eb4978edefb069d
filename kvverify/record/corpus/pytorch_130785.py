"""pytorch/pytorch#130785, as it shipped in LMCache/LMCache#4830: a pinned temporary dropped mid-copy.

Public source: https://github.com/pytorch/pytorch/issues/130785 (closed). Root cause: a pinned CPU
tensor's last reference goes while its non-blocking copy to the GPU is still pending, and its memory
returns to the allocator for the next pinned tensor. For ``Tensor.copy_`` from PyTorch's own pinned
allocator this is guarded (the copy records an event on the block, and the allocator hands the block
out again only once it has completed), so the issue's own snippet is safe. Where it shipped and
corrupted data is https://github.com/LMCache/LMCache/pull/4830 (merged): a scatter into the paged
KV cache pinned unpinned chunks into temporaries and copied them through raw pointers, which no
stream tracking sees; returning dropped the temporary, the next ``pin_memory()`` call got its memory
and overwrote it mid-transfer. The fix synchronizes before returning when the function did the
pinning itself.

Re-created in that raw-pointer form: a temporary from ``torch.empty(pin_memory=True)`` whose
``data_ptr()`` goes to ``swap_blocks_batch`` behind a spin (the copies queued ahead), dropped at
return; the next pinned tensor of the same size is written by the host.
"""

from __future__ import annotations

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
    PAGE_BYTES,
    PAGES,
    device_pages,
    is_fixed,
    spin,
    swap_args,
    witness,
)

CASE = Case(
    name="pytorch-130785", source="pytorch/pytorch#130785", url="https://github.com/pytorch/pytorch/issues/130785",
    root_cause="a pinned temporary copied through raw pointers goes back to the host allocator before the copy reads it",
    hazard="release", capture="recorded", kind="WAR", pair=("scatter_chunk", "pin_next_chunk"),
    witness="KV pages that hold the next chunk's bytes instead of the scattered chunk's", module=__name__)

CHUNK, NEXT_CHUNK = 0x21, 0x6A
NOT_REUSED = "the pinned allocator handed out other memory: the window did not open"


def scatter_chunk(chunk, kv, copy_stream, fixed: bool) -> int:
    """Pin the pageable ``chunk`` into a temporary and copy it into ``kv`` through raw pointers on
    ``copy_stream``; the fixed scatter waits for the copy before the temporary goes. Returns the
    temporary's address."""
    import torch

    from kvverify.device import ops

    staged = torch.empty((PAGES, PAGE_BYTES), dtype=torch.uint8, pin_memory=True)
    staged.copy_(chunk)
    spin(copy_stream)
    with torch.cuda.stream(copy_stream):
        ops.swap_blocks_batch(*swap_args(staged, kv))
        copied = torch.cuda.Event()
        copied.record(copy_stream)
    if fixed:
        copied.synchronize()
    return staged.data_ptr()


def pin_next_chunk():
    """The next chunk's pinning: a pinned tensor of the same size, written by the host."""
    import torch

    staged = torch.empty((PAGES, PAGE_BYTES), dtype=torch.uint8, pin_memory=True)
    staged.fill_(NEXT_CHUNK)
    return staged


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the KV pages that got the next chunk's bytes."""
    import torch

    fixed = is_fixed(form)
    chunk = torch.full((PAGES, PAGE_BYTES), CHUNK, dtype=torch.uint8)
    kv = device_pages(PAGES)
    copy_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    dropped = scatter_chunk(chunk, kv, copy_stream, fixed)
    following = pin_next_chunk()
    torch.cuda.synchronize()
    reused = following.data_ptr() == dropped
    return witness(kv, CHUNK, None if fixed or reused else NOT_REUSED)
