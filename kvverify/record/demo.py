"""An engine-style CPU offload handler, in its safe form and with each mistake public race reports
describe (docs/record-design.md, "The demo offload handler"): what kvverify record is shown on.

The handler has the shape of a serving engine's CPU offload worker: the KV cache is one tensor
per layer on the GPU and one pinned tensor per layer on the host; every transfer (a store, GPU to
CPU, or a load, CPU to GPU) takes the next stream of a pool, waits on the previous transfer's end
event (transfers stay in order), moves every layer's blocks with one batched swap
(``kvverify::swap_blocks_batch``) and records its own end event; completion is found by polling
``Event.query()``. The model runner writes the step's KV and attends over it on the compute
stream, after copying the step's block ids to the device from a pinned descriptor buffer, and
zero-fills freshly allocated blocks behind the model's forward step (a matmul per layer when
``Shape.hidden`` is set).

Mistakes (``MISTAKES``), each a change of one line of the safe form:

- ``store-any``: stores switched to ``ANY`` (H1): the DMA may read a block before the compute
  stream's write lands, whatever the store stream waits on;
- ``load-no-wait``: loads issued with no wait on compute while compute zero-fills the freshly
  allocated blocks they load into (H2, WAW: the request attends over zeros);
- ``load-into-read``: a load into a block that attention still reads (H2, WAR);
- ``descriptor-rewrite``: the pinned descriptor buffer rewritten by the host for the next step
  while its host-to-device copy may still be pending (H3);
- ``aten-race``: a control both this recorder and PyTorch's CUDA Stream Sanitizer see: a side
  stream writes a block attention reads, with no synchronization at all.

``python -m kvverify.record.demo --mistake store-any`` runs one (``kvverify record -- python -m
kvverify.record.demo ...`` finds its race); lines the GPU tests look for end in ``# <- NAME``.
Needs a CUDA device and the extension ``kvverify._C``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvverify.device import extension
from kvverify.terms import SrcAccessOrder

MISTAKES = ("store-any", "load-no-wait", "load-into-read", "descriptor-rewrite", "aten-race")


@dataclass(frozen=True)
class Shape:
    """The cache and the loop: ``layers`` tensors of ``gpu_blocks`` (``cpu_blocks``) blocks of
    ``block_bytes`` bytes; each step stores and loads ``blocks_per_transfer`` blocks per layer
    with at most ``in_flight`` transfers pending."""

    layers: int = 4
    gpu_blocks: int = 36
    cpu_blocks: int = 32
    block_bytes: int = 4096
    blocks_per_transfer: int = 2
    in_flight: int = 4
    steps: int = 3
    hidden: int = 0  # the model's own work: per layer, (tokens, hidden) @ (hidden, hidden) in fp16; 0: none
    tokens: int = 256

    def __post_init__(self) -> None:
        n = self.blocks_per_transfer
        # each step takes three runs of n blocks; a run comes back two steps later at the earliest,
        # once the store that read it was seen complete
        if self.gpu_blocks % (3 * n) or self.gpu_blocks < 6 * n:
            raise ValueError(f"gpu_blocks must be a multiple of {3 * n}, at least {6 * n}; got {self.gpu_blocks}")
        if self.cpu_blocks % n or self.cpu_blocks < 2 * n:
            raise ValueError(f"cpu_blocks must be a multiple of {n}, at least {2 * n}; got {self.cpu_blocks}")


class Cuda:
    """The device the demo runs on, through torch.cuda (the CPU tests pass a stand-in with the same
    methods: ``tests/record/fake_cuda.py``)."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.swap = extension.ops().swap_blocks_batch  # (src_ptrs, dst_ptrs, sizes, src_access_order)

    def zeros(self, *shape: int, dtype=torch.uint8) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def pinned(self, *shape: int, dtype=torch.uint8) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class OffloadHandler:
    """Stores and loads KV blocks between ``gpu_caches`` and ``cpu_caches`` (lists of uint8 tensors
    ``(blocks, block_bytes)``, one per layer; CPU ones pinned), one batched swap per transfer, on
    a pool of ``streams`` streams; stores read in ``store_order`` behind the ``compute`` stream."""

    def __init__(self, cuda: Cuda, gpu_caches: list[torch.Tensor], cpu_caches: list[torch.Tensor], compute, *,
                 streams: int, store_order: SrcAccessOrder = SrcAccessOrder.STREAM) -> None:
        self.cuda = cuda
        self.block_bytes = gpu_caches[0].shape[1]
        self.gpu_bases = np.array([t.data_ptr() for t in gpu_caches], dtype=np.int64)
        self.cpu_bases = np.array([t.data_ptr() for t in cpu_caches], dtype=np.int64)
        self.compute = compute
        self.pool = [cuda.new_stream() for _ in range(streams)]
        self.store_order = store_order
        self.turn = 0
        self.last_end = None
        self.pending: dict[int, object] = {}

    def _pointers(self, bases: np.ndarray, blocks) -> torch.Tensor:
        ptrs = bases[:, None] + np.asarray(blocks, dtype=np.int64)[None, :] * self.block_bytes
        return torch.from_numpy(ptrs.reshape(-1))

    def transfer_async(self, job: int, store: bool, src_blocks, dst_blocks, *, wait_compute: bool = True):
        """Issue one transfer of blocks ``src_blocks`` of every layer to ``dst_blocks``; return its
        end event. ``wait_compute``: the stream waits on the compute stream first (stores always)."""
        stream = self.pool[self.turn % len(self.pool)]
        self.turn += 1
        if store:
            src, dst = self._pointers(self.gpu_bases, src_blocks), self._pointers(self.cpu_bases, dst_blocks)
        else:
            src, dst = self._pointers(self.cpu_bases, src_blocks), self._pointers(self.gpu_bases, dst_blocks)
        sizes = torch.full((len(src),), self.block_bytes, dtype=torch.int64)
        with self.cuda.stream(stream):
            if self.last_end is not None:
                stream.wait_event(self.last_end)  # transfers complete in issue order
            if store or wait_compute:
                stream.wait_stream(self.compute)  # <- wait on compute
            # loads read host blocks nothing writes while they are pending: ANY is safe for them
            order = self.store_order if store else SrcAccessOrder.ANY
            self.cuda.swap(src, dst, sizes, int(order))  # <- swap
            end = self.cuda.new_event()
            end.record(stream)
        self.last_end = end
        self.pending[job] = end
        return end

    def wait(self, job: int) -> None:
        """Poll ``job``'s end event until it reports completion (as an engine's worker finds
        finished transfers: ``Event.query()``, never a blocking synchronize)."""
        event = self.pending.pop(job)
        while not event.query():  # <- poll
            time.sleep(20e-6)


