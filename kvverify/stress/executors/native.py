"""The native executor: every swap is ``swap_blocks_batch`` exactly as a user calls it,
in the cell's order, on the transfer's stream: the driver as it is."""

from __future__ import annotations

from kvverify.stress.executors.base import Executor, SwapData
from kvverify.terms import NATIVE


class NativeExecutor(Executor):
    name = NATIVE
    method = "batch"  # the copy path (kvverify.device.ops.METHODS)

    def _swap(self, stream, data: SwapData, order: str) -> None:
        from kvverify.device import ops

        with self.torch.cuda.stream(stream):
            ops.swap_blocks_batch(*data.cpu, order, method=self.method)
