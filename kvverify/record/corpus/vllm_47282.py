"""vllm-project/vllm#47282: a load DMA into a reused block that an earlier request's attention still reads.

Public source: https://github.com/vllm-project/vllm/issues/47282 (open in the stored copy; the fix
PRs #47291 and #50863 were closed, #47324 open; all take the approach re-created here). Root cause:
in the SimpleCPUOffloadConnector, stores waited on a compute-done event but loads did not; a GPU
block freed by the scheduler (host bookkeeping only) and reused at once as a load destination could
be overwritten by the CPU->GPU copy while the previous owner's attention was still reading it. The
fix records one compute-done event per step and makes loads wait on it as stores do.

Re-created: logical reuse inside one large KV tensor. Attention of request A reads a block on the
compute stream behind a spin (a long attention under load); the block goes to request B, whose
cached prefix a batched swap loads into it on the load stream.
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
    name="vllm-47282", source="vllm-project/vllm#47282", url="https://github.com/vllm-project/vllm/issues/47282",
    root_cause="a load into a block freed by host bookkeeping does not wait for the attention still reading it",
    hazard="block-reuse", capture="recorded", kind="WAR", pair=("attend", "load"),
    witness="pages request A's attention read that hold request B's loaded bytes", module=__name__)

A_KV, B_KV = 0x13, 0x77


def attend(block, attended, compute) -> None:
    """Request A's attention over ``block`` on ``compute``: what it read lands in ``attended``."""
    import torch

    spin(compute)
    with torch.cuda.stream(compute):
        attended.copy_(block)


def get_finished(compute):
    """The step's compute-done event (recorded once per step; stores already wait on it)."""
    import torch

    done = torch.cuda.Event()
    done.record(compute)
    return done


def load(host, block, load_stream, compute_done, fixed: bool) -> None:
    """Load request B's prefix ``host`` into ``block`` on ``load_stream``; the fixed connector waits
    on the step's compute-done event first."""
    import torch

    from kvverify.device import ops

    with torch.cuda.stream(load_stream):
        if fixed:
            load_stream.wait_event(compute_done)
        ops.swap_blocks_batch(*swap_args(host, block), "ANY")


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the attended pages the load overwrote first."""
    import torch

    fixed = is_fixed(form)
    kv = device_pages(2 * PAGES, A_KV)
    block = kv[PAGES:]
    host, attended = pinned_pages(PAGES, B_KV), device_pages(PAGES)
    compute, load_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    attend(block, attended, compute)
    done = get_finished(compute)
    # request A finished: the scheduler frees the block and hands it to request B as a load target
    load(host, block, load_stream, done, fixed)
    torch.cuda.synchronize()
    return witness(attended, A_KV)
