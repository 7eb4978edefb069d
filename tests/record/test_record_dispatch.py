"""The dispatcher hook on real aten ops, with a CUDA stand-in (``fake_cuda``): kernels from schema
alias annotations, copies and the synchronization a blocking one implies, batched swaps with their
order and raw pointers resolved, host accesses, and the races each historical mistake makes."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCuda, ptrs, swap_ops

from kvverify.check import Trace, check
from kvverify.record import recording
from kvverify.record.trace.recorder import short_at

BLOCK = 4096


def record(fake, **kwargs):
    return recording(platform=fake, skip=fake.skip(), **kwargs)


def ops_of(rec, *kinds):
    return [op for op in rec.trace()["ops"] if not kinds or op["op"] in kinds]


def here(offset: int = 0) -> str:
    import inspect

    frame = inspect.currentframe().f_back
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno + offset}"


def test_kernel_accesses_follow_the_schema_views_launch_nothing_and_strided_views_cover_their_span(fake):
    gpu = fake.device(8, BLOCK)
    out = fake.device(BLOCK)
    with record(fake, keep_all=True) as rec:
        gpu[1].fill_(7)  # aten.select is a view: no kernel; fill_ writes self (Tensor(a!))
        torch.add(gpu[2], gpu[3], out=out)  # out= writes out, reads the two inputs
        gpu[:, 0].zero_()  # a strided view: its covering span, first byte of block 0 to first of block 7
    kernels = ops_of(rec, "kernel")
    assert [k["name"] for k in kernels] == ["aten.fill_.Scalar", "aten.add.out", "aten.zero_.default"]
    g = kernels[0]["writes"][0][0]
    assert kernels[0]["writes"] == [[g, BLOCK, BLOCK]] and kernels[0]["reads"] == []
    assert sorted(kernels[1]["reads"]) == [[g, 2 * BLOCK, BLOCK], [g, 3 * BLOCK, BLOCK]]
    assert kernels[1]["writes"][0][1:] == [0, BLOCK]
    assert kernels[2]["writes"] == [[g, 0, 7 * BLOCK + 1]]
    assert all(k["stream"] == "default" for k in kernels)


def test_kernels_run_on_the_current_stream_and_a_missing_wait_is_a_race_between_the_two_lines(fake):
    gpu = fake.device(4, BLOCK)
    compute, side = fake.stream(), fake.stream()
    with record(fake, keep_all=True) as rec:
        with fake.use(compute):
            gpu[0].fill_(1)
            first = here(-1)
        with fake.use(side):
            gpu[0].add_(1)
            second = here(-1)
    verdict = rec.check()
    (race,) = verdict.races
    ops = rec.trace()["ops"]
    assert race.kind == "WAW"
    assert short_at(ops[race.first]["at"]) == first and short_at(ops[race.second]["at"]) == second
    assert ops[race.first]["stream"] != ops[race.second]["stream"]


def test_a_blocking_copy_synchronizes_its_stream_and_a_non_blocking_one_does_not(fake):
    gpu = fake.device(2, BLOCK)
    pinned = fake.pinned(2, BLOCK)
    pageable = fake.pageable(2, BLOCK)
    with record(fake) as rec:
        gpu[0].copy_(pinned[0], non_blocking=True)  # H2D from pinned: stream-ordered
        pageable[1].copy_(gpu[1])  # blocking D2H: copy, then the stream sync torch does
    ops = ops_of(rec)
    assert [op["op"] for op in ops] == ["copy", "copy", "sync_stream"]
    h2d, d2h = ops[0], ops[1]
    buffers = rec.trace()["buffers"]
    assert buffers[h2d["src"][0]]["space"] == "host_pinned" and buffers[h2d["dst"][0]]["space"] == "device"
    assert buffers[d2h["dst"][0]]["space"] == "host_pageable" and d2h["dst"][1:] == [BLOCK, BLOCK]


def test_arguments_are_read_positional_by_keyword_or_as_the_schemas_default_at_every_call(fake):
    # what a schema says of its arguments is kept per op: each call still reads its own values
    kvswap, _ = swap_ops()
    gpu = fake.device(4, BLOCK)
    pinned = fake.pinned(4, BLOCK)
    pair = (ptrs(gpu[0].data_ptr()), ptrs(pinned[0].data_ptr()), ptrs(BLOCK))
    with record(fake) as rec:
        gpu[0].copy_(pinned[0], True)  # non_blocking, positional
        gpu[1].copy_(pinned[1])  # the default: blocking
        gpu[2].copy_(pinned[2], non_blocking=True)
        gpu[3].copy_(pinned[3], non_blocking=False)
        kvswap(*pair)  # src_access_order's default: STREAM
        kvswap(*pair, 3)
        kvswap(*pair, src_access_order=2)
    assert [op["op"] for op in ops_of(rec, "copy", "sync_stream")] == ["copy", "copy", "sync_stream", "copy", "copy",
                                                                     "sync_stream"]
    assert [op["order"] for op in ops_of(rec, "copy_batch")] == ["STREAM", "ANY", "DURING_API_CALL"]


def test_a_host_read_of_a_non_blocking_d2h_destination_races_until_it_is_synchronized(fake):
    gpu = fake.device(BLOCK)
    pinned = fake.pinned(BLOCK)
    with record(fake) as rec:
        pinned.copy_(gpu, non_blocking=True)
        pinned.sum()  # H4: consumed before completion
    assert not rec.check().safe
    with record(fake) as rec:
        pinned.copy_(gpu, non_blocking=True)
        done = fake.event()
        done.record()
        done.synchronize()
        pinned.sum()
    assert rec.check().safe


def test_a_copy_that_converts_dtype_keeps_every_byte_of_both_sides(fake):
    gpu = fake.device(16, dtype=torch.float32)
    pinned = fake.pinned(16, dtype=torch.float16)
    with record(fake) as rec:
        gpu.copy_(pinned, non_blocking=True)  # 32 host bytes to 64 device bytes
    copy, rest = ops_of(rec, "copy", "kernel")
    assert (copy["op"], copy["src"][2], copy["dst"][2]) == ("copy", 32, 32)
    assert rest["op"] == "kernel" and rest["writes"][0][1:] == [32, 32]


def test_a_pinned_staging_buffer_rewritten_while_its_h2d_is_pending_races(fake):
    gpu = fake.device(BLOCK)
    staging = fake.pinned(BLOCK)
    load = fake.stream()
    with record(fake) as rec:
        staging.fill_(1)
        with fake.use(load):
            gpu.copy_(staging, non_blocking=True)
            copied = here(-1)
        staging.fill_(2)  # H3: the CPU runs ahead
        rewritten = here(-1)
    (race,) = rec.check().races
    ops = rec.trace()["ops"]
    assert (ops[race.first]["op"], ops[race.second]["op"], race.kind) == ("copy", "host_write", "WAR")
    assert short_at(ops[race.first]["at"]) == copied and short_at(ops[race.second]["at"]) == rewritten


def test_a_batched_swap_resolves_every_pointer_and_keeps_its_order(fake):
    kvswap, _ = swap_ops()
    gpu = fake.device(4, BLOCK)
    cpu = fake.pinned(4, BLOCK)
    with record(fake) as rec:
        kvswap(ptrs(gpu[1].data_ptr(), gpu[3].data_ptr()), ptrs(cpu[0].data_ptr(), cpu[2].data_ptr()),
               ptrs(BLOCK, BLOCK), 2)
    (op,) = ops_of(rec)
    assert (op["op"], op["order"], op["name"]) == ("copy_batch", "DURING_API_CALL", "kvtest.swap_blocks_batch.default")
    assert [(c["src"][1], c["dst"][1]) for c in op["copies"]] == [(BLOCK, 0), (3 * BLOCK, 2 * BLOCK)]
    buffers = rec.trace()["buffers"]
    assert {buffers[c["src"][0]]["space"] for c in op["copies"]} == {"device"}  # from the allocator's blocks
    assert {buffers[c["dst"][0]]["space"] for c in op["copies"]} == {"host_pinned"}  # from CUDA's host ranges
    assert rec.summary().unresolved == []


def test_a_swap_is_recorded_with_the_sizes_it_was_called_with_whatever_the_program_does_with_them_later(fake):
    # the log must own what it keeps: a view of the program's sizes tensor would follow its later
    # rewrites (and keep its memory from the allocator, so that every call's tensor is new memory)
    kvswap, _ = swap_ops()
    gpu = fake.device(2, BLOCK)
    cpu = fake.pinned(2, BLOCK)
    sizes = ptrs(BLOCK, BLOCK)
    with record(fake) as rec:
        kvswap(ptrs(gpu[0].data_ptr(), gpu[1].data_ptr()), ptrs(cpu[0].data_ptr(), cpu[1].data_ptr()), sizes, 1)
    sizes.fill_(16)  # the program reuses its sizes tensor
    (op,) = ops_of(rec)
    assert [(c["src"][2], c["dst"][2]) for c in op["copies"]] == [(BLOCK, BLOCK)] * 2


def test_an_engines_own_swap_op_is_recorded_when_named_with_its_order(fake):
    _, engine = swap_ops()
    gpu = fake.device(BLOCK)
    cpu = fake.pinned(BLOCK)
    args = (ptrs(gpu.data_ptr()), ptrs(cpu.data_ptr()), ptrs(BLOCK), True)
    with record(fake) as rec:
        engine(*args)
    assert ops_of(rec, "copy_batch") == []  # an unknown op of that name is a kernel over its tensors
    with record(fake, swap_ops=["engine::transfer"]) as rec:
        engine(*args)
        engine(*args[:3], is_src_access_order_any=False)
    assert [op["order"] for op in ops_of(rec, "copy_batch")] == ["ANY", "STREAM"]


def test_a_pointer_into_no_known_allocation_is_reported_by_name_and_never_dropped(fake):
    kvswap, _ = swap_ops()
    gpu = fake.device(BLOCK)
    lost = fake.pageable(BLOCK)  # plain host memory nothing told the recorder of
    with record(fake) as rec:
        kvswap(ptrs(gpu.data_ptr()), ptrs(lost.data_ptr()), ptrs(BLOCK), 1)
        at = here(-1)
    (op,) = ops_of(rec)
    name = op["copies"][0]["dst"][0]
    assert name == f"unresolved {lost.data_ptr():#x}"
    assert rec.trace()["buffers"][name]["space"] == "host_pageable"
    (u,) = rec.summary().unresolved
    assert u.reason == "dst_ptrs[0] lies in no allocation the recording knows" and short_at(u.at) == at


def test_a_range_that_runs_past_its_allocation_makes_the_recording_incomplete(fake):
    """Its placeholder shares no bytes with the allocation it runs into: a race on those bytes is not
    decided, so the recording must not pass for complete."""
    import kvverify.record as kvrecord

    kvswap, _ = swap_ops()
    gpu = fake.device(2 * BLOCK)
    cpu = fake.pinned(2 * BLOCK)  # the memory is there; the program declared only its first block
    with record(fake) as rec:
        kvrecord.host_buffer((cpu.data_ptr(), BLOCK), "pinned", name="slot")
        kvswap(ptrs(gpu.data_ptr()), ptrs(cpu.data_ptr()), ptrs(2 * BLOCK), 1)  # runs a block past the slot
    assert rec.complete() is False
    assert any(n.startswith("NOT RECORDED (ranges that run past") and n.endswith(": 1") for n in rec.summary().notes)
    with record(fake) as ok:
        kvrecord.host_buffer((cpu.data_ptr(), BLOCK), "pinned", name="slot")
        kvswap(ptrs(gpu.data_ptr()), ptrs(cpu.data_ptr()), ptrs(BLOCK), 1)
    assert ok.complete()


def test_memory_learnt_later_takes_in_the_unresolved_range_so_both_accesses_name_one_buffer(fake):
    kvswap, _ = swap_ops()
    gpu = fake.device(BLOCK)
    host = fake.pageable(BLOCK)
    end = fake.event()
    with record(fake) as rec:
        kvswap(ptrs(gpu.data_ptr()), ptrs(host.data_ptr()), ptrs(BLOCK), 1)
        end.record()
        end.done = False
        end.query()  # false: the store has not finished
        host.sum()  # the host reads the (pageable) tensor: the recorder learns its storage
    swap, _, _, read = ops_of(rec)
    assert swap["copies"][0]["dst"][0] == read["ranges"][0][0]
    assert rec.summary().unresolved == []
    assert not rec.check().safe


def test_freed_device_memory_is_not_a_buffer_any_more(fake):
    kvswap, _ = swap_ops()
    gpu = fake.device(BLOCK)
    cpu = fake.pinned(BLOCK)
    with record(fake) as rec:
        gpu.fill_(1)
        fake.free(gpu)  # the allocator's block went back
        kvswap(ptrs(gpu.data_ptr()), ptrs(cpu.data_ptr()), ptrs(BLOCK), 1)
    (u,) = rec.summary().unresolved
    assert u.reason.startswith("src_ptrs[0]")


def test_host_accesses_to_pinned_memory_are_kept_only_where_a_copy_touches_it(fake):
    gpu = fake.device(BLOCK)
    pinned = fake.pinned(BLOCK)
    scratch = fake.pageable(BLOCK)
    with record(fake) as rec:
        scratch.fill_(3)  # host-only memory: summarized
        pinned.copy_(scratch)  # host copy: a host read and a host write
        gpu.copy_(pinned, non_blocking=True)
    kinds = [op["op"] for op in ops_of(rec)]
    assert kinds == ["host_write", "copy"]


def test_a_thread_started_while_recording_is_followed_and_its_join_orders_what_it_observed(fake):
    import threading

    gpu = fake.device(BLOCK)
    cpu = fake.pinned(BLOCK)
    with record(fake) as rec:
        cpu.copy_(gpu, non_blocking=True)
        end = fake.event()
        worker = threading.Thread(target=lambda: (end.record(), end.synchronize()), name="waiter")
        worker.start()
        worker.join()
        cpu.sum()
    doc = rec.trace()
    assert doc["threads"] == [threading.current_thread().name, "waiter"]
    waiter = [op for op in doc["ops"] if op.get("thread") == "waiter"]
    assert [op["op"] for op in waiter if op["op"] not in ("release", "acquire")] == ["record", "sync_event"]
    assert waiter[0]["op"] == "acquire" and waiter[0]["sync"].startswith("start of thread")
    assert waiter[-1]["op"] == "release" and waiter[-1]["sync"].startswith("end of thread")
    assert rec.check().safe and rec.complete(), rec.check().render()


def test_host_bookkeeping_without_a_lock_orders_nothing(fake):
    """The worker observes the copy complete and sets a flag; the main thread spins on the flag and
    reads the host bytes: no lock, queue or join orders the read after the worker's sync."""
    import threading

    gpu = fake.device(BLOCK)
    cpu = fake.pinned(BLOCK)
    done = []
    with record(fake) as rec:
        cpu.copy_(gpu, non_blocking=True)
        end = fake.event()
        end.record()
        worker = threading.Thread(target=lambda: (end.synchronize(), done.append(True)), name="poller")
        worker.start()
        while not done:
            pass
        cpu.sum()
        worker.join()
    races = rec.check().races
    assert [(r.kind, rec.trace()["ops"][r.second]["op"]) for r in races] == [("RAW", "host_read")]


