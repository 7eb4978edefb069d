"""``kvverify record --confirm``'s witness (``kvverify.record.confirm.witness``) on the CUDA stand-in: ops
found again by their place in the program (by whichever thread issued them: a thread's default name,
a pool's worker), one plan per pair of lines (the groups of one batched call apart), the hold before
the first op, the bytes read back (old bytes only where a copy may read early; what a host read
saw), and the verdict of three runs (runs that read other ranges are not compared byte for byte).
The stand-in runs every op at its call, so a forced order is the issue order here: the reordering
itself is the GPU's to show (the corpus with ``--confirm``, ``test_witness_gpu.py``). How each
command starts the witness runs is ``test_witness_runs.py``'s. A docstring that starts "Was:" tells
the defect its test holds off, as the code had it."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fake_cuda import FakeCuda, FakeTools
from witness_harness import plans_of, record_run, recorded

import kvverify.record as record
from kvverify.record.confirm import witness
from kvverify.record.confirm.witness import (
    CONFIRMED,
    FORCED,
    IN_ORDER,
    NO_WITNESS,
    NOT_CONFIRMED,
    Plan,
    Target,
    WitnessObservation,
)

BLOCK = 4096


def racy_steps(fake, steps: int):
    """A store copied to pinned memory on its own stream while compute writes the block: the
    copy's stream never waits (a RAW race at the same two lines in every step)."""
    kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    for step in range(steps):
        kv.fill_(step + 1)  # compute
        with fake.use(side):
            host.copy_(kv, non_blocking=True)  # the store
        fake.synchronize()
    return kv, host


def test_each_call_of_an_op_at_a_line_is_counted_into_what_it_logs(fake):
    rec = recorded(fake, racy_steps, 3)
    fills = [op for op in rec.recorder.ops if op["op"] == "kernel"]
    copies = [op for op in rec.recorder.ops if op["op"] == "copy"]
    assert [op["call"] for op in fills] == [0, 1, 2] and [op["call"] for op in copies] == [0, 1, 2]
    assert len({op["at"] for op in fills}) == 1 and fills[0]["at"] != copies[0]["at"]


def test_a_plain_recording_counts_nothing(fake):
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        racy_steps(fake, 1)
    assert all("call" not in op for op in rec.recorder.ops)


def test_one_plan_per_pair_of_lines_holds_the_first_op_until_the_second(fake):
    rec = recorded(fake, racy_steps, 3)
    races = rec.check().races
    assert len(races) == 3
    plans, left = witness.plans(rec.recorder.ops, rec.summary().sources, races)
    assert left == []
    (plan,) = plans
    assert plan.races == (1, 2, 3) and plan.kind == "RAW" and not plan.second_on_host and not plan.early_read
    assert plan.first.name == "aten.fill_.Scalar" and plan.second.name == "aten.copy_.default"
    assert plan.first.call == plan.second.call == 0 and plan.first.thread is None
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_a_free_and_a_host_access_as_the_second_op(fake):
    """A use after free is left unforced, with why; a host write racing with a copy that reads
    the pinned block is forced, complete when its call returns."""
    def program(fake):
        kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
        side = fake.stream()
        with fake.use(side):
            kv.copy_(host, non_blocking=True)
        host.fill_(7)  # rewrites the staging block under the pending H2D copy
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        record.free(host)
        fake.synchronize()

    rec = recorded(fake, program)
    races = rec.check().races
    plans, left = witness.plans(rec.recorder.ops, rec.summary().sources, races)
    assert [p.kind for p in plans] == ["WAR"] and plans[0].second_on_host
    # the free races with both copies of the pinned block: two pairs of lines; its bytes may be gone
    assert [(o.kind, o.status) for o in left] == [("FREE", NO_WITNESS)] * 2
    assert all("gives its bytes back" in o.detail and "kvverify.record.reuse" in o.detail for o in left)


