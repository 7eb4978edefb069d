"""The witness runs of ``--confirm`` as each way in starts them, on the CUDA stand-in:
``kvverify record --confirm`` (a witness for every racing pair of lines whatever ``--max-races``
lists, in the order of the races they witness; a malformed hidden ``--witness`` spec refused in one
line; a scratch folder with a colon in its path), ``kvverify corpus --confirm`` (a witness run that
raises keeps the recorded verdict), ``kvverify record --confirm -- pytest`` (each test's race
witnessed, a test that fails in the forced order reported, ``--swap-op`` passed on) and ``pytest
--kvverify-confirm`` (calls counted from where the test's recording starts; nothing leaks into the
pytest sessions a test starts). A docstring that starts "Was:" tells the defect its test holds
off, as the code had it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest
from fake_cuda import FakeCuda, shared
from witness_harness import HERE, ROOT, STORE, plugin_run, record_run, witness_lines

from kvverify.record import cli
from kvverify.record.confirm import runs
from kvverify.record.confirm.witness import NOT_CONFIRMED


# -- kvverify record --confirm -----------------------------------------------------------------


MANY_RACES = textwrap.dedent("""\
    import fake_cuda

    fake = fake_cuda.shared()
    kv, host = fake.device(4096), fake.pinned(4096)
    side = fake.stream()
    for step in range(25):  # one racing pair of lines, 25 races
        kv.fill_(step)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        fake.synchronize()
    other = fake.device(64)
    with fake.use(side):
        other.copy_(host[:64], non_blocking=True)
    host.fill_(3)  # another pair of lines: a WAR with the copy above
    fake.synchronize()
    """)


def test_every_racing_pair_of_lines_gets_a_witness_whatever_max_races_lists(tmp_path, monkeypatch, capsys):
    """Was: ``--max-races`` (default 20) bounds the races listed, and "the verdict does not depend on
    it"; ``--confirm`` plans its witnesses from the listed races only, so a pair of lines whose races
    come after the 20th (here the WAR at the end of a program that races 25 times at another pair)
    gets no witness, and neither the output nor the JSON report says so."""
    status, report, _ = record_run(tmp_path, monkeypatch, capsys, "--confirm", program=MANY_RACES)
    assert status == 1
    assert sorted(w["kind"] for w in report["witnesses"]) == ["RAW", "WAR"], report["witnesses"]


@pytest.mark.parametrize("spec", ["garbage", "bogus:plan.json:out.json"])
def test_a_malformed_witness_spec_is_refused_with_one_line(tmp_path, monkeypatch, capsys, spec):
    """Was: The hidden ``--witness MODE:PLAN:OUT``: a spec without its three parts raises a ValueError
    (a traceback from ``kvverify record``) where every other bad command line gives status 2 and one
    line; a mode that is neither in-order nor forced runs the program as neither (no hold, no wait)
    and writes an observation a parent would judge."""
    (tmp_path / "prog.py").write_text("x = 1\n")
    plan = {"races": [1], "kind": "RAW", "first": {"thread": None, "at": "prog.py:1 in <module>", "name": "n", "call": 0},
            "second": {"thread": None, "at": "prog.py:1 in <module>", "name": "m", "call": 0},
            "second_on_host": False, "early_read": False}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    status = cli.run(parser.parse_args(["--witness", spec, "--", "python", "prog.py"]), platform=shared())
    assert status == 2
    assert "kvverify record:" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def confirm_run(tmp_path, monkeypatch, capsys, *options, program=STORE):
    status, report, out = record_run(tmp_path, monkeypatch, capsys, "--confirm", *options, program=program)
    return status, report, out


def test_a_scratch_folder_with_a_colon_in_its_path_still_gives_witnesses(tmp_path, monkeypatch, capsys):
    """Was: The witness spec is ``MODE:PLAN:OUT`` split at the first two colons: a temporary folder
    whose path holds a colon (``TMPDIR=/scratch/job:42``; any Windows drive, ``C:\\...``) splits the
    plan's path, the child refuses its spec, and every pair is "no witness" (the child "observed
    nothing") where the same run with another TMPDIR gives its witness."""
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
    """Was: The witnesses follow the verdict's races (race 1, race 2, ...) in the output and the JSON
    report: ``confirm_races`` lists the planned pairs first and the unplanned ones (a free, an op of
    native capture) after them, so race 2's witness is listed above race 1's and a reader matching the
    two lists by position pairs them wrong."""
    _, report, _ = confirm_run(tmp_path, monkeypatch, capsys, program=FREE_FIRST)
    assert [r["kind"] for r in report["races"]][:2] == ["FREE", "RAW"], report["races"]
    firsts = [w["races"][0] for w in report["witnesses"]]
    assert firsts == sorted(firsts), report["witnesses"]


