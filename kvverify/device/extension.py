"""Loading of the compiled extension ``kvverify._C`` and of its ops under ``torch.ops.kvverify``.

The package imports without torch, a GPU or the extension; only the functions below touch
them, and they say what is missing and how to get it.
"""

from __future__ import annotations

import functools

from kvverify.errors import ExtensionUnavailableError

BUILD_HINT = (
    "build it on a host with a CUDA build of torch and nvcc: "
    "`pip install --no-build-isolation --no-deps -e .` (KVVERIFY_REQUIRE_EXTENSION=1 makes a skipped build fail loudly)"
)


@functools.cache
def load_error() -> str | None:
    """Import torch and ``kvverify._C`` once; return None on success, else why it failed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed"
    try:
        from kvverify import _C  # noqa: F401  (registers torch.ops.kvverify.*)
    except ImportError as exc:
        return f"the CUDA extension kvverify._C is not built ({exc}); {BUILD_HINT}"
    return None


def ops():
    """Return ``torch.ops.kvverify``, raising ``ExtensionUnavailableError`` when it cannot load."""
    reason = load_error()
    if reason is not None:
        raise ExtensionUnavailableError(reason)
    import torch

    return torch.ops.kvverify


def require_cuda_device():
    """Raise ``ExtensionUnavailableError`` unless torch sees a CUDA device; return ``torch``."""
    ops()
    import torch

    if not torch.cuda.is_available():
        raise ExtensionUnavailableError(
            "no CUDA device is visible to torch (torch.cuda.is_available() is False); "
            "run this on a GPU host, or check CUDA_VISIBLE_DEVICES and the driver"
        )
    return torch
