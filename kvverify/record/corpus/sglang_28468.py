"""sgl-project/sglang#28468: host slots evicted while an async D2H backup still writes them.

Public source: https://github.com/sgl-project/sglang/pull/28468 (closed in the stored copy; merge
not shown), its second fix. Root cause: in HiCache's ``write_back`` eviction sweep, the D2H backups
are no longer drained node by node but checked once at the end of the sweep, and nothing held the
host slots a backup was writing: a later node's eviction in the same sweep could free those slots
and hand them to a new owner while the earlier backup still wrote into them. The fix pins the
destination slots (``host_lock_ref``) until the backup is acknowledged, and eviction skips pinned
slots.

Re-created: the host pool is the program's own, a pinned tensor of slots. A backup copies device
pages into a slot behind a spin (the sweep's earlier backups); eviction hands the slot to a new owner
(``kvverify.record.reuse``: the recorder cannot know the program's own pool), which fills it on the
host. The fixed eviction waits until the backup's end event is seen before handing the slot over.
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
    name="sglang-28468", source="sgl-project/sglang#28468", url="https://github.com/sgl-project/sglang/pull/28468",
    root_cause="eviction frees and reuses host slots while the sweep's async D2H backup still writes them",
    hazard="release", capture="recorded", kind="FREE", pair=("write_backup", "evict_host"),
    witness="pages of the slot's new owner that the old backup overwrote", module=__name__)

BACKED_UP, NEW_OWNER = 0x3C, 0x7E


def write_backup(pages, slot, write_stream):
    """Back device ``pages`` up into the host ``slot`` on ``write_stream``; return the backup's end event."""
    import torch

    spin(write_stream)
    with torch.cuda.stream(write_stream):
        slot.copy_(pages, non_blocking=True)
        done = torch.cuda.Event()
        done.record(write_stream)
    return done


def evict_host(slot, backup_done, fixed: bool) -> None:
    """Free ``slot`` to the host pool, which hands it to a new owner. The fixed pool keeps a slot
    with a backup in flight until the sweep's end sees that backup finish."""
    from kvverify import record as kvrecord

    if fixed:
        backup_done.synchronize()
    kvrecord.reuse(slot, name="host slot")


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the new owner's pages the backup overwrote."""
    import torch

    fixed = is_fixed(form)
    pages = device_pages(PAGES, BACKED_UP)
    host_pool = pinned_pages(2 * PAGES)
    slot = host_pool[:PAGES]
    write_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    done = write_backup(pages, slot, write_stream)
    evict_host(slot, done, fixed)
    slot.fill_(NEW_OWNER)  # the new owner (a prefetch from storage) fills the slot on the host
    torch.cuda.synchronize()
    return witness(slot, NEW_OWNER)
