"""vllm-project/vllm#31341: a GPU->CPU store issued on its own stream without waiting for compute.

Public source: https://github.com/vllm-project/vllm/pull/31341 (merged). Root cause: the offloading
connector started its GPU->CPU copies on a transfer stream that nothing ordered after the compute
stream, so a store could read a KV block before the kernel writing it had finished. The fix made the
transfer stream wait on the compute stream before every GPU->CPU copy.

Re-created: the compute stream writes the pages of a KV block behind a spin (the forward pass still
running); the store copies them to pinned host memory, one ``cudaMemcpyAsync`` per page
(``swap_blocks_batch(method="loop")``), the shape of the connector's swap at the time.
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
    name="vllm-31341", source="vllm-project/vllm#31341", url="https://github.com/vllm-project/vllm/pull/31341",
    root_cause="the GPU->CPU store's stream does not wait for the compute stream that writes the KV block",
    hazard="store-order", capture="recorded", kind="RAW", pair=("write_kv", "store"),
    witness="host pages of the store that do not hold the bytes compute wrote", module=__name__)

WRITTEN = 0x5A


def write_kv(kv, compute) -> None:
    """The model writes ``kv`` on ``compute`` behind the rest of its forward pass."""
    import torch

    spin(compute)
    with torch.cuda.stream(compute):
        kv.fill_(WRITTEN)


def store(kv, host, offload, compute, fixed: bool) -> None:
    """Copy ``kv`` to ``host`` on ``offload``; the fixed connector orders the copy after compute."""
    import torch

    from kvverify.device import ops

    with torch.cuda.stream(offload):
        if fixed:
            offload.wait_stream(compute)
        ops.swap_blocks_batch(*swap_args(kv, host), method="loop")


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
    return witness(host, WRITTEN)
