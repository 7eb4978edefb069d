"""The adversarial executor never makes the host wait on a held stream (stand-in device).

The stand-in (tests/fake_device.py) runs every op at issue, so a hold cannot block anything
there. This test lays a model of what blocks on the H200 over it:

- a stream is *held* from ``StreamGate.hold`` until the gate's next release, and so is every
  stream that waited (``wait_stream`` / ``wait_event``) on a held one;
- a ``swap_blocks_batch`` of device-to-device copies issued on a held stream blocks the
  calling thread until the hold is released (measured on the H200, driver 580: 2048
  device-to-device copies of one batch on a held stream, each call released only by the
  gate's watchdog 2 s later; H2D / D2H batches from pinned memory returned at once);
- a host wait (a poll loop, a stream or event synchronize) on work behind a hold blocks
  until the hold is released; a single event query does not (it answers "not yet");
- a synchronous copy between host and device (``Tensor.to(device)``, ``copy_`` between a host
  and a device tensor without ``non_blocking``: torch waits for the current stream) on a stream
  that waits for a hold;
- a ``DURING_API_CALL`` batch, or a host-to-device batch from pageable memory, on a stream that
  waits for a hold: the call returns only once the stream's pending work has finished (H200);
- a device-to-host batch into pageable memory on a stream that waits for a hold (H200: a
  batch of 2048 pages did not return until the watchdog released the hold);
- ``torch.cuda.synchronize``, ``torch.cuda.empty_cache`` (``cudaFree``) and freeing host memory
  (``cudaFreeHost`` / ``cudaHostUnregister``) while any hold is armed: they synchronize the device.

The legacy default stream is modelled conservatively as waiting for every held stream (as it
would for blocking streams; torch's pool streams are non-blocking, so on the device it does
not), so harness code stays correct if a stream's flags ever change.

Each one, on the device, is a watchdog expiry (2 s); here it is a recorded violation.
"""

from __future__ import annotations

import contextlib
import sys

import fake_device
import numpy as np
import pytest
import torch

from kvverify.device import host_memory, kernels, ops
from kvverify.geometry import KVLayout, ModelGeometry
from kvverify.scenarios import Params
from kvverify.scenarios.program import GPU, HOST, BlockCopy, Blocks, HostConsume, HostFill, Program, Swap
from kvverify.stress import planning, running
from kvverify.stress.campaign import load
from kvverify.stress.executors import adversarial as adversarial_module
from kvverify.stress.executors import base as base_module
from kvverify.device import gate as gate_module
from kvverify.stress.executors import pools as pools_module

TINY = KVLayout(ModelGeometry("tiny", 2, 1, 16, 2), block_size=4)  # 128-byte pages, 4 tensors
PARAMS = Params(blocks_per_transfer=2, transfers=3)


class _Model:
    def __init__(self) -> None:
        self.epoch = 0  # gate releases so far
        self.current = None  # the current stream
        self.device_ranges: list[tuple[int, int]] = []
        self.pinned_ranges: list[tuple[int, int]] = []  # host memory that is pinned on the device
        self.violations: list[str] = []
        self.holds = 0
        self.streams: list = []
        self.default = None  # the legacy default stream

    def held(self, thing) -> bool:
        return thing is not None and getattr(thing, "gate", 0) > self.epoch

    def armed(self) -> bool:
        return any(self.held(s) for s in self.streams)

    def waits_for_a_hold(self, stream) -> bool:
        """Whether work on ``stream`` (None: the current one) waits for a hold; the legacy
        default stream is taken to wait for every held stream (conservative, see above)."""
        stream = stream if stream is not None else (self.current if self.current is not None else self.default)
        return self.held(stream) or (stream is self.default and self.armed())

    def on_device(self, address: int) -> bool:
        return any(lo <= address < hi for lo, hi in self.device_ranges)

    def pinned(self, address: int) -> bool:
        return any(lo <= address < hi for lo, hi in self.pinned_ranges)


def _is_device(arg) -> bool:
    return isinstance(arg, (torch.device, str, torch.Tensor))


