"""What the recorder's tests share: ``fake``, a fresh CUDA stand-in (``fake_cuda.FakeCuda``) for
each test that asks for it."""

from __future__ import annotations

import pytest
from fake_cuda import FakeCuda


@pytest.fixture
def fake() -> FakeCuda:
    """A CUDA stand-in of its own for the test: no device memory, stream or event of another test."""
    return FakeCuda()
