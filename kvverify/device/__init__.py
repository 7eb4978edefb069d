"""Everything that touches the GPU: the batched swap op, extension loading, its cuda-python twin, the
harness kernels, exact-size host memory, the block pattern and the platform's versions.

Importing this package loads nothing heavy; each module imports torch where it is used. Imports flow
one way inside it: the modules that use the extension import its loader (``extension``), never the
reverse, and ``gpu_refusal`` lives here because it asks about all of them."""

from __future__ import annotations


def gpu_refusal() -> str | None:
    """Return None when torch sees a CUDA device and kvverify's GPU modules load, else one line saying why not.

    The checks run cheapest-first and in the order a user fixes them: those of ``extension.cuda_refusal``,
    then the compiled extension, the op and kernel wrappers (importing them registers their ops' fake
    implementations).
    """
    from kvverify.device import extension

    reason = extension.cuda_refusal()
    if reason is not None:
        return reason
    reason = extension.load_error()
    if reason is not None:
        return reason
    try:
        import kvverify.device.host_memory  # noqa: F401
        import kvverify.device.kernels  # noqa: F401
        import kvverify.device.ops  # noqa: F401
    except ImportError as exc:
        return f"a kvverify GPU module is missing ({' '.join(str(exc).split())})"
    return None