@pytest.fixture
def model(monkeypatch):
    fake_device.install(monkeypatch)
    m = _Model()

    class Stream(fake_device.FakeStream):
        def __init__(self, device=None, **kw):
            super().__init__(device, **kw)
            self.gate = 0  # held while gate > m.epoch
            m.streams.append(self)

        def wait_event(self, event):
            self.gate = max(self.gate, event.gate)

        def wait_stream(self, stream):
            self.gate = max(self.gate, stream.gate)

        def synchronize(self):
            if m.waits_for_a_hold(self):
                m.violations.append("the host synchronized a stream that waits for a hold")

    class Event(fake_device.FakeEvent):
        gate = 0

        def record(self, stream=None):
            s = stream if stream is not None else (m.current if m.current is not None else m.default)
            self.gate = max(getattr(s, "gate", 0), m.epoch + 1 if s is m.default and m.armed() else 0)

        def query(self):
            return not m.held(self)

        def synchronize(self):
            if m.held(self):
                m.violations.append("the host waited on work behind a hold")

    @contextlib.contextmanager
    def stream_context(s=None):
        before, m.current = m.current, s
        try:
            yield
        finally:
            m.current = before

    default = m.default = Stream()

    def spin(*a, stream=None, **k):  # StreamGate.hold without cuda-python: the hold itself
        if stream is not None:
            stream.gate = m.epoch + 1
            m.holds += 1

    real_release = gate_module.StreamGate.release_all

    def release_all(self):
        real_release(self)
        m.epoch += 1

    real_pools_init = pools_module.Pools.__init__

    def pools_init(self, *a, **k):
        real_pools_init(self, *a, **k)
        for t in (self.gpu, self.snapshot, self.staging):
            m.device_ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))

    real_adv_init = adversarial_module.AdversarialExecutor.__init__

    def adv_init(self, *a, **k):
        real_adv_init(self, *a, **k)
        buf = self._host_snapshot_buffer  # pinned where there is a device
        m.pinned_ranges.append((buf.ptr, buf.ptr + buf.nbytes))

    real_swap = ops.swap_blocks_batch

    def swap(src_ptrs, dst_ptrs, sizes, src_access_order=None, **k):
        src, dst = (np.asarray(torch.as_tensor(a), dtype=np.int64) for a in (src_ptrs, dst_ptrs))
        if m.held(m.current) and any(m.on_device(int(s)) and m.on_device(int(d)) for s, d in zip(src, dst)):
            m.violations.append("a device-to-device batch on a held stream")
        if m.waits_for_a_hold(None):
            if ops.resolve_order(src_access_order, k.get("is_src_access_order_any")) == ops.SrcAccessOrder.DURING_API_CALL:
                m.violations.append("a DURING_API_CALL batch on a stream that waits for a hold")
            if any(not m.on_device(int(s)) and not m.pinned(int(s)) and m.on_device(int(d)) for s, d in zip(src, dst)):
                m.violations.append("a host-to-device batch from pageable memory on a stream that waits for a hold")
            if any(m.on_device(int(s)) and not m.on_device(int(d)) and not m.pinned(int(d)) for s, d in zip(src, dst)):
                m.violations.append("a device-to-host batch into pageable memory on a stream that waits for a hold")
        real_swap(src_ptrs, dst_ptrs, sizes, src_access_order, **k)

    # Host syncs torch makes on the caller's behalf.
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    real_poll = base_module.Executor._poll

    def poll(self, events, what):  # the executors' host wait: a loop of queries
        if any(m.held(e) for e in events):
            m.violations.append("the host waited on work behind a hold")
        real_poll(self, [e for e in events if not m.held(e)], what)

    def to(self, *a, **k):
        device = k.get("device", a[0] if a else None)
        if _is_device(device) and not k.get("non_blocking", False) and m.waits_for_a_hold(None):
            m.violations.append("a synchronous host-device copy (Tensor.to) on a stream that waits for a hold")
        return real_to(self, *a, **k)

    def copy_(self, src, non_blocking=False):
        crosses = m.on_device(self.data_ptr()) != m.on_device(src.data_ptr())
        if crosses and not non_blocking and m.waits_for_a_hold(None):
            m.violations.append("a synchronous host-device copy (copy_) on a stream that waits for a hold")
        return real_copy(self, src, non_blocking)

    def device_wide(what):
        def call(*a, **k):
            if m.armed():
                m.violations.append(f"{what} while a hold is armed")
        return call

    def pin_memory(self, *a, **k):  # torch's pinned cache: cudaHostAlloc on a miss
        if m.armed():
            m.violations.append("a pinned allocation (Tensor.pin_memory) while a hold is armed")
        return self  # the stand-in has no pinned memory

    real_free = host_memory.HostBuffer.free

    def free(self):
        if getattr(self, "_live", False) and m.armed():
            m.violations.append("host memory freed (cudaFreeHost / cudaHostUnregister) while a hold is armed")
        real_free(self)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: default)
    monkeypatch.setattr(kernels, "spin", spin)
    monkeypatch.setattr(gate_module.StreamGate, "release_all", release_all)
    monkeypatch.setattr(pools_module.Pools, "__init__", pools_init)
    monkeypatch.setattr(ops, "swap_blocks_batch", swap)
    monkeypatch.setattr(base_module.Executor, "_poll", poll)
    monkeypatch.setattr(adversarial_module.AdversarialExecutor, "__init__", adv_init)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide("torch.cuda.synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", device_wide("torch.cuda.empty_cache"))
    monkeypatch.setattr(host_memory.HostBuffer, "free", free)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return m


