"""GPU executors of a scenario's program: ``native`` (the driver as it is), ``adversarial``
(each source read at an extreme its order allows) and ``kernel`` (the SM-kernel copy path).
See ``base`` for what they share."""

from __future__ import annotations

from kvverify.stress.executors.base import Executor, HarnessError, Settings, TrialResult
from kvverify.terms import ADVERSARIAL, EXECUTORS, KERNEL, NATIVE


def make(name: str, pools, settings: Settings) -> Executor:
    if name == NATIVE:
        from kvverify.stress.executors.native import NativeExecutor

        return NativeExecutor(pools, settings)
    if name == ADVERSARIAL:
        from kvverify.stress.executors.adversarial import AdversarialExecutor

        return AdversarialExecutor(pools, settings)
    if name == KERNEL:
        from kvverify.stress.executors.kernel import KernelExecutor

        return KernelExecutor(pools, settings)
    raise ValueError(f"unknown executor {name!r}; use one of {', '.join(EXECUTORS)}")


__all__ = ["Executor", "HarnessError", "Settings", "TrialResult", "make"]
