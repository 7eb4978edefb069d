"""The kernel executor: every swap is ``swap_blocks_batch(..., method="kernel")``, thread blocks
copying the pages through UVA on the transfer's stream. The copy is stream-ordered on both sides,
so its contract is ``STREAM``'s: the planner gives it ``STREAM`` cells only, and only with host
memory a kernel can reach (``kvverify.stress.planning.runs``)."""

from __future__ import annotations

from kvverify.stress.executors.native import NativeExecutor
from kvverify.terms import KERNEL


class KernelExecutor(NativeExecutor):
    name = KERNEL
    method = "kernel"
