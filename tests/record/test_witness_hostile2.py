"""Hostile tests of ``kvverify record --confirm`` (``kvverify.record.confirm.witness``), second review, on
the CUDA stand-in: each test shows one defect of the witness runs and fails until it is fixed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from witness_harness import (
    HERE,
    ROOT,
    STORE,
    plans_of,
    plugin_run,
    record_run,
    recorded,
    witness_lines,
)

import kvverify.record as record
from kvverify.record import cli
from kvverify.record.confirm import witness
from kvverify.record.confirm.witness import (
    FORCED,
    IN_ORDER,
    NO_WITNESS,
    NOT_CONFIRMED,
    Observation,
    Plan,
    Target,
)

BLOCK = 4096


# -- ops found again ------------------------------------------------------------------------------


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
    """``Forcer._thread`` makes only ``Thread-N`` / ``Dummy-N`` stable. A pool worker is named
    ``ThreadPoolExecutor-0_0`` in the recording and ``ThreadPoolExecutor-1_0`` in a witness run in
    the same process (``kvverify corpus --confirm``; a pytest child of one test out of a session
    that made executors before it): its Target never matches, and every race of an executor's
    worker (the usual way a serving engine runs its swaps) is "no witness"."""
    rec = recorded(fake, store_in_a_pool)
    (plan,), left = plans_of(rec)
    assert left == [] and plan.first.thread is not None
    obs = witness.observe(lambda: (store_in_a_pool(fake), 0)[1], plan, IN_ORDER, platform=fake, skip=fake.skip())
    assert obs.found_first and obs.found_second, (plan.first.thread, obs)


# -- a host read as the second op -----------------------------------------------------------------


def test_a_host_read_too_large_to_read_back_is_not_judged_on_the_first_ops_bytes_alone(fake, monkeypatch):
    """A D2H copy of 512 bytes into a pinned block, then ``host_read`` of the whole block with no
    wait. Where the host read is larger than ``MAX_BYTES`` (256 MiB; lowered here), ``_witness``
    drops what it read without a note: the runs compare the copy's 512 bytes alone, read once the
    copy completed (the same in every order), and the race comes out "not confirmed: the forced
    order changed no byte", which no run showed: what the host read was never compared."""
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


# -- the verdict of three runs --------------------------------------------------------------------


PLAN = Plan((1,), "RAW", Target(None, "a.py:1 in f", "aten.fill_.Scalar", 0),
            Target(None, "a.py:2 in f", "aten.copy_.default", 0), False, False)


def test_runs_that_read_other_buffers_of_the_same_sizes_are_not_compared_byte_for_byte():
    """``judge`` compares the runs' range sizes only, not what they are: runs in issue order whose
    pair wrote ``device1+0x0`` and a forced run whose pair wrote ``device1+0x40`` (another block:
    the program took another path) are compared position by position and CONFIRMED, with the
    first difference reported at the in-order run's label. The pair wrote other bytes in the
    forced run: nothing is witnessed."""
    ranges = [("device1+0x0", 8), ("pinned1+0x0", 8)]
    in_order = [Observation(IN_ORDER, True, True, ranges=list(ranges), data=bytes([1]) * 16) for _ in range(2)]
    forced = Observation(FORCED, True, True, ranges=[("device1+0x40", 8), ("pinned1+0x0", 8)],
                         data=bytes([0]) * 8 + bytes([1]) * 8)
    out = witness.judge(PLAN, "a.py:1 in f", "a.py:2 in f", *in_order, forced)
    assert out.status == NO_WITNESS, out.line()


# -- the command line -----------------------------------------------------------------------------


def confirm_run(tmp_path, monkeypatch, capsys, *options, program=STORE):
    status, report, out = record_run(tmp_path, monkeypatch, capsys, "--confirm", *options, program=program)
    return status, report, out


def test_a_scratch_folder_with_a_colon_in_its_path_still_gives_witnesses(tmp_path, monkeypatch, capsys):
    """The witness spec is ``MODE:PLAN:OUT`` split at the first two colons: a temporary folder
    whose path holds a colon (``TMPDIR=/scratch/job:42``; any Windows drive, ``C:\\...``) splits
    the plan's path, the child refuses its spec, and every pair is "no witness" (the child
    "observed nothing") where the same run with another TMPDIR gives its witness."""
    scratch = tmp_path / "job:42"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    status, report, out = confirm_run(tmp_path, monkeypatch, capsys)
    assert status == 1
    assert [w["status"] for w in report["witnesses"]] == [NOT_CONFIRMED], (report["witnesses"], out.err[-2000:])


