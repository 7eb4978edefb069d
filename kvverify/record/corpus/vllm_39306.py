"""vllm-project/vllm#39306: a GPU->CPU store that reads its GPU source in ANY order behind its barrier.

Public source: https://github.com/vllm-project/vllm/pull/39306 (merged), which proposed
``srcAccessOrder=ANY`` for every copy of the offloading handler's batched swap. Root cause: ``ANY``
lets the driver read a copy's source at any time after the call, so the transfer stream's
``wait_stream(compute)`` no longer keeps a store from reading a KV block compute is still writing.
Its review caught this and the merged code kept ``STREAM`` for stores (``ANY`` for loads only), so
the hazard did not ship there. It shipped in the SimpleCPUOffloadConnector's copy backend, which
used ``ANY`` for every transfer: vllm-project/vllm#45704 names it as a cause, and its fix
vllm-project/vllm#46278 says so (the missing compute wait of that report is case ``vllm-45704``).
The fix here is the merged one: ``STREAM`` for the store.

Re-created: a store behind a correct ``wait_stream(compute)``, so that only the order can let the
read run early. A driver that keeps stream order for ``ANY`` (what kvverify saw on an H200) shows
no corruption: the race stands by the API's contract, not by this device.
"""

from __future__ import annotations

from dataclasses import replace

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
    name="vllm-39306", source="vllm-project/vllm#39306", url="https://github.com/vllm-project/vllm/pull/39306",
    root_cause="a store behind wait_stream(compute) reads its GPU source with ANY, which the wait does not order",
    hazard="store-order", capture="recorded", kind="RAW", pair=("write_kv", "store"),
    witness="host pages of the store that do not hold the bytes compute wrote", module=__name__)

WRITTEN = 0x3E
IN_ORDER = "this driver read the ANY source in stream order: nothing to see here, the race stands by the API's contract"


def write_kv(kv, compute) -> None:
    """The model writes ``kv`` on ``compute`` behind the rest of its forward pass."""
    import torch

    spin(compute)
    with torch.cuda.stream(compute):
        kv.fill_(WRITTEN)


def store(kv, host, offload, compute, fixed: bool) -> None:
    """One batched swap of ``kv`` to ``host`` on ``offload``, after waiting on compute; the source is
    read in ``ANY`` order (broken) or ``STREAM`` order (fixed)."""
    import torch

    from kvverify.device import ops

    with torch.cuda.stream(offload):
        offload.wait_stream(compute)
        ops.swap_blocks_batch(*swap_args(kv, host), "STREAM" if fixed else "ANY")


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the stored pages that missed the write."""
    import torch

    fixed = is_fixed(form)
    kv, host = device_pages(PAGES), pinned_pages(PAGES)
    compute, offload = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    write_kv(kv, compute)
    store(kv, host, offload, compute, fixed)
    torch.cuda.synchronize()
    seen = witness(host, WRITTEN)
    return seen if fixed or seen.corrupted else replace(seen, note=IN_ORDER)
