"""``kvverify record`` on a CUDA device: torch's hooks report what the stand-in assumes, the demo offload
handler's forms are reported as expected, pointers resolve through the caching allocator and the
host memory the program made, and the recorder over kvverify's own native executor gives every
cell of the smoke campaign its contract verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from demo_races import EXPECTED, race_marks

from kvverify.record import demo, host_buffer, recording

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4096


def kinds(rec) -> list[str]:
    return [op["op"] for op in rec.trace()["ops"]]


# -- torch's hooks ---------------------------------------------------------------------------------


def test_events_streams_and_synchronization_reach_the_trace():
    gpu = torch.zeros(BLOCK, dtype=torch.uint8, device="cuda")
    pinned = torch.zeros(BLOCK, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with recording() as rec:
        with torch.cuda.stream(side):
            pinned.copy_(gpu, non_blocking=True)  # copy, and torch's pinned-allocator event
            done = torch.cuda.Event()
            done.record()
        torch.cuda.current_stream().wait_event(done)
        while not done.query():
            pass
        done.synchronize()
        side.synchronize()
        generic = torch.Event(device="cuda")
        generic.record(side)
        torch.cuda.synchronize()
        assert generic.query() and side.query()  # both true: everything has completed
        pinned.sum()
    ops = rec.trace()["ops"]
    assert kinds(rec)[:1] == ["copy"]
    for kind in ("record", "wait_event", "query_event", "sync_event", "sync_stream", "sync_device", "host_read"):
        assert kind in kinds(rec), (kind, ops)
    queried = {op["event"] for op in ops if op["op"] == "query_event" and op["result"]}
    recorded = {op["event"] for op in ops if op["op"] == "record"}
    assert len(queried & recorded) >= 3  # torch.cuda.Event, torch.Event and the stream query's
    assert all("test_record_gpu.py:" in op.get("at", "") for op in ops), ops
    assert rec.check().safe


def test_a_blocking_copy_synchronizes_and_a_non_blocking_d2h_into_pinned_memory_races_with_the_host():
    gpu = torch.ones(BLOCK, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with recording() as rec:
        host = gpu.to("cpu")  # blocking: copy + sync
        host.sum()
    assert kinds(rec)[:2] == ["copy", "sync_stream"] and rec.check().safe
    with recording() as rec:
        host = gpu.to("cpu", non_blocking=True)  # pinned output, no sync
        host.sum()
    assert rec.trace()["buffers"][rec.trace()["ops"][0]["dst"][0]]["space"] == "host_pinned"
    assert not rec.check().safe


# -- the demo offload handler ---------------------------------------------------------------------


@pytest.mark.parametrize("mistake", list(EXPECTED), ids=lambda m: m or "safe")
def test_each_form_of_the_offload_handler_is_reported_with_its_pair_of_lines(mistake):
    engine = demo.Engine(demo.Shape(), mistake)
    with recording() as rec:
        engine.run()
    verdict = rec.check()
    assert race_marks(rec.trace(), verdict) == EXPECTED[mistake], verdict.render()
    assert rec.summary().unresolved == [] and rec.complete(), rec.summary().lines()


@pytest.mark.parametrize("mistake, status", [(None, 0), ("load-no-wait", 1)])
def test_the_record_command_on_the_demo(tmp_path, mistake, status):
    command = [sys.executable, "-m", "kvverify", "record", "-o", str(tmp_path / "t.json"), "--", "python", "-m",
               "kvverify.record.demo"] + (["--mistake", mistake] if mistake else [])
    # the report read whole: a screen is laid out for COLUMNS (kvverify.screen)
    r = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=dict(os.environ, COLUMNS="1000"))
    assert r.returncode == status, r.stdout + r.stderr
    assert ("RACY" if status else "SAFE") in r.stdout
    if status:
        assert "in _zero_fresh" in r.stdout and "in transfer_async" in r.stdout


def demo_tests(tmp_path, *options: str) -> subprocess.CompletedProcess:
    """A safe test of the demo handler and one in its ``store-any`` form, in a child pytest with
    the plugin and ``--kvverify-record OPTIONS``."""
    (tmp_path / "test_demo.py").write_text(
        "from kvverify.record import demo\n\n"
        "def test_safe():\n    demo.Engine(demo.Shape()).run()\n\n"
        "def test_store_any():\n    demo.Engine(demo.Shape(), 'store-any').run()\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "kvverify.record.pytest_plugin", "--kvverify-record", *options,
                           str(tmp_path / "test_demo.py")], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)


def test_the_pytest_plugin_fails_the_racy_test_on_the_device(tmp_path):
    r = demo_tests(tmp_path)
    assert "1 failed, 1 passed" in r.stdout, r.stdout + r.stderr
    assert "test_store_any races" in r.stdout and "in _write_kv" in r.stdout


def test_the_pytest_plugin_confirms_the_racy_test_on_the_device(tmp_path):
    """``--kvverify-confirm``: the racing test's pair forced in a child run shows its bytes; the
    safe test is never run again."""
    r = demo_tests(tmp_path, "--kvverify-confirm")
    print(r.stdout[-3000:])
    assert "1 failed, 1 passed" in r.stdout, r.stdout + r.stderr
    assert "witnesses:" in r.stdout and "CONFIRMED: race" in r.stdout, r.stdout[-3000:]


# -- pointer resolution ------------------------------------------------------------------------------


def test_pointers_resolve_to_memory_made_before_and_during_the_recording_and_freed_memory_does_not():
    from kvverify.device import cuda_python, extension, host_memory

    swap = extension.ops().swap_blocks_batch
    early_gpu = torch.zeros(4, BLOCK, dtype=torch.uint8, device="cuda")  # before: the allocator's snapshot
    early_pinned = torch.zeros(4, BLOCK, dtype=torch.uint8, pin_memory=True)  # before: CUDA's host ranges
    declared = torch.zeros(BLOCK, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()

    def ptr(t, block=0):
        return t.data_ptr() + block * BLOCK

    def batch(src, dst):
        swap(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64),
             torch.full((len(src),), BLOCK, dtype=torch.int64), 1)

    with recording() as rec:
        pinned = host_memory.allocate_host("pinned", 2 * BLOCK)  # kvverify's cudaHostAlloc
        registered = host_memory.allocate_host("registered", 2 * BLOCK)  # kvverify's cudaHostRegister
        late = torch.empty(2, BLOCK, dtype=torch.uint8, device="cuda")
        late.zero_()
        batch([ptr(early_gpu, 1), ptr(late, 1), ptr(late, 0)], [ptr(early_pinned, 2), pinned.ptr + BLOCK, registered.ptr])
        host_buffer(declared, "pinned", name="staging")
        batch([ptr(early_gpu, 3)], [declared.data_ptr()])
        torch.cuda.synchronize()
        gone = ptr(late)
        assert rec.recorder.memory.find(gone) is not None
        del late  # the caching allocator takes the block back: its addresses are no buffer any more
        rec.recorder.collect()  # (the recording takes the free from the native log at its next op)
        assert rec.recorder.memory.find(gone) is None
        pinned.free()
        registered.free()
    first, second = [op for op in rec.trace()["ops"] if op["op"] == "copy_batch"]
    buffers = rec.trace()["buffers"]
    spaces = [(buffers[c["src"][0]]["space"], buffers[c["dst"][0]]["space"]) for c in first["copies"]]
    expected_early = "host_pinned" if cuda_python.pointer_range(early_pinned.data_ptr()) else "host_pageable"
    assert spaces == [("device", expected_early), ("device", "host_pinned"), ("device", "host_registered")]
    assert [c["src"][1] for c in first["copies"]] == [BLOCK, BLOCK, 0]
    assert second["copies"][0]["dst"][0] == "staging"


# -- the executor self-check -------------------------------------------------------------------------


def test_recording_the_native_executor_gives_every_cell_its_contract_verdict():
    """Each native cell of the smoke campaign (every scenario, direction, order and host memory
    kind), one trial, recorded: the recording's verdict must be the checker's verdict of the
    scenario's own trace."""
    from kvverify.geometry import KVLayout, ModelGeometry
    from kvverify.scenarios import Params
    from kvverify.stress import planning, running
    from kvverify.stress.campaign import load

    tiny = KVLayout(ModelGeometry("tiny", 2, 2, 64, 2), block_size=16)
    params = Params(blocks_per_transfer=2, transfers=3)
    campaign = load("smoke").override(executors=("native",), trials=1, max_trials=1, min_checked=1,
                                      writer_delay_us=200, reader_us=200, hold_timeout_s=20.0)
    planned = planning.plan(campaign, tiny, params)
    disagreements, errors = [], []
    for pc in planned:
        with recording() as rec:
            outcome = running.execute([pc], campaign, tiny, params)[pc.cell]
        if outcome.error:
            errors.append(f"{pc.cell.label}: {outcome.error}")
            continue
        verdict = rec.check()
        if verdict.verdict != pc.contract or not rec.complete():
            witness = verdict.render().splitlines()[2:6] if verdict.races else []
            disagreements.append(f"{pc.cell.label}: contract {pc.contract}, recorded {verdict.verdict} {witness}"
                                 f" {rec.summary().lines()}")
    print(f"executor self-check: {len(planned)} native cells, {len(planned) - len(disagreements) - len(errors)} "
          f"agree, {len(disagreements)} disagree, {len(errors)} errors")
    assert not errors, "\n".join(errors)
    assert not disagreements, "\n".join(disagreements)


