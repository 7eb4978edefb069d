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
    (tmp_path / "standin").mkdir()
    (tmp_path / "standin" / "test_offload.py").write_text(TESTS)
    (tmp_path / "standin" / "conftest.py").write_text(CONFTEST)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "test_bare.py").write_text(BARE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvverify.record.pytest_plugin",
                    f"--junitxml={xml}", *options, "standin", "bare"],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        out[case.get("name")] = ("passed", "") if bad is None else (bad.tag, bad.get("message", "") + (bad.text or ""))
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
    if not torch.cuda.is_available():  # without a CUDA device a recorded test fails with the reason
        outcome, message = out["test_bare_marked"]
        assert outcome == "error" and "kvverify record: nothing to record: no CUDA device is visible" in message
        assert "During handling of the above exception" not in message  # the reason alone, unchained


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