# -- kvverify corpus --confirm -----------------------------------------------------------------


def test_a_witness_run_that_raises_keeps_the_recorded_verdict_of_a_corpus_case(monkeypatch):
    """Was: ``kvverify corpus --confirm`` runs the witness runs in-process, inside the try that guards
    the recording: a witness run that raises (a program checking what it loaded fails once the forced
    order corrupts it: the race is real) turns the recorded RACY verdict into an error, with no
    verdict and no races."""
    import kvverify.record.session as session
    from kvverify.record.corpus import runner

    fake = FakeCuda()

    def on_the_stand_in(**kwargs):
        kwargs["platform"], kwargs["skip"] = fake, fake.skip()
        return session.Recording(**kwargs)

    monkeypatch.setattr(session, "recording", on_the_stand_in)
    runs = []

    def run(form):
        runs.append(form)
        kv, host = fake.device(64), fake.pinned(64)
        side = fake.stream()
        kv.fill_(1)
        with fake.use(side):
            host.copy_(kv, non_blocking=True)
        fake.synchronize()
        if len(runs) == 4:  # the forced witness run: the program's own check of the stored block fails
            raise AssertionError("the stored block differs")

    case = types.SimpleNamespace(name="store", keep_all=False, capture="dispatch", kind="RAW",
                                 file=Path(__file__).name, pair=("run", "run"), run=run, not_run=None, unseen=None)
    assert runner.recorded(case, "broken").verdict == "RACY"
    runs.clear()
    confirmed = runner.recorded(case, "broken", confirm=True)
    assert confirmed.verdict == "RACY" and confirmed.races == 1, confirmed


# -- kvverify record --confirm -- pytest ... ---------------------------------------------------


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
    env.pop(runs.WITNESS_ENV, None)
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
    """Was: ``kvverify record --confirm -- pytest FILE`` records the whole session in one recording
    (call counts from the session's start), but its witness runs set ``KVVERIFY_WITNESS`` for the
    whole child session: the plugin makes a witness run of every test, each counting from its own
    start and each writing the one observation file, the last test's last. A race in the first of two
    tests is "no witness" (the second test, with no device work, "did not issue the pair")."""
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
    """Was: ``Outcome.program`` is "the forced run's exit status where it failed": with a python
    program it is. A pytest witness run's observation is written by the plugin's fixture with status 0
    whatever the test did, and ``witness_runs`` drops the child's exit status once the observation
    exists: a test that fails in the forced order (its own check saw the race's effect) is reported as
    a clean run, ``program`` null."""
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
    """Was: ``kvverify record --swap-op engine::transfer --confirm -- pytest ...`` (and ``pytest
    --kvverify-swap-op ... --kvverify-confirm``): ``witness_runs`` passes ``--swap-op`` on to the
    child of a python program, but a pytest child gets neither ``--swap-op`` nor
    ``--kvverify-swap-op``: there the engine's swap is no batched swap, its bytes are not read back
    (nor given the early read ``ANY`` permits), and the runs compare the fill's bytes alone."""
    report, out = record_pytest(tmp_path, SWAP_TEST, "--swap-op", "engine::transfer")
    assert report["verdict"] == "RACY", out[-3000:]
    (w,) = report["witnesses"]
    assert w["compared"] == 2 * 4096, w  # the fill's block and the swap's destination


