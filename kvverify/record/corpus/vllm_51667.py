"""vllm-project/vllm#51667: an I/O thread's ``preadv`` into a pinned slot that an H2D copy still reads.

Public source: https://github.com/vllm-project/vllm/pull/51667 (merged). Root cause: the KV
offloading DiskBackend's load reads file data into a pinned staging slot with ``preadv`` and copies
the slot to the GPU, waiting on the slot's previous copy before reusing it; but it kept those
copies' events in a list local to each call and did not drain them before returning, while the
slots persist across calls, so the next call's ``preadv`` could overwrite a slot the previous call's
last copy was still reading. The fix drains the trailing events before the load returns, as the
store path already did.

Re-created: two load calls on an I/O thread, each reading one batch from a file into the same
pinned slot and copying it to its own GPU block behind a spin (the transfers queued ahead). The
recording follows the I/O thread and sees ``os.preadv`` where Python calls it: a host write into the
slot, under the thread's name.
"""

from __future__ import annotations

import os
import tempfile

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
    PAGE_BYTES,
    PAGES,
    Worker,
    device_pages,
    is_fixed,
    pinned_pages,
    spin,
    swap_args,
    witness,
)

CASE = Case(
    name="vllm-51667", source="vllm-project/vllm#51667", url="https://github.com/vllm-project/vllm/pull/51667",
    root_cause="a load returns with its H2D copies pending; the next load's preadv overwrites the pinned slot they read",
    hazard="host-write", capture="recorded", kind="WAR", pair=("load_batch", "read_slot"),
    witness="pages of the first load's GPU block that hold the second batch's bytes", module=__name__)

FIRST, SECOND = 0x1F, 0x2F
SLOT_BYTES = PAGES * PAGE_BYTES


def read_slot(fd: int, offset: int, slot) -> None:
    """Read ``SLOT_BYTES`` of the file at ``offset`` into the pinned ``slot``. Raises OSError on a short read."""
    got = os.preadv(fd, [slot.view(-1).numpy()], offset)
    if got != SLOT_BYTES:
        raise OSError(f"preadv read {got} of {SLOT_BYTES} bytes at offset {offset}")


def load_batch(job) -> None:
    """One load call on the I/O thread: read a batch into the slot, copy it to ``dst`` on ``stream``;
    the fixed backend waits for its copy before it returns."""
    import torch

    from kvverify.device import ops

    fd, offset, slot, dst, stream, fixed = job
    read_slot(fd, offset, slot)
    spin(stream)
    with torch.cuda.stream(stream):
        ops.swap_blocks_batch(*swap_args(slot, dst))
        copied = torch.cuda.Event()
        copied.record(stream)
    if fixed:
        copied.synchronize()


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the first block's pages the second read overwrote."""
    import torch

    fixed = is_fixed(form)
    slot = pinned_pages(PAGES)
    first, second = device_pages(PAGES), device_pages(PAGES)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with tempfile.TemporaryFile() as f:
        f.write(bytes([FIRST]) * SLOT_BYTES + bytes([SECOND]) * SLOT_BYTES)
        f.flush()
        with Worker(load_batch, name="disk-io") as io:
            io.put((f.fileno(), 0, slot, first, stream, fixed))
            io.put((f.fileno(), SLOT_BYTES, slot, second, stream, fixed))
    torch.cuda.synchronize()
    return witness(first, FIRST)