class Engine:
    """A model runner around the handler (see ``step``) on ``cuda`` (default: ``Cuda()``)."""

    def __init__(self, shape: Shape, mistake: str | None = None, cuda: Cuda | None = None) -> None:
        if mistake is not None and mistake not in MISTAKES:
            raise ValueError(f"unknown mistake {mistake!r}; use one of {', '.join(MISTAKES)}")
        self.shape, self.mistake = shape, mistake
        self.cuda = cuda = cuda or Cuda()
        self.gpu = [cuda.zeros(shape.gpu_blocks, shape.block_bytes) for _ in range(shape.layers)]
        self.cpu = [cuda.pinned(shape.cpu_blocks, shape.block_bytes) for _ in range(shape.layers)]
        for t in self.cpu:
            t.fill_(7)
        self.compute, self.side = cuda.new_stream(), cuda.new_stream()
        order = SrcAccessOrder.ANY if mistake == "store-any" else SrcAccessOrder.STREAM
        self.handler = OffloadHandler(cuda, self.gpu, self.cpu, self.compute, streams=shape.in_flight,
                                      store_order=order)
        self.descriptor = cuda.pinned(shape.blocks_per_transfer, dtype=torch.int64)
        self.block_ids = cuda.zeros(shape.blocks_per_transfer, dtype=torch.int64)
        self.scores = cuda.zeros(1, dtype=torch.int64)
        if shape.hidden:
            self.hidden = [cuda.zeros(shape.tokens, shape.hidden, dtype=torch.float16) for _ in range(2)]
            self.weight = cuda.zeros(shape.hidden, shape.hidden, dtype=torch.float16)
        self.descriptor_copied = None
        self.jobs = 0
        self.last_store: int | None = None
        # what the blocks hold when every transfer is right: CPU blocks, and the GPU blocks a load filled
        self.cpu_value = dict.fromkeys(range(shape.cpu_blocks), 7)
        self.expected: dict[int, int] = {}
        cuda.synchronize()  # the caches were made on the current stream, not on compute

    def _stage_descriptor(self, blocks) -> None:
        if self.descriptor_copied is not None and self.mistake != "descriptor-rewrite":
            self.descriptor_copied.synchronize()  # the previous step's copy has read it
        self.descriptor.copy_(torch.as_tensor(blocks, dtype=torch.int64))  # <- descriptor write
        with self.cuda.stream(self.compute):
            self.block_ids.copy_(self.descriptor, non_blocking=True)  # <- descriptor copy
            self.descriptor_copied = self.cuda.new_event()
            self.descriptor_copied.record(self.compute)

    def _zero_fresh(self, blocks) -> None:
        with self.cuda.stream(self.compute):
            for layer in self.gpu:
                layer[blocks[0]:blocks[-1] + 1].zero_()  # <- zero-fill

    def _write_kv(self, blocks, value: int) -> None:
        with self.cuda.stream(self.compute):
            for layer in self.gpu:
                layer[blocks[0]:blocks[-1] + 1].fill_(value)  # <- write kv

    def _attend(self, blocks) -> None:
        with self.cuda.stream(self.compute):
            for layer in self.gpu:
                torch.sum(layer[blocks[0]:blocks[-1] + 1], dim=(0, 1), dtype=torch.int64, out=self.scores[0])  # <- attend

    def _forward(self) -> None:
        """The model's own work, which touches no KV block: one matmul per layer (none when
        ``shape.hidden`` is 0)."""
        if not self.shape.hidden:
            return
        with self.cuda.stream(self.compute):
            for _ in self.gpu:
                torch.mm(self.hidden[0], self.weight, out=self.hidden[1])
                self.hidden.reverse()

    def _transfer(self, store: bool, src, dst, wait_compute: bool = True) -> int:
        self.jobs += 1
        if len(self.handler.pending) >= self.shape.in_flight:
            self.handler.wait(min(self.handler.pending))
        end = self.handler.transfer_async(self.jobs, store, src, dst, wait_compute=wait_compute)
        if not store:
            self.compute.wait_event(end)  # attention over loaded blocks waits for the load (H6)
            self.expected.update((g, self.cpu_value[c]) for g, c in zip(dst, src))
        return self.jobs

    def step(self, k: int) -> None:
        """Step ``k`` on three runs of blocks: ``a`` (KV written, attended, stored), ``fresh``
        (newly allocated: zero-filled behind the forward step, then a cached prefix loaded into
        it) and ``reused`` (freed by a finished request whose attention is still queued, then
        loaded into)."""
        n = self.shape.blocks_per_transfer
        first = 3 * n * k % self.shape.gpu_blocks
        a = list(range(first, first + n))
        fresh = [b + n for b in a]
        reused = [b + 2 * n for b in a]
        stored = [(n * k + i) % self.shape.cpu_blocks for i in range(n)]
        # what is loaded: the blocks the previous step stored, once that store is complete;
        # at first, blocks the host filled
        source = [(n * (k - 1) + i) % self.shape.cpu_blocks for i in range(n)] if k else \
            [self.shape.cpu_blocks - n + i for i in range(n)]
        for b in a + fresh:
            self.expected.pop(b, None)  # written again this step
        self._stage_descriptor(a)
        self._write_kv(a, k + 1)
        self._attend(a)
        previous, self.last_store = self.last_store, self._transfer(True, a, stored)
        self.cpu_value.update(dict.fromkeys(stored, k + 1))
        if previous is not None:
            self.handler.wait(previous)
        # the forward step the zero-fill queues behind: a load that does not wait on compute can
        # land first, and the zero-fill then wipes it
        self._forward()
        self._zero_fresh(fresh)
        self._transfer(False, source, fresh, wait_compute=self.mistake != "load-no-wait")
        self._attend(reused)
        if self.mistake == "aten-race":
            with self.cuda.stream(self.side):
                for layer in self.gpu:
                    layer[reused[0]:reused[-1] + 1].add_(1)  # <- side write
        self._transfer(False, source, reused, wait_compute=self.mistake != "load-into-read")

    def run(self) -> None:
        for k in range(self.shape.steps):
            self.step(k)
        for job in sorted(self.handler.pending):
            self.handler.wait(job)
        self.cuda.synchronize()

    def corrupted_loads(self) -> int:
        """Pages (one block of one layer) of the last loads into each GPU block that do not hold what
        a right run puts there, checked on the host after the run: a zero-fill that landed after
        its load, a store that read a block before its write (what it stored is loaded later)."""
        bad = 0
        for block, value in self.expected.items():
            bad += sum(int(not bool((layer[block] == value).all())) for layer in self.gpu)
        return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvverify.record.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mistake", choices=MISTAKES, default=None, help="run the handler with this mistake")
    parser.add_argument("--steps", type=int, default=Shape.steps,
                        help=f"offload steps, each storing and loading blocks of every layer (default {Shape.steps})")
    parser.add_argument("--layers", type=int, default=Shape.layers,
                        help=f"layers, one KV tensor each on the GPU and the host (default {Shape.layers})")
    args = parser.parse_args(argv)
    engine = Engine(Shape(layers=args.layers, steps=args.steps), args.mistake)
    engine.run()
    print(f"demo: {args.mistake or 'safe form'}: {args.steps} steps, {engine.corrupted_loads()} corrupted loaded pages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
