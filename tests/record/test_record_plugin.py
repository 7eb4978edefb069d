"""The pytest plugin: ``--kvverify-record``, the marker and the fixture fail a test whose recorded work
races and leave the others alone; run in a child pytest on the CUDA stand-in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

CONFTEST = textwrap.dedent("""\
    import fake_cuda
    import pytest

    @pytest.fixture
    def kvverify_platform():
        return fake_cuda.shared()
    """)

TESTS = textwrap.dedent("""\
    import fake_cuda
    import pytest

    def refill(synchronized):
        fake = fake_cuda.shared()
        gpu, staging, load, done = fake.device(64), fake.pinned(64), fake.stream(), fake.event()
        with fake.use(load):
            gpu.copy_(staging, non_blocking=True)
            done.record()
        if synchronized:
            done.synchronize()
        staging.fill_(2)

    def test_racy():
        refill(False)

    def test_safe():
        refill(True)

    def test_no_device_work():
        assert 1 + 1 == 2

    @pytest.mark.kvverify_record
    def test_marked_racy():
        refill(False)

    def test_fixture_racy(kvverify_record):
        refill(False)
        assert kvverify_record.running

    def test_failing_body():
        refill(False)
        assert False, "the test's own failure"
    """)


BARE = textwrap.dedent("""\
    import pytest

    @pytest.mark.kvverify_record
    def test_bare_marked():
        pass
    """)


def run(tmp_path: Path, *options: str) -> dict[str, tuple[str, str]]:
    """Run the tests above in a child pytest (``TESTS`` on the stand-in, ``BARE`` on this host as
    it is); return {test name: (outcome, message)}."""
    return child_pytest(tmp_path, {"standin/test_offload.py": TESTS, "standin/conftest.py": CONFTEST,
                                   "bare/test_bare.py": BARE}, *options)


def child_pytest(tmp_path: Path, files: dict[str, str], *options: str, env=None) -> dict[str, tuple[str, str]]:
    """Write ``files`` (path under ``tmp_path``: text) and run pytest with the plugin over their
    folders (``env`` added to its environment); return {test name: (outcome, message)}, the
    outcome "passed", "failure", "error" or "skipped". What it printed is left in
    ``tmp_path / "stdout.txt"``."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    folders = sorted({name.split("/")[0] for name in files})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               **(env or {}))
    xml = tmp_path / "out.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvverify.record.pytest_plugin",
                    f"--junitxml={xml}", *options, *folders],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    (tmp_path / "stdout.txt").write_text(done.stdout)
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = next((case.find(tag) for tag in ("failure", "error", "skipped") if case.find(tag) is not None), None)
        if bad is None:
            out[case.get("name")] = ("passed", "")
        else:  # (a skip's text repeats its message after its place)
            out[case.get("name")] = (bad.tag, bad.get("message", "") + ("" if bad.tag == "skipped" else bad.text or ""))
    return out


def test_record_option_fails_exactly_the_racy_tests_with_the_report(tmp_path):
    out = run(tmp_path, "--kvverify-record", f"--kvverify-trace-dir={tmp_path / 'traces'}", "-k", "not bare")
    assert {name for name, (outcome, _) in out.items() if outcome == "passed"} == {"test_safe", "test_no_device_work"}
    outcome, message = out["test_racy"]
    assert outcome == "failure"
    assert "the device work of standin/test_offload.py::test_racy races" in message
    assert "WAR" in message and "test_offload.py:8 in refill" in message and "test_offload.py:12 in refill" in message
    assert "the test's own failure" in out["test_failing_body"][1]  # the body's failure is reported as it is
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert "standin_test_offload.py_test_safe.json" in traces and "standin_test_offload.py_test_racy.json" in traces


def test_without_the_option_only_marked_tests_and_fixture_users_are_recorded(tmp_path):
    out = run(tmp_path)
    failed = {name for name, (outcome, _) in out.items() if outcome != "passed"}
    assert failed >= {"test_marked_racy", "test_fixture_racy", "test_failing_body"}
    assert failed - {"test_bare_marked"} == {"test_marked_racy", "test_fixture_racy", "test_failing_body"}
    if not torch.cuda.is_available():  # without a CUDA device a test that asks for its recording is skipped
        assert out["test_bare_marked"] == ("skipped", "kvverify record: nothing to record: no CUDA device is visible "
                                           "(torch.cuda.is_available() is False); run it on a GPU host, or check "
                                           "CUDA_VISIBLE_DEVICES and the driver")