# -- pytest --kvverify-confirm -----------------------------------------------------------------


TESTS = textwrap.dedent("""\


    @pytest.fixture(scope="module")
    def warm():
        refill(128, True)  # the engine's warm-up step, before the test's recording starts


    @pytest.mark.kvverify_record
    def test_marked_racy():
        refill(64, False)


    def test_after_warm_up_racy(warm):
        refill(64, False)
    """)


def test_pytest_confirm_finds_the_pair_of_a_marked_test_again(tmp_path):
    """Was: ``pytest --kvverify-confirm`` runs ``pytest TEST`` as each witness run, under the witness
    run's recording: a test marked ``kvverify_record`` (or using the ``kvverify_record`` fixture)
    starts a recording of its own there, which was refused when recordings did not nest (the test
    errored before its body) and now pauses the witness run's recording (the pair is never seen):
    either way every race of every marked test would be "no witness"."""
    out = plugin_run(tmp_path, TESTS, "-k", "marked")
    assert "races" in out and "witnesses:" in out, out[-3000:]
    found = witness_lines(out, "test_marked_racy")
    assert found and not found[0].startswith("no witness"), found


def test_pytest_confirm_counts_calls_from_where_the_tests_recording_starts(tmp_path):
    """Was: The plugin's recording starts at the test's first function fixture; the witness run's
    recording covers the child's whole pytest session, module fixtures included. A module fixture that
    calls the test's helper (a warm-up step) shifts every call count at its lines: the witness runs
    hold and read the warm-up's copy (128-byte blocks, synchronized), not the test's (64-byte blocks),
    and judge the wrong pair (on a device: the warm-up's synchronize blocks on the held stream, and a
    real race comes out "not confirmed")."""
    out = plugin_run(tmp_path, TESTS, "--kvverify-record", "-k", "after_warm_up")
    found = witness_lines(out, "test_after_warm_up_racy")
    assert found, out[-3000:]
    assert "of 128 " in found[0], found  # the test's pair: 64 device bytes and 64 pinned ones


FIXTURE_FIRST = textwrap.dedent("""\


    @pytest.fixture
    def warm():
        refill(128, True)  # the engine's warm-up step, before the test's recording starts


    def test_fixture_first_racy(warm, kvverify_record):
        refill(64, False)
    """)


def test_pytest_confirm_counts_from_where_a_test_asking_for_the_recording_starts_it(tmp_path):
    """Was: A test that asks for the ``kvverify_record`` fixture after another function fixture (not
    marked, no ``--kvverify-record``) is recorded from that fixture on: the warm-up fixture before it
    is not. In the witness child the plugin's autouse fixture asks for ``kvverify_record`` because
    ``KVVERIFY_WITNESS`` is set, before every other function fixture: the warm-up is counted, and the
    witness runs hold and read the warm-up's synchronized pair (128-byte blocks), not the test's
    (64-byte blocks)."""
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
    """Was: ``KVVERIFY_WITNESS`` stays set for everything the test under a witness run starts: a
    nested pytest (pytester, a test of a pytest plugin, a script's own test run) makes a witness run
    of each of its own tests against the outer plan (on a device: each holding and writing the outer
    observation file); where it has no device (or no stand-in) each of its tests fails. The test then
    behaves otherwise in its witness runs than in its recording: here the nested suite passes when
    recorded and fails in every witness run."""
    rcs = tmp_path / "rcs.txt"
    out = plugin_run(tmp_path, NESTED.replace("RCS", repr(str(rcs))), "--kvverify-record")
    assert witness_lines(out, "test_runs_a_nested_suite_racy"), out[-3000:]
    runs = rcs.read_text().split("\n")[:-1]
    assert len(runs) == 4, runs  # the recording, then two in-order runs and a forced one
    assert all(line.endswith(" 0") for line in runs), runs