def test_device_work_of_a_thread_running_before_the_recording_is_noted_as_missed(fake):
    import threading

    go, stop = threading.Event(), threading.Event()

    def engine_loop():
        go.wait()
        fake.event().record()
        stop.set()

    old = threading.Thread(target=engine_loop, name="engine-loop")
    old.start()
    with record(fake) as rec:
        go.set()
        stop.wait()
    old.join()
    notes = rec.summary().notes
    assert not rec.complete()
    assert any("'engine-loop'" in n and n.startswith("NOT RECORDED") for n in notes), notes
    assert any("engine-loop" in line for line in rec.summary().lines() if "running beside" in line)


def test_pointer_tensors_on_the_device_are_known_from_the_copy_that_filled_them(fake):
    from kvverify.device import extension

    if extension.load_error() is not None:
        pytest.skip(extension.load_error())
    lib = torch.library.Library("kvverify", "IMPL")  # a host kernel for the stand-in's "device"
    lib.impl("write_blocks", lambda *args: None, "CPU")
    gpu = fake.device(4, BLOCK)
    table = fake.device(2, dtype=torch.int64)
    with record(fake, keep_all=True) as rec:
        table.copy_(ptrs(gpu[1].data_ptr(), gpu[2].data_ptr()), non_blocking=True)
        torch.ops.kvverify.write_blocks(table, BLOCK, table, 1, 0, 0)
        table.add_(0)  # the table changed on the device: its values must be read back
        torch.ops.kvverify.write_blocks(table, BLOCK, table, 1, 0, 0)
    del lib
    writes = [op["writes"] for op in ops_of(rec, "kernel") if op["name"].startswith("kvverify.write_blocks")]
    assert [[w[1:] for w in ws] for ws in writes] == [[[BLOCK, BLOCK], [2 * BLOCK, BLOCK]]] * 2
    assert rec.summary().notes == ["pointer tensors read back from the device (no host copy of them seen): 1"]


