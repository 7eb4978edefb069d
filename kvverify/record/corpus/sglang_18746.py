"""sgl-project/sglang#18746: a schedule stream rewriting index slots the forward still reads.

Public source: https://github.com/sgl-project/sglang/pull/18746 (closed; it fixes #18744). Root
cause: with the overlap schedule, the per-request table of KV slot indices (``req_to_token``) is
written on the schedule stream and read by the forward pass on the forward stream; when a request
finishes, its row goes to a new request, whose indices the schedule stream writes for the next
iteration while the current forward may still read the row. The stored text of #18746 stops before
its changes; the fix that was merged is https://github.com/sgl-project/sglang/pull/26380: the
schedule stream waits on the forward stream at the top of each iteration
(``schedule_stream.wait_stream(forward_stream)``), which is the fix here.

Re-created: an index table (metadata, not KV) and a pool of KV pages in one tensor. The forward
waits for the schedule stream's write of request X's row, spins (the layers before attention) and
gathers X's pages through the row; the schedule stream then writes request Y's indices into it.
Both are kernels (the engine writes the table with device kernels too), on a buffer no copy and no
host access touches: the race is between two kernels on two streams.
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
    name="sglang-18746", source="sgl-project/sglang#18746", url="https://github.com/sgl-project/sglang/pull/18746",
    root_cause="the schedule stream rewrites a freed request's index row while the forward still gathers through it",
    hazard="block-reuse", capture="recorded", kind="WAR", pair=("forward", "prepare_for_decode"),
    witness="pages attention gathered for request X that are request Y's", module=__name__)

X_KV, Y_KV = 0x0A, 0x0B
ROW = 1  # request X's pool index, handed to request Y once X finishes


def prepare_for_decode(table, slots, schedule, forward_stream, fixed: bool) -> None:
    """Write a request's KV slot indices into row ``ROW`` of ``table`` on ``schedule``; the fixed
    scheduler first waits for the forward pass that may still read the table."""
    import torch

    with torch.cuda.stream(schedule):
        if fixed:
            schedule.wait_stream(forward_stream)
        table[ROW].copy_(slots)


def forward(table, pool, gathered, forward_stream, schedule) -> None:
    """The forward pass: after the schedule stream's write, attention gathers the pages row
    ``ROW`` of ``table`` names from ``pool`` into ``gathered``."""
    import torch

    forward_stream.wait_stream(schedule)
    spin(forward_stream)
    with torch.cuda.stream(forward_stream):
        torch.index_select(pool, 0, table[ROW], out=gathered)


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the gathered pages that are not request X's."""
    import torch

    fixed = is_fixed(form)
    pool = torch.cat([device_pages(PAGES, X_KV), device_pages(PAGES, Y_KV)])
    table = torch.zeros((4, PAGES), dtype=torch.int64, device=DEVICE)
    x_slots = torch.arange(PAGES, dtype=torch.int64, device=DEVICE)
    y_slots = torch.arange(PAGES, 2 * PAGES, dtype=torch.int64, device=DEVICE)
    gathered = device_pages(PAGES)
    schedule, forward_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    prepare_for_decode(table, x_slots, schedule, forward_stream, fixed)  # iteration N
    forward(table, pool, gathered, forward_stream, schedule)
    # the previous iteration's results show request X finished: its row goes to request Y
    prepare_for_decode(table, y_slots, schedule, forward_stream, fixed)  # iteration N + 1
    torch.cuda.synchronize()
    return witness(gathered, X_KV)
