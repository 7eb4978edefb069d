"""Python wrappers of the harness kernels (``torch.ops.kvverify.*``, ``csrc/harness/harness_kernels.cu``).

A *block* is ``block_bytes`` bytes (a positive multiple of 8) at a raw address. Addresses are
given as ``block_ptrs``: a 1-D int64 tensor (CUDA, or CPU), a numpy integer array, or a sequence
of ints. They may point into device memory or into pinned / registered host memory, which the
kernels reach through unified virtual addressing (the host address is the device address).

Every function launches on the current torch stream of the target device, or on ``stream=``
when given, and returns without synchronising. The target device is ``block_ptrs``' device when
it is a CUDA tensor, else ``stream``'s, else the current device.

Host-side addresses (numpy, lists, CPU tensors) are checked here (non-null, 8-byte aligned) and
staged to the device through pinned memory with an asynchronous copy on the same stream, so a
call never waits for work already queued (a stream held by ``spin`` stays held). Inside a race
window prefer CUDA tensors built beforehand: staging may allocate (pinned or device memory),
and CUDA counts allocations among implicit synchronisation points. Addresses already in a CUDA
tensor are not checked on the host (that would synchronise); the kernels skip a null or
misaligned block instead of faulting, and ``verify_blocks`` reports it GARBAGE.

Errors: ``kvverify.device.extension.ExtensionUnavailableError`` when torch, the extension or a CUDA
device is missing; ``TypeError`` / ``ValueError`` naming the argument for bad arguments (raised
before anything is launched); CUDA errors as torch raises them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from kvverify.device import extension

if TYPE_CHECKING:  # torch is imported lazily: the package imports without it
    import torch

__all__ = ["checksum_blocks", "ops", "read_blocks", "spin", "verify_blocks", "write_blocks"]

_M64 = (1 << 64) - 1


@functools.cache
def ops():
    """``torch.ops.kvverify``, once a CUDA device is known to be visible and the fake (shape-only)
    kernels of verify/checksum are registered. Raises ``ExtensionUnavailableError`` otherwise
    (not cached: a later call tries again)."""
    extension.require_cuda_device()
    _register_fakes()
    return extension.ops()


@functools.cache
def _register_fakes() -> None:
    """Fake kernels, so FakeTensor tracing and ``torch.library.opcheck`` can run the pure ops.

    Only verify_blocks and checksum_blocks get one: they return fresh tensors. The other ops
    write memory behind raw addresses, which no fake could describe.
    """
    import torch

    @torch.library.register_fake("kvverify::verify_blocks")
    def _verify_blocks_fake(block_ptrs, block_bytes, block_ids, expected_generation, seed):
        n = block_ptrs.shape[0]
        return block_ptrs.new_empty((n,), dtype=torch.int8), block_ptrs.new_empty((n,), dtype=torch.int64)

    @torch.library.register_fake("kvverify::checksum_blocks")
    def _checksum_blocks_fake(block_ptrs, block_bytes):
        return block_ptrs.new_empty((block_ptrs.shape[0],), dtype=torch.int64)


# ---- argument handling -------------------------------------------------------------------------


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _seed(seed: Any) -> int:
    """Seed as the op's signed int64, two's complement of the seed mod 2**64 (as in pattern.py)."""
    s = _int(seed, "seed")
    if not -(1 << 63) <= s <= _M64:
        raise ValueError(f"seed must lie in [-2**63, 2**64) (it is used mod 2**64), got {s}")
    s &= _M64
    return s - (1 << 64) if s >= 1 << 63 else s


def _host_int64(value: Any, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a CPU tensor, numpy array or sequence of ints."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got {value.dtype}")
        t = value
    else:
        arr = np.asarray(value)
        if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
            raise ValueError(f"{name} holds values >= 2**63, which do not fit int64")
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one entry per block), got shape {tuple(t.shape)}")
    return t.contiguous()


def _check_addresses(host: torch.Tensor, name: str) -> None:
    a = host.numpy()
    bad = np.flatnonzero((a == 0) | (a % 8 != 0))
    if bad.size:
        j = int(bad[0])
        raise ValueError(
            f"{name}[{j}] = {int(a[j]):#x} is not a valid block address (null or not 8-byte aligned); "
            f"{bad.size} such entries"
        )


def _target_device(block_ptrs: Any, stream: torch.cuda.Stream | None) -> torch.device:
    import torch

    if isinstance(block_ptrs, torch.Tensor) and block_ptrs.is_cuda:
        if stream is not None and stream.device != block_ptrs.device:
            raise ValueError(f"block_ptrs is on {block_ptrs.device} but stream is on {stream.device}")
        return block_ptrs.device
    if stream is not None:
        return stream.device
    return torch.device("cuda", torch.cuda.current_device())


def _on_device(value: Any, name: str, device: torch.device, *, addresses: bool) -> torch.Tensor:
    """``value`` as a 1-D int64 tensor on ``device``, staged without synchronising (see module doc)."""
    import torch

    if isinstance(value, torch.Tensor) and value.is_cuda:
        if value.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one entry per block), got shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the blocks are handled on {device}")
        return value.contiguous()
    host = _host_int64(value, name)
    if addresses:
        _check_addresses(host, name)
    if host.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    # Pinned + non_blocking: an asynchronous copy queued on the current stream, ordered before
    # the kernel; torch's pinned-memory cache keeps the staging buffer alive until it completes.
    return host.pin_memory().to(device, non_blocking=True)


def _stream_context(stream: torch.cuda.Stream | None):
    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


PtrsLike = Any  # torch.Tensor (int64, 1-D, CUDA or CPU) | np.ndarray (integers) | Sequence[int]


# ---- the ops ---------------------------------------------------------------------------------------


def write_blocks(block_ptrs: PtrsLike, block_bytes: int, block_ids: PtrsLike, generation: int, seed: int,
                 spin_ns: int = 0, *, stream: torch.cuda.Stream | None = None) -> None:
    """Stamp the pattern of ``generation`` into each block (``kvverify.device.pattern.fill_blocks`` on the GPU).

    block_ptrs: (n,) int64 byte addresses, non-null, 8-byte aligned.
    block_bytes: bytes per block, a positive multiple of 8, at most 8 * (2**32 - 1).
    block_ids: (n,) int64 logical block ids (the ``b`` of the pattern).
    generation: 0 ..= 2**32 - 2 (2**32 - 1 is the poison generation). seed: int, mod 2**64.
    spin_ns: nanoseconds (0 ..= 60e9) the kernel waits on the device clock before writing, to hold
        a race window open; the kernel uses at most one CTA per SM, so every CTA waits at once and
        the write starts about spin_ns after the kernel starts.
    Writes with 16-byte stores. Raises TypeError / ValueError naming the argument.
    """
    o = ops()
    block_bytes = _int(block_bytes, "block_bytes")
    generation, spin_ns, seed = _int(generation, "generation"), _int(spin_ns, "spin_ns"), _seed(seed)
    with _stream_context(stream):
        device = _target_device(block_ptrs, stream)
        ptrs = _on_device(block_ptrs, "block_ptrs", device, addresses=True)
        ids = _on_device(block_ids, "block_ids", device, addresses=False)
        o.write_blocks(ptrs, block_bytes, ids, generation, seed, spin_ns)


def read_blocks(block_ptrs: PtrsLike, block_bytes: int, duration_ns: int, *,
                stream: torch.cuda.Stream | None = None) -> None:
    """Keep reading the blocks (volatile 16-byte loads) until ``duration_ns`` has passed.

    The reader of WAR scenarios: each thread scans its share of the blocks at least once and
    again until duration_ns (0 ..= 60e9 nanoseconds, device clock) has passed since it started.
    Uses at most one CTA per SM, so the whole grid reads at the same time and other streams'
    kernels still find room. block_ptrs, block_bytes as for ``write_blocks``.
    """
    o = ops()
    block_bytes, duration_ns = _int(block_bytes, "block_bytes"), _int(duration_ns, "duration_ns")
    with _stream_context(stream):
        device = _target_device(block_ptrs, stream)
        ptrs = _on_device(block_ptrs, "block_ptrs", device, addresses=True)
        o.read_blocks(ptrs, block_bytes, duration_ns)


def verify_blocks(block_ptrs: PtrsLike, block_bytes: int, block_ids: PtrsLike, expected_generation: int,
                  seed: int, *, stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Classify each block on the GPU exactly as ``kvverify.device.pattern.classify_blocks`` does.

    Returns ``(states, generations)``: (n,) int8 ``BlockState`` codes and (n,) int64 generations
    (the block's single generation for OK / STALE, else -1), both on the device, valid once the
    stream reaches them. One CTA per block (n <= 2**31 - 1). Arguments as for ``write_blocks``;
    expected_generation: 0 ..= 2**32 - 2.
    """
    o = ops()
    block_bytes, expected_generation = _int(block_bytes, "block_bytes"), _int(expected_generation, "expected_generation")
    seed = _seed(seed)
    with _stream_context(stream):
        device = _target_device(block_ptrs, stream)
        ptrs = _on_device(block_ptrs, "block_ptrs", device, addresses=True)
        ids = _on_device(block_ids, "block_ids", device, addresses=False)
        return o.verify_blocks(ptrs, block_bytes, ids, expected_generation, seed)