def test_every_trace_is_valid_and_names_where_each_op_was_issued(fake):
    kvswap, _ = swap_ops()
    gpu = fake.device(4, BLOCK)
    cpu = fake.pinned(4, BLOCK)
    s = fake.stream()
    with record(fake, keep_all=True) as rec:
        with fake.use(s):
            s.wait_stream(fake.default)
            gpu.zero_()
            kvswap(ptrs(gpu.data_ptr()), ptrs(cpu.data_ptr()), ptrs(BLOCK), 1)
        s.synchronize()
        fake.synchronize()
    doc = rec.trace()
    Trace.from_json(doc)
    assert all(short_at(op["at"]).startswith("test_record_dispatch.py:") for op in doc["ops"])
    assert check(doc).safe


def test_each_handler_names_the_line_that_issued_its_op(fake):
    # handlers start looking for the user's frame above their own and the dispatch mode's frames
    kvswap, _ = swap_ops()
    gpu = fake.device(4, BLOCK)
    pinned = fake.pinned(4, BLOCK)
    lines = []
    with record(fake, keep_all=True) as rec:
        gpu[0].fill_(1)  # _generic
        lines.append(here(-1))
        gpu[1].copy_(pinned[1], non_blocking=True)  # _copy, then _transfer
        lines.append(here(-1))
        gpu[2].view(torch.int32).to(torch.float32)  # _to_copy, then _transfer: to new host memory, blocking
        lines += [here(-1)] * 2
        kvswap(ptrs(gpu[3].data_ptr()), ptrs(pinned[3].data_ptr()), ptrs(BLOCK), 1)  # _swap
        lines.append(here(-1))
    assert [(op["op"], short_at(op["at"])) for op in ops_of(rec)] == list(
        zip(["kernel", "copy", "copy", "sync_stream", "copy_batch"], lines))