def _campaign(**changes):
    base = dict(trials=3, max_trials=3, min_checked=1, host_memory=("pageable",), writer_delay_us=0, reader_us=0,
                executors=("adversarial",))
    return load("smoke").override(**(base | changes))


def test_the_model_catches_a_device_to_device_batch_on_a_held_stream(model):
    g = gate_module.StreamGate(torch.device("cpu"))
    s, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    model.device_ranges.append((a.data_ptr(), a.data_ptr() + 64))
    model.device_ranges.append((b.data_ptr(), b.data_ptr() + 64))
    g.hold(s)
    waiter.wait_stream(s)
    with torch.cuda.stream(waiter):
        ops.swap_blocks_batch([b.data_ptr()], [a.data_ptr()], [64], "STREAM")
    assert model.violations == ["a device-to-device batch on a held stream"]
    g.release_all()
    with torch.cuda.stream(waiter):
        ops.swap_blocks_batch([b.data_ptr()], [a.data_ptr()], [64], "STREAM")
    assert len(model.violations) == 1
    g.close()


# The stand-in runs work at issue, so the only late work is what the model holds: a copy into
# pageable memory lands in pinned memory on its (held) stream and reaches the pageable block
# when the host finds it landed. A host read of the destination before completion (H4) and a
# reload of the host block while its store is pending (H5) see that; no other race can show.
LATE_PAGEABLE_WRITE_SHOWS = ("H4-broken", "H5-broken")


def test_no_schedule_makes_the_host_wait_on_a_hold(model):
    """Every scenario, order and schedule (three trials: early, mixed, late): no call the
    H200 would block on a hold, and the outcomes of the reference schedule still hold."""
    c = _campaign()
    planned = planning.plan(c, TINY, PARAMS)
    outcomes = running.execute(planned, c, TINY, PARAMS, device=torch.device("cpu"))
    assert model.holds > 0  # the model saw the holds
    assert not model.violations, sorted(set(model.violations))
    for pc in planned:
        out = outcomes[pc.cell]
        assert out.error is None, out.error
        obs = out.observation
        assert obs.trials == 3 and obs.blocks_checked > 0
        if pc.cell.scenario in LATE_PAGEABLE_WRITE_SHOWS:
            assert obs.corrupted_trials >= 1 and pc.contract == "RACY", (pc.cell.label, obs.counts)
        elif pc.cell.scenario == "H7-broken":
            assert obs.corrupted_trials == 3 and obs.garbage > 0, pc.cell.label
        else:
            assert not obs.corrupted, (pc.cell.label, obs.counts)


