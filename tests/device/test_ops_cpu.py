"""CPU tests of the op's contract: import without a GPU, every validation error (every copy path),
enum values, schemas and fake registrations."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from kvverify.device import extension, ops  # noqa: E402
from kvverify.device.ops import SrcAccessOrder  # noqa: E402

HAS_EXTENSION = extension.load_error() is None
PATHS = ["wrapper", "cuda-python", "kernel"] + (["torch.ops", "torch.ops-kernel"] if HAS_EXTENSION else [])
KERNEL_PATHS = ["kernel"] + (["torch.ops-kernel"] if HAS_EXTENSION else [])


def call(path, src, dst, sizes, order=1):
    """One call of the op through one of its entry points."""
    if path in ("wrapper", "kernel"):
        if not HAS_EXTENSION:
            pytest.skip("extension not built: the wrapper's extension backend cannot run")
        return ops.swap_blocks_batch(src, dst, sizes, order, method="kernel" if path == "kernel" else "batch")
    if path == "cuda-python":
        return ops.swap_blocks_batch(src, dst, sizes, order, backend="cuda-python")
    if path == "torch.ops-kernel":
        return torch.ops.kvverify.swap_blocks_kernel(src, dst, sizes)
    return torch.ops.kvverify.swap_blocks_batch(src, dst, sizes, order)


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_enum_values_equal_cuda():
    driver = pytest.importorskip("cuda.bindings.driver")
    assert SrcAccessOrder.STREAM == int(driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM) == 1
    assert (
        SrcAccessOrder.DURING_API_CALL
        == int(driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL)
        == 2
    )
    assert SrcAccessOrder.ANY == int(driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY) == 3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "src, dst, sizes, error, words",
    [
        (torch.tensor([8, 16], dtype=torch.int32), i64(8, 16), i64(8, 8), TypeError, "src_ptrs"),
        (i64(8, 16), torch.tensor([8.0, 16.0]), i64(8, 8), TypeError, "dst_ptrs"),
        (i64(8, 16), i64(8, 16), torch.tensor([8, 8], dtype=torch.int32), TypeError, "sizes"),
        (i64(8, 16).reshape(1, 2), i64(8, 16), i64(8, 8), ValueError, "src_ptrs must be 1-D"),
        (i64(8, 16), i64(8, 16, 24), i64(8, 8), ValueError, "same length"),
        (i64(8, 16), i64(8, 16), i64(8, 0), ValueError, "sizes[1]"),
        (i64(8, 16), i64(8, 16), i64(-8, 8), ValueError, "sizes[0]"),
        (i64(0, 16), i64(8, 16), i64(8, 8), ValueError, "src_ptrs[0] is a null pointer"),
        (i64(8, 16), i64(8, 0), i64(8, 8), ValueError, "dst_ptrs[1] is a null pointer"),
    ],
)
def test_bad_batches_are_rejected_by_name(path, src, dst, sizes, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        call(path, src, dst, sizes)


def test_pointer_tensors_off_the_cpu_are_rejected():
    # A meta tensor stands in for a device tensor: the check is on the device type, not on data.
    # (The C++ op's own check needs real CUDA tensors: test_ops_gpu covers it; a meta tensor
    # would dispatch to the fake kernel.)
    src = torch.empty(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="src_ptrs must be on the CPU"):
        call("cuda-python", src, i64(1, 2), i64(8, 8))


@pytest.mark.skipif(not HAS_EXTENSION, reason="extension not built")
@pytest.mark.parametrize("order", [0, 4, -1])
def test_unknown_order_is_rejected_by_the_cpp_op(order):
    with pytest.raises(ValueError, match="src_access_order"):
        torch.ops.kvverify.swap_blocks_batch(i64(1), i64(2), i64(8), order)


@pytest.mark.parametrize("order", [0, 4, "SOMETIMES", 2.5, True])
def test_unknown_order_is_rejected_by_the_wrapper(order):
    with pytest.raises((ValueError, TypeError), match="src_access_order"):
        ops.resolve_order(order, None)


def test_order_arguments():
    assert ops.resolve_order(None, None) is SrcAccessOrder.STREAM
    assert ops.resolve_order("any", None) is SrcAccessOrder.ANY
    assert ops.resolve_order(2, None) is SrcAccessOrder.DURING_API_CALL
    assert ops.resolve_order(None, True) is SrcAccessOrder.ANY
    assert ops.resolve_order(None, False) is SrcAccessOrder.STREAM
    with pytest.raises(ValueError, match="not both"):
        ops.resolve_order(SrcAccessOrder.STREAM, True)
    with pytest.raises(ValueError, match="not both"):
        ops.swap_blocks_batch([1], [2], [8], SrcAccessOrder.ANY, is_src_access_order_any=True, backend="cuda-python")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        ops.swap_blocks_batch([1], [2], [8], backend="magic")


@pytest.mark.parametrize("path", PATHS)
def test_empty_batch_is_a_no_op(path):
    assert call(path, i64(), i64(), i64()) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
@pytest.mark.parametrize("path", PATHS)
def test_no_cuda_device_is_an_error(path):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        call(path, i64(8), i64(16), i64(8))


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(
    "src, dst, sizes, words",
    [
        (i64(8, 16), i64(8, 16), i64(8, 12), "sizes[1] = 12 bytes is not a multiple of 8"),
        (i64(8, 20), i64(8, 16), i64(8, 8), "src_ptrs[1] = 20 is not 8-byte aligned"),
        (i64(4, 16), i64(8, 16), i64(8, 8), "src_ptrs[0] = 4 is not 8-byte aligned"),
        (i64(8, 16), i64(8, 17), i64(8, 8), "dst_ptrs[1] = 17 is not 8-byte aligned"),
    ],
)
def test_the_kernel_path_refuses_partial_words_by_name(path, src, dst, sizes, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]") + ".*use method='batch'"):
        call(path, src, dst, sizes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
@pytest.mark.parametrize("path", ["wrapper", "cuda-python"] + (["torch.ops"] if HAS_EXTENSION else []))
def test_the_driver_paths_take_partial_words(path):
    # 12 bytes at an odd address is a valid batch copy: validation passes and only the missing
    # device stops it.
    with pytest.raises(ValueError, match="needs a CUDA device"):
        call(path, i64(9), i64(21), i64(12))


def test_methods():
    assert ops.resolve_method("batch", True) == "batch"
    assert ops.resolve_method("kernel", True) == "kernel"
    assert ops.resolve_method("batch", False) == ops.resolve_method("loop", True) == "loop"
    with pytest.raises(ValueError, match="unknown method 'dma'"):
        ops.resolve_method("dma", True)
    with pytest.raises(ValueError, match="give one of them"):
        ops.resolve_method("kernel", False)
    with pytest.raises(ValueError, match="extension backend only"):
        ops.swap_blocks_batch([8], [16], [8], method="kernel", backend="cuda-python")
    with pytest.raises(ValueError, match="extension backend only"):
        ops.swap_blocks_batch([8], [16], [8], method="loop", backend="cuda-python")


def test_package_imports_without_torch_or_extension():
    # torch made unimportable: the package and the CLI still load; the op says what is missing.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        import kvverify, kvverify.cli, kvverify.device.ops
        from kvverify.device.extension import ExtensionUnavailableError
        try:
            kvverify.device.ops.swap_blocks_batch([1], [2], [8])
        except ExtensionUnavailableError as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "refused: torch is not installed" in out.stdout


def test_missing_extension_gives_build_hint():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["kvverify._C"] = None
        import kvverify.device.ops
        from kvverify.device.extension import ExtensionUnavailableError
        try:
            kvverify.device.ops.swap_blocks_batch([1], [2], [8])
        except ExtensionUnavailableError as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "kvverify._C is not built" in out.stdout and "pip install --no-build-isolation" in out.stdout


@pytest.mark.skipif(not HAS_EXTENSION, reason="extension not built")
def test_op_schema_is_the_published_one():
    schema = str(torch.ops.kvverify.swap_blocks_batch.default._schema)
    assert schema == (
        "kvverify::swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int src_access_order=1) -> ()"
    )
    # The serving-engine arguments, without an order: the kernel path reads in stream order.
    assert str(torch.ops.kvverify.swap_blocks_kernel.default._schema) == (
        "kvverify::swap_blocks_kernel(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes) -> ()"
    )
    assert str(torch.ops.kvverify.check_pointers.default._schema) == (
        "kvverify::check_pointers(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, bool for_kernel=False) -> ()"
    )


@pytest.mark.skipif(not HAS_EXTENSION, reason="extension not built")
@pytest.mark.parametrize("name", ["swap_blocks_batch", "swap_blocks_loop", "swap_blocks_kernel"])
def test_every_copy_op_has_a_fake(name):
    # torch.compile traces with fake tensors: a copy op with no fake kernel would make it fail.
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(torch.ops.kvverify, name)
    with FakeTensorMode():
        args = [torch.empty(4, dtype=torch.int64) for _ in range(3)]  # fake: no data, no device needed
        assert op(*args) is None