def test_a_recorder_error_never_stops_the_program_and_the_summary_says_what_is_missing(fake):
    class Broken(FakeCuda):
        def is_pinned(self, t):
            raise RuntimeError("no answer")

    broken = Broken()
    gpu = broken.device(BLOCK)
    pinned = broken.pinned(BLOCK)
    with record(broken) as rec:
        gpu.copy_(pinned, non_blocking=True)  # the recorder asks is_pinned of the host side, and fails
        gpu.fill_(1)
    assert torch.equal(gpu, torch.full_like(gpu, 1))  # both ops ran
    assert not rec.complete()
    (note,) = rec.summary().notes
    assert note.startswith("NOT RECORDED") and "aten.copy_.default: RuntimeError: no answer" in note
    with record(fake) as rec:
        fake.device(8).fill_(1)
    assert rec.complete()


def test_memory_found_unknown_is_not_looked_up_again_at_every_swap(fake):
    kvswap, _ = swap_ops()
    looked = []
    fake.allocator_blocks = lambda: looked.append(1) or list(fake.blocks)
    gpu = fake.device(BLOCK)
    lost = fake.pageable(BLOCK)
    with record(fake) as rec:
        for _ in range(5):
            kvswap(ptrs(gpu.data_ptr()), ptrs(lost.data_ptr()), ptrs(BLOCK), 1)
    assert len(looked) == 2  # the first swap: the device source, then the unknown destination
    assert {c["dst"][0] for op in ops_of(rec, "copy_batch") for c in op["copies"]} == {f"unresolved {lost.data_ptr():#x}"}