NO_DEVICE = textwrap.dedent("""\
    import pytest

    def test_arithmetic():
        assert 1 + 1 == 2

    def test_failing():
        assert False, "its own failure"

    @pytest.mark.kvverify_record
    def test_marked():
        pass

    def test_fixture(kvverify_record):
        pass
    """)


def test_record_option_without_a_device_runs_the_tests_unrecorded_and_says_so_once(tmp_path):
    """``pytest --kvverify-record`` on a host without a CUDA device once errored every test, also
    those that never touch CUDA: now each runs as it would without the option, a test that asks
    for its recording is skipped with the reason, and one line at the end says why nothing was
    recorded."""
    out = child_pytest(tmp_path, {"plain/test_plain.py": NO_DEVICE}, "--kvverify-record",
                       env={"CUDA_VISIBLE_DEVICES": ""})
    reason = ("nothing to record: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU "
              "host, or check CUDA_VISIBLE_DEVICES and the driver")
    assert out["test_arithmetic"] == ("passed", "")
    assert out["test_failing"][0] == "failure" and "its own failure" in out["test_failing"][1]
    assert out["test_marked"] == out["test_fixture"] == ("skipped", f"kvverify record: {reason}")
    printed = (tmp_path / "stdout.txt").read_text()
    assert printed.count("kvverify record: nothing to record") == 1, printed
    assert f"kvverify record: {reason}: 2 tests ran unrecorded (--kvverify-record)" in printed, printed


def test_confirm_lists_a_witness_for_each_racing_pair_and_leaves_safe_tests_alone(tmp_path):
    """``--kvverify-confirm``: the racing test runs again in child pytest processes, each a witness
    run that starts where the test's recording started, on the platform the test's conftest gives
    (the stand-in here, whose forced order is the issue order: the pair is found, its 128 bytes
    compared, and nothing differs)."""
    out = run(tmp_path, "--kvverify-record", "--kvverify-confirm", "-k", "test_racy or test_safe")
    assert out["test_safe"] == ("passed", "")
    outcome, message = out["test_racy"]
    assert outcome == "failure" and "the device work of standin/test_offload.py::test_racy races" in message
    assert "\nwitnesses:\n  not confirmed: race 1 (WAR): the forced order changed no byte of 128 " in message


OPLOG_CONFTEST = textwrap.dedent("""\
    import pytest
    import torch
    from test_oplog import ArenaAsDevice, dispatch_calls

    ARENA = torch.zeros(8 << 10, dtype=torch.uint8)

    @pytest.fixture
    def arena():
        return ARENA

    @pytest.fixture
    def kvverify_platform():
        return ArenaAsDevice(ARENA, [])

    @pytest.fixture
    def handed(monkeypatch):
        return dispatch_calls(monkeypatch)
    """)

OPLOG_TESTS = textwrap.dedent("""\
    def test_fills(handed, arena, kvverify_record, request):
        for k in range(3):
            arena[k * 64:(k + 1) * 64].fill_(k)
        # the op log writes the fills down and the dispatch mode never sees one; --kvverify-no-op-log
        # hands each to the dispatch mode as it runs
        expected = 3 if request.config.getoption("kvverify_no_op_log") else 0
        assert handed.count("aten.fill_.Scalar") == expected, handed
    """)


def test_no_op_log_hands_each_test_s_ops_to_the_dispatch_mode(tmp_path):
    from test_oplog import _native_log

    _native_log()  # skips where the extension is not built
    files = {"oplog/conftest.py": OPLOG_CONFTEST, "oplog/test_oplog_child.py": OPLOG_TESTS}
    assert child_pytest(tmp_path / "logged", files) == {"test_fills": ("passed", "")}
    assert child_pytest(tmp_path / "live", files, "--kvverify-no-op-log") == {"test_fills": ("passed", "")}