def checksum_blocks(block_ptrs: PtrsLike, block_bytes: int, *,
                    stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Per-block 64-bit checksum of arbitrary bytes (``--data random``): (n,) int64 on the device.

    Bit for bit ``kvverify.device.pattern.checksum_blocks_reference``: the sum mod 2**64 over words i of
    mix64(word_i ^ i * 0x9E3779B97F4A7C15), as int64. Any single changed word changes it; so does
    (almost always) swapping two different words. One CTA per block.
    """
    o = ops()
    block_bytes = _int(block_bytes, "block_bytes")
    with _stream_context(stream):
        device = _target_device(block_ptrs, stream)
        ptrs = _on_device(block_ptrs, "block_ptrs", device, addresses=True)
        return o.checksum_blocks(ptrs, block_bytes)


def spin(duration_ns: int, *, stream: torch.cuda.Stream | None = None) -> None:
    """Hold the stream: a one-thread kernel that returns ``duration_ns`` nanoseconds (device clock,
    0 ..= 60e9) after it starts. Work queued behind it waits, so copies can be queued without
    launch gaps and race windows stay open for a known time. Raises ValueError naming duration_ns.
    """
    o = ops()
    duration_ns = _int(duration_ns, "duration_ns")
    with _stream_context(stream):
        o.spin(duration_ns)
