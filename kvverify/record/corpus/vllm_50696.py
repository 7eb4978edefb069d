"""vllm-project/vllm#50696: a CPU->GPU load not ordered after compute's zero-fill of fresh blocks.

Public source: https://github.com/vllm-project/vllm/pull/50696 (merged). Root cause: on models whose
fresh KV blocks are zeroed on the compute stream (mamba layers), the offloading handler's loads ran
on their own stream with no wait on compute; under async scheduling a zeroing shipped by an earlier
step could land after the load into the same block and wipe it, and the request attended over
zeros. The fix made the transfer stream wait on the compute stream for loads too, not only stores.

Re-created: the zero-fill of a fresh block queued on compute behind a spin (the earlier step's
forward pass), then a batched swap loads a cached prefix into the block, sources read in ``ANY``
order as the handler's loads are.
"""

from __future__ import annotations

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
    name="vllm-50696", source="vllm-project/vllm#50696", url="https://github.com/vllm-project/vllm/pull/50696",
    root_cause="a load into a fresh block does not wait for the compute stream's zero-fill of that block",
    hazard="load-order", capture="recorded", kind="WAW", pair=("zero_fresh", "load"),
    witness="pages of the fresh block that do not hold the loaded prefix", module=__name__)

STALE, CACHED = 0x99, 0x66


def zero_fresh(fresh, compute) -> None:
    """Zero the freshly allocated block on ``compute``, behind the earlier step's forward pass."""
    import torch

    spin(compute)
    with torch.cuda.stream(compute):
        fresh.zero_()


def load(host, fresh, load_stream, compute, fixed: bool) -> None:
    """Load the cached prefix ``host`` into ``fresh`` on ``load_stream``; the fixed handler waits on
    compute first."""
    import torch

    from kvverify.device import ops

    with torch.cuda.stream(load_stream):
        if fixed:
            load_stream.wait_stream(compute)
        ops.swap_blocks_batch(*swap_args(host, fresh), "ANY")


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the loaded pages the zero-fill wiped."""
    import torch

    fixed = is_fixed(form)
    kv = device_pages(2 * PAGES, STALE)
    fresh = kv[PAGES:]  # a block of the one KV tensor, just handed to a new request
    host = pinned_pages(PAGES, CACHED)
    compute, load_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    zero_fresh(fresh, compute)
    load(host, fresh, load_stream, compute, fixed)
    torch.cuda.synchronize()
    return witness(fresh, CACHED)
