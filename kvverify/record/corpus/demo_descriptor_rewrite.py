"""The demo's ``descriptor-rewrite`` form: the host rewrites a pinned descriptor while its H2D may be pending.

Source: kvverify's own demo offload handler (``kvverify.record.demo``, docs/record.md, "The demo
offload handler"), hazard H3 of the design. Root cause: the model runner stages each step's block
ids in a pinned descriptor buffer and copies them to the device on the compute stream; when the
compute stream is behind, the host rewrites the buffer for the next step before the previous
step's copy has read it, and that step attends over the next step's blocks. The fix waits on the
previous copy's end event before rewriting the buffer.

Re-created: the compute stream is held by a spin (the previous step's forward pass); two steps each
write their block ids into the descriptor, copy it to the device and gather their KV pages through
it.
"""

from __future__ import annotations

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
    DEVICE,
    PAGES,
    device_pages,
    is_fixed,
    spin,
    witness,
)

CASE = Case(
    name="demo-descriptor-rewrite", source="kvverify.record.demo", url="docs/record.md",
    root_cause="the host rewrites the pinned block-id descriptor while the previous step's H2D copy may still read it",
    hazard="host-write", capture="recorded", kind="WAR", pair=("stage_descriptor", "stage_descriptor"),
    witness="pages the first step gathered that belong to the second step", module=__name__)

FIRST_KV, SECOND_KV = 0x51, 0x52


def stage_descriptor(descriptor, block_ids, ids, compute, previous_copy, fixed: bool):
    """Write this step's ``ids`` into the pinned ``descriptor`` and copy it to ``block_ids`` on
    ``compute``; the fixed runner first waits for the previous step's copy. Returns this copy's end event."""
    import torch

    if fixed and previous_copy is not None:
        previous_copy.synchronize()
    descriptor.copy_(ids)
    with torch.cuda.stream(compute):
        block_ids.copy_(descriptor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(compute)
    return copied


def attend(pool, block_ids, gathered, compute) -> None:
    """The step's attention gathers the KV pages ``block_ids`` names."""
    import torch

    with torch.cuda.stream(compute):
        torch.index_select(pool, 0, block_ids, out=gathered)


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the first step's pages that are the second step's."""
    import torch

    fixed = is_fixed(form)
    pool = torch.cat([device_pages(PAGES, FIRST_KV), device_pages(PAGES, SECOND_KV)])
    descriptor = torch.zeros(PAGES, dtype=torch.int64, pin_memory=True)
    block_ids = torch.zeros(PAGES, dtype=torch.int64, device=DEVICE)
    steps = [torch.arange(PAGES, dtype=torch.int64), torch.arange(PAGES, 2 * PAGES, dtype=torch.int64)]
    gathered = [device_pages(PAGES), device_pages(PAGES)]
    compute = torch.cuda.Stream()
    torch.cuda.synchronize()
    spin(compute)
    copied = None
    for ids, out in zip(steps, gathered):
        copied = stage_descriptor(descriptor, block_ids, ids, compute, copied, fixed)
        attend(pool, block_ids, out, compute)
    torch.cuda.synchronize()
    return witness(gathered[0], FIRST_KV)