FREE_FIRST = textwrap.dedent("""\
    import fake_cuda
    import kvverify.record as record

    fake = fake_cuda.shared()
    kv, host = fake.device(4096), fake.pinned(4096)
    side = fake.stream()
    with fake.use(side):
        kv.copy_(host, non_blocking=True)
    record.free(host)  # race 1: a free under the pending H2D copy (no witness run)
    kv2, host2 = fake.device(4096), fake.pinned(4096)
    kv2.fill_(1)
    with fake.use(side):
        host2.copy_(kv2, non_blocking=True)  # race 2: RAW, witnessed
    fake.synchronize()
    """)


def test_witnesses_are_listed_in_the_order_of_the_races_they_witness(tmp_path, monkeypatch, capsys):
    """The witnesses follow the verdict's races (race 1, race 2, ...) in the output and the JSON
    report: ``confirm_races`` lists the planned pairs first and the unplanned ones (a free, an
    op of native capture) after them, so race 2's witness is listed above race 1's and a reader
    matching the two lists by position pairs them wrong."""
    _, report, _ = confirm_run(tmp_path, monkeypatch, capsys, program=FREE_FIRST)
    assert [r["kind"] for r in report["races"]][:2] == ["FREE", "RAW"], report["races"]
    firsts = [w["races"][0] for w in report["witnesses"]]
    assert firsts == sorted(firsts), report["witnesses"]


# -- kvverify record --confirm -- pytest ... -------------------------------------------------------


DRIVER = textwrap.dedent("""\
    import argparse
    import sys

    import fake_cuda

    from kvverify.record import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    sys.exit(cli.run(parser.parse_args(sys.argv[1:]), platform=fake_cuda.shared()))
    """)

STAND_IN = textwrap.dedent("""\
    import fake_cuda
    import pytest


    @pytest.fixture
    def kvverify_platform():
        return fake_cuda.shared()
    """)


