"""The kernel path's descriptor staging, on paper: the protocol of ``swap_blocks_kernel``
(csrc/op/swap_blocks.cpp) written as traces for ``kvverify.check``, against the two ways a pinned
descriptor buffer is commonly got wrong. The device-side proof is
``test_kernel_copy_gpu.py::test_descriptors_are_never_rewritten_while_an_earlier_copy_may_read_them``.

Each call packs its descriptors into a pinned block (host write), copies them to a device buffer on
its stream, and launches the kernel, which reads them and the sources and writes the destinations.
torch's caching host allocator records an event after the copy and hands the block out again only
once a query of that event has returned true; torch's caching device allocator gives a freed
device block only to later work on the same stream.
"""

from __future__ import annotations

from kvverify.check import TraceBuilder, check

PAGE, DESC = 4096, 3 * 8 * 16  # 16 copies' (source, destination, bytes)


def _builder() -> TraceBuilder:
    b = TraceBuilder()
    for name, space, size in (("host_kv", "host_pinned", 4 * PAGE), ("gpu_kv", "device", 4 * PAGE),
                              ("desc_pinned_1", "host_pinned", DESC), ("desc_pinned_2", "host_pinned", DESC),
                              ("desc_dev_1", "device", DESC), ("desc_dev_2", "device", DESC)):
        b.buffer(name, space, size)
    b.stream("held")
    b.stream("other")
    return b


def _call(b: TraceBuilder, stream: str, pinned: str, device: str, page: int, event: str) -> None:
    b.host_write([(pinned, 0, DESC)], name="pack descriptors")
    b.copy(stream, (pinned, 0, DESC), (device, 0, DESC), name="descriptors H2D")
    b.record(event, stream, name="the allocator's event on the pinned block")
    b.kernel(stream, "copy_chunks", reads=[(device, 0, DESC), ("host_kv", page * PAGE, PAGE)],
             writes=[("gpu_kv", page * PAGE, PAGE)])


def test_the_protocol_is_safe():
    b = _builder()
    b.kernel("held", "pending work (a long hold)")
    _call(b, "held", "desc_pinned_1", "desc_dev_1", 0, "a")
    b.query_event("a", False, name="allocator: block 1 still in use")
    _call(b, "other", "desc_pinned_2", "desc_dev_2", 1, "b")  # another pinned and device block
    b.query_event("a", True, name="allocator: block 1 free again")
    _call(b, "other", "desc_pinned_1", "desc_dev_2", 2, "c")  # block 1 reused only now; device block 2 on its own stream
    assert check(b.build()).verdict == "SAFE"


def test_one_static_pinned_buffer_is_racy():
    b = _builder()
    b.kernel("held", "pending work (a long hold)")
    _call(b, "held", "desc_pinned_1", "desc_dev_1", 0, "a")
    _call(b, "other", "desc_pinned_1", "desc_dev_2", 1, "b")  # rewritten while call a's copy is pending
    verdict = check(b.build())
    assert verdict.verdict == "RACY"
    assert any(r.kind == "WAR" and "desc_pinned_1" in r.reason for r in verdict.races), verdict.render()


def test_one_device_buffer_shared_across_streams_is_racy():
    b = _builder()
    b.kernel("held", "pending work (a long hold)")
    _call(b, "held", "desc_pinned_1", "desc_dev_1", 0, "a")
    b.query_event("a", False)
    _call(b, "other", "desc_pinned_2", "desc_dev_1", 1, "b")  # a device block handed to another stream
    verdict = check(b.build())
    assert verdict.verdict == "RACY"
    assert any("desc_dev_1" in r.reason for r in verdict.races), verdict.render()