def test_a_foreach_copy_between_host_and_device_is_one_copy_per_pair_and_a_pending_source_rewrite_races(fake):
    # torch._foreach_copy_ runs each pair across host and device as copy_ does (a cudaMemcpyAsync on
    # the current stream): a kernel and a host read at the call would hide the pending read of the
    # pinned staging buffers
    gpu = [fake.device(BLOCK) for _ in range(2)]
    staging = [fake.pinned(BLOCK) for _ in range(2)]
    load = fake.stream()
    with record(fake) as rec:
        with fake.use(load):
            torch._foreach_copy_(gpu, staging, non_blocking=True)
            copied = here(-1)
        staging[1].fill_(2)  # H3: the copy may not have read it yet
        rewritten = here(-1)
    ops = ops_of(rec)
    assert [op["op"] for op in ops] == ["copy", "copy", "host_write"]
    assert {op["name"] for op in ops[:2]} == {"aten._foreach_copy_.default"}
    (race,) = rec.check().races
    assert (ops[race.first]["src"][0], race.kind) == (ops[2]["ranges"][0][0], "WAR")
    assert short_at(ops[race.first]["at"]) == copied and short_at(ops[race.second]["at"]) == rewritten
    with record(fake) as rec:
        with fake.use(load):
            torch._foreach_copy_(staging, gpu)  # blocking D2H: both copies, then the stream's sync
        staging[0].sum()
    assert [op["op"] for op in ops_of(rec)] == ["copy", "copy", "sync_stream", "host_read"]
    assert rec.check().safe


