"""Loading of the compiled extension ``kvverify._C`` and of its ops under ``torch.ops.kvverify``.

The package imports without torch, a GPU or the extension; only the functions below touch
them, and they say what is missing and how to get it.
"""

from __future__ import annotations

import functools
import warnings

from kvverify.errors import ExtensionUnavailableError

BUILD_HINT = (
    "build it on a host with a CUDA build of torch and nvcc: "
    "`pip install --no-build-isolation --no-deps -e .` (the README's first command)"
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
    """Raise ``ExtensionUnavailableError`` unless the extension loads and torch sees a CUDA device
    (the reason as ``cuda_refusal`` gives it); return ``torch``."""
    ops()
    reason = cuda_refusal()
    if reason is not None:
        raise ExtensionUnavailableError(reason)
    import torch

    return torch


NEEDS_CUDA = "work on the device needs a CUDA build of torch on a host with an NVIDIA GPU (README: Install)"


def cuda_refusal() -> str | None:
    """Return None when torch sees a CUDA device, else one line saying why not, in the order a user
    fixes it: torch missing, a build of torch without CUDA, CUDA failing to initialise, no device visible."""
    try:
        import torch
    except ImportError:
        return f"torch is not installed; {NEEDS_CUDA}"
    if torch.version.cuda is None:
        build = "a ROCm" if getattr(torch.version, "hip", None) else "a CPU-only"
        return f"torch {torch.__version__} is {build} build; {NEEDS_CUDA}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            available = torch.cuda.is_available() and torch.cuda.device_count() > 0
        except Exception as exc:  # a broken driver install raises here on some builds
            return f"CUDA could not be initialised ({' '.join(str(exc).split())})"
    if not available:
        return (
            "no CUDA device is visible (torch.cuda.is_available() is False); "
            "run it on a GPU host, or check CUDA_VISIBLE_DEVICES and the driver"
        )
    return None

