"""vllm-project/vllm#45704: stores issued from a copy thread, host bookkeeping taken for device ordering.

Public source: https://github.com/vllm-project/vllm/issues/45704 (closed), fixed by
https://github.com/vllm-project/vllm/pull/46278 (merged). Root cause: the SimpleCPUOffloadConnector
stored a block once the scheduler had confirmed its tokens, a host-side count one step late, and
took that for the KV write being done; nothing on the device ordered the store after the compute
stream, and under async execution the host runs ahead of the GPU. Its copy backend also read every
source in ``ANY`` order. The fix records a compute-done event in ``get_finished()`` and makes the
store wait on it (stores in ``STREAM`` order). The report speaks of a separate store stream; the
worker thread that issues the copies is the copy backend's (its source imports ``threading`` and
``queue``), so the thread here follows the code, not the report's words.

Re-created: the compute stream writes a block behind a spin; the main thread hands the store to a
copy thread through a queue, which issues a ``cuMemcpyBatchAsync`` through cuda-python. The
recording follows the copy thread (started while it runs), sees its driver call where Python makes
it, and orders the thread's work by the queue's lock and the compute event alone: the host's
confirmation is no device ordering.
"""

from __future__ import annotations

from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.support import (
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
    name="vllm-45704", source="vllm-project/vllm#45704", url="https://github.com/vllm-project/vllm/issues/45704",
    root_cause="a copy thread stores a block the scheduler confirmed on the host, with no device event from compute",
    hazard="worker-thread", capture="recorded", kind="RAW", pair=("write_kv", "store"),
    witness="host pages of the store that do not hold the bytes compute wrote", module=__name__)

WRITTEN = 0x5B


def write_kv(kv, compute) -> None:
    """The model writes ``kv`` on ``compute`` behind the rest of its forward pass."""
    import torch

    spin(compute)
    with torch.cuda.stream(compute):
        kv.fill_(WRITTEN)


def get_finished(compute, fixed: bool):
    """The step's end on the main thread: the fixed connector records the event stores wait on; the
    broken one has only the scheduler's count."""
    import torch

    if not fixed:
        return None
    done = torch.cuda.Event()
    done.record(compute)
    return done


def store(job) -> None:
    """On the copy thread: one batched swap of ``kv`` to ``host`` on ``stream``, behind
    ``compute_done`` when there is one; then wait for its end, as the thread reports finished jobs."""
    import torch

    from kvverify.device import ops

    kv, host, stream, compute_done = job
    with torch.cuda.stream(stream):
        if compute_done is not None:
            stream.wait_event(compute_done)
        order = "ANY" if compute_done is None else "STREAM"
        ops.swap_blocks_batch(*swap_args(kv, host), order, backend="cuda-python")
        end = torch.cuda.Event()
        end.record(stream)
    end.synchronize()


def run(form: str) -> Witness:
    """Run ``form`` ("broken" or "fixed") on cuda:0; count the stored pages that missed the write."""
    import torch
    from cuda.bindings import driver, runtime  # noqa: F401  # a first import outlasts the spin: not in the window

    fixed = is_fixed(form)
    kv, host = device_pages(PAGES), pinned_pages(PAGES)
    compute, store_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with Worker(store, name="copy-thread") as copier:
        write_kv(kv, compute)
        copier.put((kv, host, store_stream, get_finished(compute, fixed)))
    torch.cuda.synchronize()
    return witness(host, WRITTEN)