def test_the_model_catches_each_kind_of_host_wait_on_a_hold(model):
    """Every class of call the model forbids, issued once with a hold armed and once without."""
    g = gate_module.StreamGate(torch.device("cpu"))
    held, free_stream, waiter = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    dev, host = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    model.device_ranges.append((dev.data_ptr(), dev.data_ptr() + 64))
    buf = host_memory.allocate_host("pageable", 64)

    def provoke():
        waiter.wait_stream(held)
        held.synchronize()
        with torch.cuda.stream(waiter):
            host.to(torch.device("cpu"))  # an H2D copy from pageable memory: torch waits for the stream
            dev.copy_(host)
            ops.swap_blocks_batch([host.data_ptr()], [dev.data_ptr()], [64], "STREAM")  # from pageable
            ops.swap_blocks_batch([dev.data_ptr()], [host.data_ptr()], [64], "DURING_API_CALL")  # into pageable
        host.to(torch.device("cpu"))  # on the legacy default stream (modelled as waiting)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        host.pin_memory()
        buf.free()

    g.hold(held)
    provoke()
    assert sorted(set(model.violations)) == sorted({
        "the host synchronized a stream that waits for a hold",
        "a synchronous host-device copy (Tensor.to) on a stream that waits for a hold",
        "a synchronous host-device copy (copy_) on a stream that waits for a hold",
        "a host-to-device batch from pageable memory on a stream that waits for a hold",
        "a DURING_API_CALL batch on a stream that waits for a hold",
        "a device-to-host batch into pageable memory on a stream that waits for a hold",
        "torch.cuda.synchronize while a hold is armed",
        "torch.cuda.empty_cache while a hold is armed",
        "a pinned allocation (Tensor.pin_memory) while a hold is armed",
        "host memory freed (cudaFreeHost / cudaHostUnregister) while a hold is armed",
    })
    model.violations.clear()
    g.release_all()
    buf = host_memory.allocate_host("pageable", 64)
    provoke()  # nothing held: every call is fine
    with torch.cuda.stream(free_stream):
        dev.copy_(host)
    assert not model.violations, model.violations
    g.close()


def test_random_data_never_makes_the_host_wait_on_a_hold(model):
    """--data random under the adversarial executor: its device writes run on held compute
    streams (early schedule), so nothing there may wait for the current stream."""
    c = _campaign(data="random", scenarios=("H1", "H2", "H4", "P1", "P2"))
    planned = planning.plan(c, TINY, PARAMS)
    outcomes = running.execute(planned, c, TINY, PARAMS, device=torch.device("cpu"))
    assert model.holds > 0
    assert not model.violations, sorted(set(model.violations))
    for pc in planned:
        out = outcomes[pc.cell]
        assert out.error is None, out.error
        assert out.observation.corrupted == (pc.cell.scenario in LATE_PAGEABLE_WRITE_SHOWS), pc.cell.label


def test_memory_is_never_freed_when_the_device_does_not_settle(model, monkeypatch):
    """Cleanup that finds the device busy leaves every host buffer alone (freeing it would
    synchronize the device, i.e. hang on the work that did not finish) and keeps it referenced."""
    freed = []
    real_free = host_memory.HostBuffer.free

    def free(self):
        if getattr(self, "_live", False):
            freed.append(self)
        real_free(self)

    monkeypatch.setattr(host_memory.HostBuffer, "free", free)
    monkeypatch.setattr(running, "settle", lambda device, timeout_s: False)
    c = _campaign(scenarios=("P2",), orders=("ANY",))
    planned = planning.plan(c, TINY, PARAMS)
    before = len(running._ABANDONED)
    try:
        running.execute(planned, c, TINY, PARAMS, device=torch.device("cpu"))
        import gc

        gc.collect()
        assert not freed
        assert len(running._ABANDONED) == before + 1
        _runners, pools, buffers = running._ABANDONED[-1]
        assert pools.host is not None and all(b is not None for b in buffers[:1])
    finally:
        del running._ABANDONED[before:]


