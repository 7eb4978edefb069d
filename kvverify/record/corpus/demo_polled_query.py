"""Completion learned by polling ``Event.query()``: a staging buffer reused after a poll that said "not yet".

Source: kvverify's own demo offload handler (``kvverify.record.demo``, docs/record.md), whose
worker finds finished transfers by polling their end events, never by a blocking synchronize; the
corpus lists "completion learned by polling ``Event.query()``: ordered only when it returned true"
among its hazard classes (``HAZARDS``). Root cause: a handler that polls a load's end event and
refills the load's pinned staging buffer whatever the answer: a poll that returned False orders
nothing, and the pending copy reads the next batch's bytes. The fix polls until the answer is True.

Re-created: a batched swap loads the staging buffer into a KV block behind a spin (the loads queued
ahead); the handler polls once and refills the buffer. The swap reads in ``STREAM`` order, after the
spin, where the refill has landed: the demo's loads use ``ANY``, which a driver may serve by reading
at the call, before the refill, and then the device would not show the race (the recording still does).
"""

from __future__ import annotations

import time

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
    PAGES,
    device_pages,
    is_fixed,
    pinned_pages,
    spin,
    swap_args,
    witness,
)

CASE = Case(
    name="demo-polled-query", source="kvverify.record.demo", url="docs/record.md",
    root_cause="the handler refills a staging buffer after polling its load's end event, whatever the poll said",
    hazard="polling", capture="recorded", kind="WAR", pair=("load", "refill"),
    witness="pages of the loaded block that hold the next batch's bytes", module=__name__)

BATCH, NEXT_BATCH = 0x61, 0x62
POLL_S = 20e-6


def load(staging, kv, load_stream):
    """Load ``staging`` into ``kv`` on ``load_stream``; return the load's end event."""
    import torch

    from kvverify.device import ops

    spin(load_stream)
    with torch.cuda.stream(load_stream):
        ops.swap_blocks_batch(*swap_args(staging, kv))
        loaded = torch.cuda.Event()
        loaded.record(load_stream)
    return loaded


def refill(staging, loaded, fixed: bool) -> None:
    """Poll ``loaded`` and write the next batch into ``staging``; the fixed handler polls until the
    load is complete."""
    complete = loaded.query()
    while fixed and not complete:
        time.sleep(POLL_S)
        complete = loaded.query()
    staging.fill_(NEXT_BATCH)


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the loaded pages that got the next batch."""
    import torch

    fixed = is_fixed(form)
    staging, kv = pinned_pages(PAGES, BATCH), device_pages(PAGES)
    load_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    loaded = load(staging, kv, load_stream)
    refill(staging, loaded, fixed)
    torch.cuda.synchronize()
    return witness(kv, BATCH)
