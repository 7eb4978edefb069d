"""Shared pytest setup: GPU tests run only where a CUDA device and the extension exist."""

from __future__ import annotations

import functools
import os

import pytest


def pytest_sessionstart(session):
    """Everything the suite makes lives in pytest's temporary folders: ``import torch`` creates
    torch's compile cache, ``$TMPDIR/torchinductor_$USER``, unless told where; tell it before any
    test module (or a process a test starts) imports torch."""
    # the object behind the tmp_path_factory fixture, which no hook is handed before collection
    base = session.config._tmp_path_factory.getbasetemp()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(base / "torchinductor"))


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can (the check probe and bench refuse by)."""
    from kvverify import device

    return device.gpu_refusal()


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or gpu_unavailable_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {reason}"))