def _executor_with_torch_pool(monkeypatch, streams: int):
    """An adversarial executor (and its pools) whose torch.cuda.Stream() hands out a pool of
    ``streams`` streams round robin, as torch's pool of 32 does."""
    from kvverify.stress import executors, planning

    pool = [torch.cuda.Stream() for _ in range(streams)]
    turn = iter(range(10**6))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pool[next(turn) % len(pool)])
    c = _campaign()
    sizes = planning.pool_sizes([pc.program for pc in planning.plan(c, TINY, PARAMS)], TINY, True)
    pools = pools_module.Pools(TINY, "pageable", sizes, torch.device("cpu"))
    return executors.make("adversarial", pools, executors.Settings()), pools


def test_executor_streams_stay_distinct_when_torch_pool_wraps(model, monkeypatch):
    """torch.cuda.Stream() hands out a pool of 32 streams round robin: an executor with more
    streams than that must still get distinct ones for its own."""
    from kvverify.stress import executors

    ex, pools = _executor_with_torch_pool(monkeypatch, 4)
    try:
        got = [ex.host_stream, ex.snap_stream, ex._stream("a"), ex._stream("b")]
        assert len({s.cuda_stream for s in got}) == 4
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # no cuda-python: no stream past the pool
        with pytest.raises(executors.HarnessError, match="distinct streams"):
            ex._stream("c")
        ex.close()
        ex.free_memory()
    finally:
        pools.close()


def test_streams_made_past_torch_pool_are_destroyed_once_idle(model, monkeypatch):
    """Past torch's pool the executor makes streams with cuStreamCreate; free_memory (device
    idle) destroys exactly those, once."""
    import enum
    import types

    made, destroyed = [], []

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0

    class CUstream_flags(enum.Enum):
        CU_STREAM_NON_BLOCKING = 1

    def cuStreamCreate(flags):
        made.append(10_000 + len(made))
        return CUresult.CUDA_SUCCESS, made[-1]

    driver = types.SimpleNamespace(CUresult=CUresult, CUstream_flags=CUstream_flags, cuStreamCreate=cuStreamCreate,
                                   cuStreamDestroy=lambda handle: destroyed.append(handle))
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", types.SimpleNamespace(driver=driver))
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda handle, device=None: types.SimpleNamespace(cuda_stream=handle), raising=False)
    ex, pools = _executor_with_torch_pool(monkeypatch, 2)  # host stream + snapshot stream: the pool
    try:
        got = [ex._stream("a"), ex._stream("b")]
        assert [s.cuda_stream for s in got] == made and len(made) == 2
        ex.close()
        ex.free_memory()
        assert destroyed == made
        ex.free_memory()
        assert destroyed == made  # once
    finally:
        pools.close()


# -- the landing of copies into pageable memory, piece by piece ---------------------------------


def _landing_setup(program):
    """An adversarial executor on pageable pools sized for ``program``, its prepared swaps."""
    from kvverify.stress import executors, planning

    sizes = planning.pool_sizes([program], TINY, True)
    pools = pools_module.Pools(TINY, "pageable", sizes, torch.device("cpu"))
    ex = executors.make("adversarial", pools, executors.Settings())
    swaps = [data for step, data in ex.prepare(program).steps if isinstance(step, Swap)]
    for data in swaps:
        ex._rounds(data)  # computes the landing writes
    return ex, pools, swaps