def test_a_reuse_under_a_pending_d2h_copy_is_forced_with_the_witness_as_the_next_owner(fake):
    """sgl-project/sglang#28468's shape: a D2H backup into a host slot, then the pool hands the slot
    on (``kvverify.record.reuse``). The backup's stream is held until the hand-over returned; the
    witness then writes ``MARK`` over the slot, as its next owner, before the backup is let go,
    and reads the slot (what the backup wrote, and what the next owner is left with)."""
    def program(fake):
        kv, slot = fake.device(BLOCK), fake.pinned(BLOCK)
        kv.fill_(3)
        fake.synchronize()
        with fake.use(fake.stream()):
            slot.copy_(kv, non_blocking=True)
        record.reuse(slot, name="host slot")
        fake.synchronize()

    rec = recorded(fake, program)
    (plan,), left = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
    assert left == [] and plan.kind == "FREE" and plan.second_on_host and plan.second.name == "host slot"
    assert plan.next_owner == "reused"
    obs = witness.observe(lambda: (program(fake), 0)[1], plan, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second and not obs.ordered and obs.note is None
    calls = [c[0] for c in fake.witness_calls]
    assert calls[:3] == ["hold", "mark", "release"] and "back" not in calls  # a pool's slot: no mapping
    assert [label.endswith(" as its next owner left it") for label, _ in obs.ranges] == [False, True]
    # (the stand-in ran the copy at its call: the next owner's bytes are what both read back)
    assert obs.data == bytes([witness.MARK]) * (2 * BLOCK)


def test_an_unmap_under_a_pending_store_is_forced_on_fresh_memory_mapped_at_the_range(fake):
    """vllm-project/vllm#45268's shape: a store from device memory, then ``cuMemUnmap`` of it. The
    witness maps fresh memory at the unmapped range before it writes ``MARK`` there and lets the
    held store go (a read of an unmapped address would end the context), and unmaps it again
    once it has read the bytes back; a free that gives its bytes back is not planned."""
    driver = pytest.importorskip("cuda.bindings.driver")

    def program(fake):
        gpu, cpu = fake.device(BLOCK), fake.pinned(BLOCK)
        gpu.fill_(4)
        fake.synchronize()
        with fake.use(fake.stream()):
            cpu.copy_(gpu, non_blocking=True)
        driver.cuMemUnmap(gpu.data_ptr(), BLOCK)
        fake.synchronize()
        return gpu

    unmap = driver.cuMemUnmap
    try:
        driver.cuMemUnmap = lambda *args: (driver.CUresult.CUDA_SUCCESS,)
        rec = recorded(fake, program)
        (plan,), left = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
        assert left == [] and plan.kind == "FREE" and plan.second.name == "cuda-python cuMemUnmap"
        assert plan.next_owner == "unmapped"
        result = {}
        obs = witness.observe(lambda: (result.setdefault("gpu", program(fake)), 0)[1], plan, FORCED,
                              platform=fake, skip=fake.skip())
    finally:
        driver.cuMemUnmap = unmap
    assert obs.found_first and obs.found_second and obs.note is None
    address = result["gpu"].data_ptr()
    back = [c for c in fake.witness_calls if c[0] in ("back", "unback", "release")]
    assert back[:3] == [("back", address, BLOCK), ("release",), ("unback", address, BLOCK)]
    assert obs.data == bytes([4]) * BLOCK + bytes([witness.MARK]) * BLOCK


def test_a_confirmed_free_says_the_witness_stood_in_for_the_next_owner():
    for after in ("reused", "unmapped"):
        free = Plan(PLAN.races, "FREE", PLAN.first, PLAN.second, True, False, after)
        out = witness.judge(free, None, None, seen(IN_ORDER, b"\x01" * 8), seen(IN_ORDER, b"\x01" * 8),
                            seen(FORCED, bytes([witness.MARK]) * 8))
        assert out.status == CONFIRMED and "with the free first" in out.detail and "next owner" in out.detail
        assert ("fresh memory it mapped" in out.detail) == (after == "unmapped")
        assert Plan.from_json(json.loads(json.dumps(free.to_json()))) == free


def test_a_witness_run_holds_the_first_op_before_it_is_issued_and_reads_what_the_pair_wrote(fake):
    rec = recorded(fake, racy_steps, 2)
    (plan,), _ = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
    second = Plan(plan.races, plan.kind, plan.first, Target(*[getattr(plan.second, f) for f in
                                                              ("thread", "at", "name")], 1), False, False)
    result = {}

    def run():
        result["kv"], result["host"] = racy_steps(fake, 2)
        return 0

    obs = witness.observe(run, second, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second and not obs.ordered and obs.note is None
    calls = fake.witness_calls
    # held before the first fill, marked after it; the copy of step 2 marked, then released
    assert calls[0][0] == "hold" and calls[1][0] == "mark" and calls[2][0] == "mark" and calls[3] == ("release",)
    assert calls[0][1] == calls[1][1] != calls[2][1]
    # what the pair wrote: the fill's block (step 1's value), then the store's host block (step 2's)
    assert [n for _, n in obs.ranges] == [BLOCK, BLOCK]
    assert obs.data == bytes([2]) * BLOCK + bytes([2]) * BLOCK
    assert obs.ranges[1][0].startswith("pinned")


def test_a_witness_run_that_never_meets_the_pair_says_so(fake):
    rec = recorded(fake, racy_steps, 2)
    (plan,), _ = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
    obs = witness.observe(lambda: (racy_steps(fake, 0), 0)[1], plan, IN_ORDER, platform=fake, skip=fake.skip())
    assert not obs.found_first and not obs.found_second and obs.data == b""


PLAN = Plan((1, 2), "RAW", Target(None, "a.py:1 in f", "aten.fill_.Scalar", 0),
            Target(None, "a.py:2 in f", "aten.copy_.default", 0), False, False)


def seen(mode: str, data: bytes, **kw) -> WitnessObservation:
    return WitnessObservation(mode, True, True, ranges=[("pinned1+0x0", len(data))], data=data, **kw)


def judged(a: bytes, b: bytes, f: bytes, **forced):
    return witness.judge(PLAN, "a.py:1 in f", "a.py:2 in f", seen(IN_ORDER, a), seen(IN_ORDER, b),
                         seen(FORCED, f, **forced))


def test_bytes_that_differ_with_the_second_op_first_confirm_the_race():
    out = judged(b"\x5a" * 8 + b"\x00" * 8, b"\x5a" * 8 + b"\x00" * 8, b"\x5a" * 4 + b"\x00" * 12)
    assert out.status == CONFIRMED and (out.differ, out.compared) == (4, 16)
    assert "4 of 16 bytes differ" in out.detail and "pinned1+0x0[4]: 00000000" in out.detail
    assert "issue order gives 5a5a5a5a" in out.detail
    assert out.line().startswith("CONFIRMED: races 1, 2 (RAW): ")
    assert json.loads(json.dumps(out.to_json()))["status"] == CONFIRMED


def test_no_byte_changed_is_not_confirmed():
    out = judged(b"\x01" * 16, b"\x01" * 16, b"\x01" * 16)
    assert out.status == NOT_CONFIRMED and "changed no byte of 16" in out.detail and out.compared == 16


def test_two_runs_in_issue_order_that_differ_are_no_witness():
    out = judged(b"\x01" * 16, b"\x02" + b"\x01" * 15, b"\x03" * 16)
    assert out.status == NO_WITNESS and "not deterministic" in out.detail and "1 of 16 bytes" in out.detail


def test_a_second_op_that_waits_for_the_held_one_is_not_confirmed():
    out = judged(b"\x01" * 16, b"\x01" * 16, b"\x01" * 16, ordered=True)
    assert out.status == NOT_CONFIRMED and "waits for it" in out.detail


def test_a_hold_the_watchdog_released_is_not_confirmed():
    out = judged(b"\x01" * 16, b"\x01" * 16, b"\x02" * 16, expired=1)
    assert out.status == NOT_CONFIRMED and "watchdog" in out.detail


def test_a_pair_not_found_again_is_no_witness():
    lost = WitnessObservation(FORCED, found_first=True)
    out = witness.judge(PLAN, None, None, seen(IN_ORDER, b"\x01"), seen(IN_ORDER, b"\x01"), lost)
    assert out.status == NO_WITNESS and "forced run" in out.detail


def test_record_confirm_lists_a_witness_per_pair_and_writes_them_as_json(tmp_path, monkeypatch, capsys):
    """``kvverify record --confirm --json``, in-process on the stand-in (whose forced order is the
    issue order: not confirmed, with the bytes compared)."""
    status, report, out = record_run(tmp_path, monkeypatch, capsys, "--confirm")
    assert status == 1
    assert "witnesses (1 pair of lines):" in out.out
    assert "not confirmed: race 1 (RAW): the forced order changed no byte of 8,192" in out.out
    assert "witness run 3 of 3 (forced)" in out.err
    assert report["verdict"] == "RACY" and report["complete"] is True
    assert [w["status"] for w in report["witnesses"]] == [NOT_CONFIRMED]


def test_record_without_confirm_writes_no_witness(tmp_path, monkeypatch, capsys):
    status, report, out = record_run(tmp_path, monkeypatch, capsys)
    assert status == 1 and "witnesses" not in out.out
    assert report["witnesses"] is None  # no witness runs made


def test_torch_is_what_the_stand_in_runs_on():
    assert torch.empty(1).device.type == "cpu"


def test_a_preadv_as_the_second_op_is_found_and_forced_through_the_bindings_wrapper(fake, tmp_path):
    """vllm-project/vllm#51667's shape: an H2D swap reads a pinned slot that ``os.preadv`` then
    refills. The read is the second op of a WAR pair: found again by its line, complete when the
    call returns; the swap's stream is held before the swap."""
    pytest.importorskip("cuda.bindings.driver")
    from fake_cuda import ptrs, swap_ops

    kvswap, _ = swap_ops()
    data = tmp_path / "kv.bin"
    data.write_bytes(bytes([1]) * BLOCK + bytes([2]) * BLOCK)

    def program(fake):
        import os

        slot, gpu = fake.pinned(BLOCK), fake.device(2, BLOCK)
        io = fake.stream()
        fd = os.open(data, os.O_RDONLY)
        try:
            for k in range(2):
                os.preadv(fd, [slot.numpy()], k * BLOCK)
                with fake.use(io):
                    kvswap(ptrs(slot.data_ptr()), ptrs(gpu[k].data_ptr()), ptrs(BLOCK), 1)
        finally:
            os.close(fd)
        fake.synchronize()

    rec = recorded(fake, program)
    (plan,), left = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
    assert left == [] and plan.kind == "WAR" and plan.second.name == "os.preadv" and plan.second_on_host
    assert plan.first.name == "kvtest.swap_blocks_batch.default" and plan.second.call == 1
    obs = witness.observe(lambda: (program(fake), 0)[1], plan, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second and not obs.ordered
    calls = [c[0] for c in fake.witness_calls]
    assert calls[:3] == ["hold", "mark", "release"] and set(calls[3:]) == {"release"}  # (observe's own, at the end)
    assert obs.data == bytes([1]) * BLOCK + bytes([2]) * BLOCK  # the swap's block (first batch), the refilled slot


def launcher():
    """Stands for the Python frame of a launcher outside the dispatcher (a Triton kernel's)."""


def test_an_op_seen_only_by_native_capture_is_named_and_not_forced(fake):
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        rec.follow_calls(witness.Forcer(rec.recorder))
        fake.native("launch", side.handle, 0xF00, 1, a.data_ptr(), frames=((launcher.__code__, 3),))
        host.copy_(a, non_blocking=True)
        fake.synchronize()
    plans, left = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
    assert plans == [] and [(o.kind, o.status) for o in left] == [("RAW", NO_WITNESS)]
    assert "seen only by native capture" in left[0].detail and left[0].first_at.endswith(" in launcher")


def test_an_any_order_swap_reading_the_first_ops_output_gets_the_bytes_from_before_it(fake):
    """The early read ``ANY`` permits: the first op's stream is held only while the bytes it is
    about to write are read, then released at once (a program that waits on its stream does not
    block); the swap's destination gets those bytes once the swap completed."""
    from fake_cuda import ptrs, swap_ops

    from kvverify.terms import SrcAccessOrder

    kvswap, _ = swap_ops()

    def program(fake):
        src, dst = fake.device(BLOCK), fake.device(BLOCK)
        compute, copy = fake.stream(), fake.stream()
        with fake.use(compute):
            src.fill_(9)
        copy.wait_stream(compute)
        with fake.use(copy):
            kvswap(ptrs(src.data_ptr()), ptrs(dst.data_ptr()), ptrs(BLOCK), int(SrcAccessOrder.ANY))
        fake.synchronize()
        return src, dst

    rec = recorded(fake, program)
    (plan,), left = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
    assert left == [] and plan.kind == "RAW" and plan.early_read and not plan.second_on_host
    obs = witness.observe(lambda: (program(fake), 0)[1], plan, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second and not obs.ordered and obs.note is None
    calls = [c[0] for c in fake.witness_calls]
    assert calls[:4] == ["hold", "mark", "release", "mark"]  # released before the swap is issued
    assert obs.data == bytes([9]) * (2 * BLOCK)  # (the stand-in ran the fill at its call)


def test_a_confirmed_early_read_says_the_witness_made_the_read():
    early = Plan(PLAN.races, PLAN.kind, PLAN.first, PLAN.second, False, True)
    out = witness.judge(early, None, None, seen(IN_ORDER, b"\x01" * 8), seen(IN_ORDER, b"\x01" * 8),
                        seen(FORCED, b"\x00" * 8))
    assert out.status == CONFIRMED and "the swap's read at its call was made by the witness" in out.detail
    assert "made by the witness" not in judged(b"\x01" * 8, b"\x01" * 8, b"\x00" * 8).detail


def test_a_host_read_annotated_as_the_second_op_is_witnessed_by_the_bytes_it_read(fake):
    """A D2H copy into pinned memory, then ``kvverify.record.host_read`` of the block with no wait:
    the read is found again, and what it saw is read back right then, with the copy still held
    in a forced run (the stand-in has run the copy already: its bytes)."""
    def program(fake):
        kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
        side = fake.stream()
        kv.fill_(5)
        fake.synchronize()
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        record.host_read(host)  # the host consumes the block before the copy is known complete
        fake.synchronize()

    rec = recorded(fake, program)
    (plan,), left = witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)
    assert left == [] and plan.kind == "RAW" and plan.second_on_host and plan.second.name == "host_read"
    obs = witness.observe(lambda: (program(fake), 0)[1], plan, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second
    assert [label.endswith(" as the host read it") for label, _ in obs.ranges] == [False, True]
    assert obs.data == bytes([5]) * (2 * BLOCK)


# -- ops found again across threads ------------------------------------------------------------


def store_on_a_worker_thread(fake):
    """A store copied to pinned memory on its own stream right after compute wrote the block, both
    issued by a worker thread with Python's default thread name ("Thread-N (worker)")."""
    kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()

    def worker():
        kv.fill_(1)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    fake.synchronize()


def test_a_pair_issued_by_a_thread_with_a_default_name_is_found_again_in_a_witness_run_in_this_process(fake):
    """Was: Witness runs in the recording's process (``kvverify corpus --confirm``, ``witness_runs``
    with a platform), and the pytest plugin's child of one test out of a session, number Python's
    default thread names on from where the recording left them: the Target's thread ("Thread-1
    (worker)") never matches the witness run's ("Thread-2 (worker)"), and every race of a thread is
    "no witness"."""
    rec = recorded(fake, store_on_a_worker_thread)
    (plan,), left = plans_of(rec)
    assert left == [] and plan.first.thread is not None
    obs = witness.observe(lambda: (store_on_a_worker_thread(fake), 0)[1], plan, IN_ORDER,
                          platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second, (plan.first.thread, obs)


def test_a_call_is_counted_into_the_ops_of_the_thread_that_issued_it(fake):
    """Was: ``Forcer.after`` runs outside the recorder's lock and writes its count into every op
    logged since its own at its line, whichever thread logged it: another thread running the same line
    in between gets this thread's count. Here thread b's only fill is call 0 of thread b, but is
    logged as call 1 (thread a's), so no witness run finds it again (or finds another op)."""
    a_logged, b_done = threading.Event(), threading.Event()

    class Interleaved(witness.Forcer):
        # only timing: thread a's second fill reaches after() once thread b's fill is logged (a
        # switch of the GIL between the end of the recorder's lock and after())
        def after(self, issued, stream=None):
            if threading.current_thread().name == "a" and issued[0].call == 1:
                a_logged.set()
                b_done.wait(5)
            super().after(issued, stream)

    def work(block, times, go=None, done=None):
        if go is not None:
            go.wait(5)
        for _ in range(times):
            block.fill_(1)
        if done is not None:
            done.set()

    blocks = [fake.device(64), fake.device(64)]

    def program(fake):
        ta = threading.Thread(target=work, args=(blocks[0], 2), name="a")
        tb = threading.Thread(target=work, args=(blocks[1], 1, a_logged, b_done), name="b")
        ta.start()
        tb.start()
        ta.join()
        tb.join()

    with record.recording(platform=fake, skip=fake.skip()) as rec:
        rec.follow_calls(Interleaved(rec.recorder))
        program(fake)
    calls = [(op["thread"], op["call"]) for op in rec.recorder.ops if op["op"] == "kernel"]
    assert sorted(calls) == [("a", 0), ("a", 1), ("b", 0)], calls


def test_an_op_of_the_dispatcher_with_no_user_line_is_not_called_native_capture(fake):
    """Was: A thread whose target is a torch method has no user frame (``at`` None): ``Forcer.before``
    counts it at "" and ``after`` looks for ops at "", so it never gets a call, and ``plans`` says the
    op "was seen only by native capture", which it was not (it went through torch's dispatcher)."""
    kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()

    def program(fake):
        kv.fill_(1)
        with fake.use(side):
            store = threading.Thread(target=host.copy_, args=(kv,), kwargs={"non_blocking": True}, name="store")
            store.start()
            store.join()
        fake.synchronize()

    rec = recorded(fake, program)
    plans, left = plans_of(rec)
    assert len(plans) + len(left) == 1
    assert all("native capture" not in o.detail for o in left), [o.detail for o in left]


def store_in_a_pool(fake):
    """The store of ``racy`` issued from a ``ThreadPoolExecutor``'s worker (default thread names
    ``ThreadPoolExecutor-<executor number>_<k>``: the executor number counts on over the process)."""
    kv, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()

    def work():
        kv.fill_(1)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)

    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(work).result()
    fake.synchronize()


def test_a_pair_issued_by_a_thread_pool_worker_is_found_again_in_a_witness_run_in_this_process(fake):
    """Was: ``Forcer._thread`` makes only ``Thread-N`` / ``Dummy-N`` stable. A pool worker is named
    ``ThreadPoolExecutor-0_0`` in the recording and ``ThreadPoolExecutor-1_0`` in a witness run in the
    same process (``kvverify corpus --confirm``; a pytest child of one test out of a session that made
    executors before it): its Target never matches, and every race of an executor's worker (the usual
    way a serving engine runs its swaps) is "no witness"."""
    rec = recorded(fake, store_in_a_pool)
    (plan,), left = plans_of(rec)
    assert left == [] and plan.first.thread is not None
    obs = witness.observe(lambda: (store_in_a_pool(fake), 0)[1], plan, IN_ORDER, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second, (plan.first.thread, obs)


# -- plans of batched calls --------------------------------------------------------------------


class Attr:
    def __init__(self, order: int):
        self.srcAccessOrder = order


@pytest.fixture
def batch_stand_in(monkeypatch):
    """cuda-python's ``cuMemcpyBatchAsync`` as a stand-in that succeeds (no copy): what is under test
    is what the recording and the witness make of the call."""
    driver = pytest.importorskip("cuda.bindings.driver")
    monkeypatch.setattr(driver, "cuMemcpyBatchAsync", lambda *args: (driver.CUresult.CUDA_SUCCESS,))
    return driver


def test_a_race_between_two_groups_of_one_batched_call_is_not_planned_as_a_pair(fake, batch_stand_in):
    """Was: One ``cuMemcpyBatchAsync`` of two attribute groups (STREAM a -> b, ANY b -> c) logs two
    ``copy_batch`` ops, racing with each other (RAW). Both have the same Target (one call at one
    line), so the plan's first and second are one op: a witness run never finds a "second", and the
    outcome says the program "did not issue the pair again", which it did (three runs for nothing;
    ``plans`` leaves out a pair that is one op only when it is the same trace op)."""
    driver = batch_stand_in

    def program(fake):
        a, b, c = fake.device(64), fake.device(64), fake.device(64)
        copy = fake.stream()
        driver.cuMemcpyBatchAsync([b.data_ptr(), c.data_ptr()], [a.data_ptr(), b.data_ptr()], [64, 64], 2,
                                  [Attr(1), Attr(3)], [0, 1], 2, copy.handle)
        fake.synchronize()

    rec = recorded(fake, program)
    assert [r.kind for r in rec.check().races] == ["RAW"]
    plans, left = plans_of(rec)
    assert all(p.first != p.second for p in plans), plans
    assert len(left) == 1 and left[0].status == NO_WITNESS


class WriteSpy(FakeCuda):
    """The stand-in, keeping the addresses a witness run writes (an early read's bytes)."""

    def witness_tools(self, internal):
        tools = FakeTools(self)
        self.writes = []
        original = tools.write

        def write(address, data, device):
            self.writes.append((address, len(data)))
            original(address, data, device)

        tools.write = write
        return tools


def test_an_early_read_gives_old_bytes_only_to_the_copies_that_may_read_early(batch_stand_in):
    """Was: A batched call whose first group is STREAM order (behind the copy stream's wait for
    compute: it reads the fill's bytes) and whose second is ANY (may read at the call, before the
    fill: the race). The forced run writes the bytes from before the fill into the destination of
    every copy of the call whose source the fill wrote, the STREAM group's too: on a device that
    fabricates differing bytes where no order CUDA permits gives them (and reports the first of
    them)."""
    driver = batch_stand_in
    fake = WriteSpy()
    result = {}

    def program(fake):
        src, dst = fake.device(128), fake.device(128)
        compute, copy = fake.stream(), fake.stream()
        with fake.use(compute):
            src.fill_(9)
        copy.wait_stream(compute)
        driver.cuMemcpyBatchAsync([dst.data_ptr(), dst.data_ptr() + 64], [src.data_ptr(), src.data_ptr() + 64],
                                  [64, 64], 2, [Attr(1), Attr(3)], [0, 1], 2, copy.handle)
        fake.synchronize()
        result["dst"] = dst

    rec = recorded(fake, program)
    (plan,), left = plans_of(rec)
    assert left == [] and plan.early_read
    obs = witness.observe(lambda: (program(fake), 0)[1], plan, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second
    base = result["dst"].data_ptr()
    written = sorted((address - base, n) for address, n in fake.writes)
    assert written == [(64, 64)], written  # the ANY group's destination alone


# -- a host read as the second op --------------------------------------------------------------


def test_a_host_read_too_large_to_read_back_is_not_judged_on_the_first_ops_bytes_alone(fake, monkeypatch):
    """Was: A D2H copy of 512 bytes into a pinned block, then ``host_read`` of the whole block with no
    wait. Where the host read is larger than ``MAX_BYTES`` (256 MiB; lowered here), ``_witness`` drops
    what it read without a note: the runs compare the copy's 512 bytes alone, read once the copy
    completed (the same in every order), and the race comes out "not confirmed: the forced order
    changed no byte", which no run showed: what the host read was never compared."""
    monkeypatch.setattr(witness, "MAX_BYTES", 4096)

    def program(fake):
        kv, host = fake.device(512), fake.pinned(2 * BLOCK)
        side = fake.stream()
        kv.fill_(5)
        fake.synchronize()
        with fake.use(side):
            host[:512].copy_(kv, non_blocking=True)
        record.host_read(host)  # the host consumes the whole block before the copy is known complete
        fake.synchronize()

    rec = recorded(fake, program)
    (plan,), left = plans_of(rec)
    assert left == [] and plan.second_on_host and plan.second.name == "host_read"
    obs = witness.observe(lambda: (program(fake), 0)[1], plan, FORCED, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second
    read_back = any(label.endswith(" as the host read it") for label, _ in obs.ranges)
    assert read_back or obs.note is not None, obs.meta()


# -- the verdict of three runs: what is compared -----------------------------------------------


ONE_RACE = Plan((1,), "RAW", Target(None, "a.py:1 in f", "aten.fill_.Scalar", 0),
                Target(None, "a.py:2 in f", "aten.copy_.default", 0), False, False)


def test_runs_that_read_ranges_of_other_sizes_are_not_compared_byte_for_byte():
    """Was: ``judge`` compares the total length of the bytes read only: runs in issue order that read
    4 bytes of the first op and 12 of the second, and a forced run that read 12 and 4, are compared
    position by position (the first op's bytes against the second's) and CONFIRMED. The pair wrote
    other ranges in the forced run: the program is not deterministic here."""
    same = bytes([1]) * 4 + bytes([2]) * 12
    in_order = [WitnessObservation(IN_ORDER, True, True, ranges=[("device1+0x0", 4), ("pinned1+0x0", 12)], data=same)
                for _ in range(2)]
    forced = WitnessObservation(FORCED, True, True, ranges=[("device1+0x0", 12), ("pinned1+0x0", 4)],
                         data=bytes([1]) * 12 + bytes([2]) * 4)
    out = witness.judge(ONE_RACE, "a.py:1 in f", "a.py:2 in f", *in_order, forced)
    assert out.status == NO_WITNESS, out.line()


def test_runs_that_read_other_buffers_of_the_same_sizes_are_not_compared_byte_for_byte():
    """Was: ``judge`` compares the runs' range sizes only, not what they are: runs in issue order
    whose pair wrote ``device1+0x0`` and a forced run whose pair wrote ``device1+0x40`` (another
    block: the program took another path) are compared position by position and CONFIRMED, with the
    first difference reported at the in-order run's label. The pair wrote other bytes in the forced
    run: nothing is witnessed."""
    ranges = [("device1+0x0", 8), ("pinned1+0x0", 8)]
    in_order = [WitnessObservation(IN_ORDER, True, True, ranges=list(ranges), data=bytes([1]) * 16) for _ in range(2)]
    forced = WitnessObservation(FORCED, True, True, ranges=[("device1+0x40", 8), ("pinned1+0x0", 8)],
                         data=bytes([0]) * 8 + bytes([1]) * 8)
    out = witness.judge(ONE_RACE, "a.py:1 in f", "a.py:2 in f", *in_order, forced)
    assert out.status == NO_WITNESS, out.line()