def test_in_place_view_ops_change_a_tensors_metadata_and_write_none_of_its_bytes(fake):
    gpu = fake.device(BLOCK)
    staging = fake.pinned(BLOCK)
    load = fake.stream()
    with record(fake, keep_all=True) as rec:
        with fake.use(load):
            gpu.copy_(staging, non_blocking=True)
        staging.unsqueeze_(0)  # the copy is pending: these touch no byte of its source
        staging.squeeze_(0)
        staging.as_strided_((BLOCK,), (1,))
        gpu.unsqueeze_(0).t_()
    assert [op["op"] for op in ops_of(rec)] == ["copy"]
    assert rec.check().safe


def test_ops_on_sparse_tensors_are_recorded_over_their_indices_and_values(fake):
    # a sparse tensor has no storage of its own: asking for it failed every op on one (a recorder
    # error, and an incomplete recording)
    gpu = fake.device(1, dtype=torch.float32)
    load = fake.stream()
    with record(fake) as rec:
        sparse = torch.eye(4).to_sparse()
        with fake.use(load):
            sparse.values()[:1].copy_(gpu, non_blocking=True)  # D2H into the sparse tensor's values
        doubled = sparse * 2  # reads them before the copy is known to be done
        read = here(-1)
        doubled.coalesce()
    assert rec.complete(), rec.summary().notes
    (race,) = rec.check().races
    ops = rec.trace()["ops"]
    assert (ops[race.first]["op"], ops[race.second]["op"], race.kind) == ("copy", "host_read", "RAW")
    assert (ops[race.second]["name"], short_at(ops[race.second]["at"])) == ("aten.mul.Tensor", read)


def test_the_cuda_platform_calls_a_fake_tensor_no_memory():
    """``torch.library.opcheck`` runs ops on FakeTensors (``FakeTensorMode``): nothing of them is
    memory, and reading one fails ("invalid python storage"), which made their ops NOT RECORDED in
    a recording of kvverify's own GPU tests on the H200."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvverify.record.capture.hooks import CudaPlatform

    with FakeTensorMode():
        on_cuda, on_cpu = torch.empty(4, device="cuda"), torch.empty(4, dtype=torch.int64)
    platform = CudaPlatform()
    assert platform.where(on_cuda) is None and platform.where(on_cpu) is None
    assert platform.where(torch.empty(4)) == "host" and platform.where(torch.empty(4, device="meta")) is None


class NoMemory(FakeCuda):
    """The stand-in, with tensors of one id that it calls no memory (as the CUDA platform calls a
    FakeTensor)."""

    def __init__(self):
        super().__init__()
        self.fakes: set[int] = set()

    def where(self, t):
        return None if id(t) in self.fakes else super().where(t)


def test_a_swap_on_tensors_that_are_no_memory_logs_nothing_and_misses_nothing():
    fake = NoMemory()
    kvswap, _ = swap_ops()
    src, dst = fake.device(64), fake.device(64)
    tables = ptrs(src.data_ptr()), ptrs(dst.data_ptr()), ptrs(64)
    fake.fakes.add(id(tables[0]))
    with recording(platform=fake, skip=fake.skip()) as rec:
        kvswap(*tables, 1)
    assert ops_of(rec, "copy_batch") == [] and rec.complete(), rec.summary().notes
    fake.fakes.clear()
    with recording(platform=fake, skip=fake.skip()) as rec:
        kvswap(*tables, 1)
    assert len(ops_of(rec, "copy_batch")) == 1  # the same swap on real tables is recorded