def _fill_landing(ex, data, first_value: int) -> None:
    """Landing page k of ``data`` holds the word ``first_value + k`` throughout."""
    pages = ex.host_snapshot[data.snapshot_first_page:data.snapshot_first_page + len(data.src)]
    values = torch.arange(first_value, first_value + len(data.src), dtype=torch.int64)
    pages.view(torch.int64).copy_(values[:, None].expand(-1, ex.page_bytes // 8))


def _host_word(pools, tensor: int, slot: int) -> int:
    page = pools.host_pages()[tensor, slot]
    assert (page == page[0]).all()
    return int(page[0])


class _Event:
    def __init__(self, query):
        self.query = query


def test_landing_writes_rounds_in_order_with_a_partly_colliding_copy_group(model):
    """One batch: gpu 0,1 -> host 0,1 (one copy group) and gpu 2 -> host 1. The batch's rounds run
    the later copy to host 1 first, so the earlier one (gpu 1) is what host 1 ends with; the
    first group has a block in each round (the partial-group path)."""
    program = Program(("compute", "xfer0"), 3, 2, (
        Swap("xfer0", (BlockCopy(Blocks(GPU, (0, 1)), Blocks(HOST, (0, 1))), BlockCopy(Blocks(GPU, (2,)), Blocks(HOST, (1,))))),
    ))
    ex, pools, (data,) = _landing_setup(program)
    try:
        tensors = TINY.num_tensors
        _fill_landing(ex, data, 1)  # group 1: page t*2 + b (tensor-major); group 2: 2*tensors + t
        ex._landings = [(_Event(lambda: True), data)]
        ex._land()
        assert not ex._landings
        for t in range(tensors):
            assert _host_word(pools, t, 0) == 1 + t * 2  # gpu 0
            assert _host_word(pools, t, 1) == 1 + t * 2 + 1  # gpu 1, not gpu 2 (1 + 2 * tensors + t)
    finally:
        ex.close()
        ex.free_memory()
        pools.close()


def test_landings_found_done_keep_issue_order_when_one_completes_during_the_queries(model):
    """Two batches into host 0, the second ordered after the first. The first completes while
    ``_land`` is querying: found done latest first, both land, in issue order, so host 0 ends
    with the second's bytes, also after a later ``_land``."""
    program = Program(("compute", "xfer0"), 2, 1, (
        Swap("xfer0", (BlockCopy(Blocks(GPU, (0,)), Blocks(HOST, (0,))),)),
        Swap("xfer0", (BlockCopy(Blocks(GPU, (1,)), Blocks(HOST, (0,))),)),
    ))
    ex, pools, (first, second) = _landing_setup(program)
    try:
        _fill_landing(ex, first, 100)
        _fill_landing(ex, second, 200)
        asked = []

        def second_done():
            asked.append("second")
            return True

        ex._landings = [(_Event(lambda: "second" in asked), first), (_Event(second_done), second)]
        ex._land()
        ex._land()
        assert not ex._landings
        assert [_host_word(pools, t, 0) for t in range(TINY.num_tensors)] == [200 + t for t in range(TINY.num_tensors)]
    finally:
        ex.close()
        ex.free_memory()
        pools.close()


def test_the_host_lands_copies_before_it_touches_host_blocks(model, monkeypatch):
    """A host write, a host read and a host-source snapshot each write landed copies first."""
    from kvverify.stress.executors import contents

    program = Program(("compute", "xfer0"), 1, 1, (
        Swap("xfer0", (BlockCopy(Blocks(HOST, (0,)), Blocks(GPU, (0,))),)),
        HostFill(Blocks(HOST, (0,)), 2),
        HostConsume(Blocks(HOST, (0,)), 2),
    ))
    ex, pools, (load_swap,) = _landing_setup(program)
    calls = []
    monkeypatch.setattr(ex, "_land", lambda: calls.append("land"))
    monkeypatch.setattr(ex, "_host_write", lambda *a: calls.append("host write"))
    monkeypatch.setattr(ex, "_verify", lambda *a: calls.append("host read"))
    monkeypatch.setattr(ex, "_own_wait", lambda *a: None)
    monkeypatch.setattr(contents, "gather_host_pages", lambda *a: calls.append("snapshot"))
    try:
        prepared = ex.prepare(program)
        for step, data in prepared.steps[1:]:
            ex._step(step, data, "ANY", 0, [])
        ex._snapshot(load_swap)
        assert calls == ["land", "host write", "land", "host read", "land", "snapshot"]
    finally:
        monkeypatch.undo()
        ex.close()
        ex.free_memory()
        pools.close()