def record_pytest(tmp_path: Path, tests: str, *options: str) -> tuple[dict, str]:
    """``kvverify record --confirm --json report.json OPTIONS -- pytest -q test_prog.py`` on the
    stand-in, in a child process (the recorded pytest session and its witness runs in-process
    there, the plugin loaded by its entry point). Returns the JSON report and the output."""
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "conftest.py").write_text(STAND_IN)
    (tmp_path / "test_prog.py").write_text(tests)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    env.pop(cli.WITNESS_ENV, None)
    done = subprocess.run([sys.executable, "driver.py", "--confirm", "--json", "report.json", *options, "--",
                           "pytest", "-q", "-p", "no:cacheprovider", "test_prog.py"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert (tmp_path / "report.json").exists(), output[-3000:]
    return json.loads((tmp_path / "report.json").read_text()), output


TWO_TESTS = textwrap.dedent("""\
    import fake_cuda


    def test_store_races():
        fake = fake_cuda.shared()
        kv, host = fake.device(64), fake.pinned(64)
        side = fake.stream()
        kv.fill_(1)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        fake.synchronize()


    def test_something_else():
        pass
    """)


def test_record_confirm_of_a_pytest_session_witnesses_a_race_of_its_first_test(tmp_path):
    """``kvverify record --confirm -- pytest FILE`` records the whole session in one recording (call
    counts from the session's start), but its witness runs set ``KVVERIFY_WITNESS`` for the whole
    child session: the plugin makes a witness run of every test, each counting from its own
    start and each writing the one observation file, the last test's last. A race in the first of
    two tests is "no witness" (the second test, with no device work, "did not issue the pair")."""
    report, out = record_pytest(tmp_path, TWO_TESTS)
    assert report["verdict"] == "RACY", out[-3000:]
    assert [w["status"] for w in report["witnesses"]] == [NOT_CONFIRMED], report["witnesses"]


FAILS_WHEN_FORCED = textwrap.dedent("""\
    import os

    import fake_cuda


    def test_store_is_checked():
        fake = fake_cuda.shared()
        kv, host = fake.device(64), fake.pinned(64)
        side = fake.stream()
        kv.fill_(1)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        fake.synchronize()
        # the test's own check of the stored block, which the forced order breaks on a device (the
        # stand-in runs every op at its call: the forced run is told apart by its recording's forcer)
        from kvverify.record import session

        assert session._active._mode.forcer.mode != "forced", "the stored block differs"
    """)


def test_a_pytest_witness_run_whose_test_fails_reports_the_failure(tmp_path):
    """``Outcome.program`` is "the forced run's exit status where it failed": with a python program
    it is. A pytest witness run's observation is written by the plugin's fixture with status 0
    whatever the test did, and ``witness_runs`` drops the child's exit status once the
    observation exists: a test that fails in the forced order (its own check saw the race's
    effect) is reported as a clean run, ``program`` null."""
    report, out = record_pytest(tmp_path, FAILS_WHEN_FORCED)
    assert report["verdict"] == "RACY", out[-3000:]
    (w,) = report["witnesses"]
    assert w["program"] not in (None, 0), w


SWAP_TEST = textwrap.dedent("""\
    import fake_cuda
    from fake_cuda import ptrs, swap_ops


    def test_swap():
        fake = fake_cuda.shared()
        _, transfer = swap_ops()  # engine::transfer, found only with --swap-op
        src, dst = fake.device(4096), fake.device(4096)
        compute, copy = fake.stream(), fake.stream()
        with fake.use(compute):
            src.fill_(9)
        with fake.use(copy):
            transfer(ptrs(src.data_ptr()), ptrs(dst.data_ptr()), ptrs(4096), True)
        fake.synchronize()
    """)


def test_a_pytest_witness_run_sees_the_swap_op_named_on_the_command_line(tmp_path):
    """``kvverify record --swap-op engine::transfer --confirm -- pytest ...`` (and ``pytest
    --kvverify-swap-op ... --kvverify-confirm``): ``witness_runs`` passes ``--swap-op`` on to the
    child of a python program, but a pytest child gets neither ``--swap-op`` nor
    ``--kvverify-swap-op``: there the engine's swap is no batched swap, its bytes are not read
    back (nor given the early read ``ANY`` permits), and the runs compare the fill's bytes alone."""
    report, out = record_pytest(tmp_path, SWAP_TEST, "--swap-op", "engine::transfer")
    assert report["verdict"] == "RACY", out[-3000:]
    (w,) = report["witnesses"]
    assert w["compared"] == 2 * 4096, w  # the fill's block and the swap's destination


# -- pytest --kvverify-confirm ---------------------------------------------------------------------


FIXTURE_FIRST = textwrap.dedent("""\


    @pytest.fixture
    def warm():
        refill(128, True)  # the engine's warm-up step, before the test's recording starts


    def test_fixture_first_racy(warm, kvverify_record):
        refill(64, False)
    """)


def test_pytest_confirm_counts_from_where_a_test_asking_for_the_recording_starts_it(tmp_path):
    """A test that asks for the ``kvverify_record`` fixture after another function fixture (not
    marked, no ``--kvverify-record``) is recorded from that fixture on: the warm-up fixture before
    it is not. In the witness child the plugin's autouse fixture asks for ``kvverify_record``
    because ``KVVERIFY_WITNESS`` is set, before every other function fixture: the warm-up is
    counted, and the witness runs hold and read the warm-up's synchronized pair (128-byte
    blocks), not the test's (64-byte blocks)."""
    out = plugin_run(tmp_path, FIXTURE_FIRST)
    found = witness_lines(out, "test_fixture_first_racy")
    assert found, out[-3000:]
    assert "of 128 " in found[0], found  # the test's pair: 64 device bytes and 64 pinned ones


NESTED = textwrap.dedent("""\


    def test_runs_a_nested_suite_racy(tmp_path):
        refill(64, False)
        (tmp_path / "test_inner.py").write_text("def test_ok():\\n    pass\\n")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                              cwd=tmp_path, capture_output=True, text=True)
        with open(RCS, "a") as f:
            f.write(f"{os.environ.get('KVVERIFY_WITNESS', 'recording').split(':')[0]} {done.returncode}\\n")
    """)


def test_a_witness_run_does_not_leak_into_the_pytest_sessions_its_test_starts(tmp_path):
    """``KVVERIFY_WITNESS`` stays set for everything the test under a witness run starts: a nested
    pytest (pytester, a test of a pytest plugin, a script's own test run) makes a witness run of
    each of its own tests against the outer plan (on a device: each holding and writing the outer
    observation file); where it has no device (or no stand-in) each of its tests fails. The test then behaves otherwise in
    its witness runs than in its recording: here the nested suite passes when recorded and fails
    in every witness run."""
    rcs = tmp_path / "rcs.txt"
    out = plugin_run(tmp_path, NESTED.replace("RCS", repr(str(rcs))), "--kvverify-record")
    assert witness_lines(out, "test_runs_a_nested_suite_racy"), out[-3000:]
    runs = rcs.read_text().split("\n")[:-1]
    assert len(runs) == 4, runs  # the recording, then two in-order runs and a forced one
    assert all(line.endswith(" 0") for line in runs), runs