# -- lifetimes: the allocators' reuse of bytes ----------------------------------------------------------


@pytest.mark.parametrize("record_stream", [False, True], ids=["freed", "record_stream"])
def test_a_block_freed_under_a_side_streams_copy_is_one_buffer_with_its_next_owner(record_stream):
    side = torch.cuda.Stream()
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    with recording() as rec:
        x = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
        address = x.data_ptr()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(10_000_000)
            host.copy_(x, non_blocking=True)
        if record_stream:
            x.record_stream(side)
        del x
        y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        reused = y.data_ptr() == address
        y.fill_(7)
        torch.cuda.synchronize()
    assert reused != record_stream  # the allocator holds a block back only after record_stream
    verdict = rec.check()
    if record_stream:
        assert verdict.safe, verdict.render()
        return
    kinds = {(r.kind, rec.trace()["ops"][r.first]["op"]) for r in verdict.races}
    assert ("WAR", "copy") in kinds, verdict.render()


@pytest.mark.parametrize("raw", [True, False], ids=["swap-of-raw-pointers", "copy_"])
def test_a_pinned_temporary_dropped_under_its_copy_races_only_where_torch_did_not_see_the_copy(raw):
    from kvverify.device import extension

    swap = extension.ops().swap_blocks_batch
    side = torch.cuda.Stream()
    gpu = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with recording() as rec:
        temp = torch.full((1 << 16,), 3, dtype=torch.uint8).pin_memory()
        address = temp.data_ptr()
        with torch.cuda.stream(side):
            # ~50 ms: a new pinned block (cudaHostAlloc) can take milliseconds, and the copy must
            # still be pending when the next one is handed out
            torch.cuda._sleep(100_000_000)
            if raw:
                swap(torch.tensor([address]), torch.tensor([gpu.data_ptr()]), torch.tensor([1 << 16]), 1)
            else:
                gpu.copy_(temp, non_blocking=True)
        del temp
        again = torch.full((1 << 16,), 5, dtype=torch.uint8).pin_memory()
        reused = again.data_ptr() == address
        pending = not side.query()
        torch.cuda.synchronize()
    assert pending, "the copy completed before the block was handed out again: the window did not open"
    assert reused == raw  # torch's pinned allocator waits for the events of the copies it saw
    verdict = rec.check()
    assert verdict.safe != raw, verdict.render()
