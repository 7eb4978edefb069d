"""pytest plugin: fail every test whose recorded device work races.

Loaded by pytest through the ``pytest11`` entry point once kvverify is installed (or with
``-p kvverify.record.pytest_plugin``). Nothing is recorded unless asked:

- ``pytest --kvverify-record``: every test runs under the recorder (from its first fixture to the
  end of its body); after the body the trace is checked and a race fails the test with the report
  (both ops with the lines that issued them, bytes, kind, why, fix);
- ``@pytest.mark.kvverify_record`` on a test, or its ``kvverify_record`` fixture (the running
  ``kvverify.record.Recording``), does the same for that test alone.

``--kvverify-swap-op NS::NAME`` names a serving engine's own batched-swap op;
``--kvverify-trace-dir DIR`` writes each recorded test's trace there; ``--kvverify-confirm``
runs a racing test again in child processes for a device witness of each race (``kvverify
record --confirm``), listed with the failure. Where no CUDA device is visible, a test that asks
for its recording (the marker, the fixture) is skipped with the reason, and ``--kvverify-record``
runs the other tests unrecorded and says so once, at the end; the ``kvverify_platform`` fixture
(None: the CUDA device) can be overridden to record on a stand-in.

Importing this module imports neither torch nor numpy.
"""

from __future__ import annotations

import os
import re

import pytest

from kvverify.record.confirm.runs import WITNESS_ENV
from kvverify.record.session import NO_OP_LOG_HELP

_RECORDING = pytest.StashKey()
_WITNESS = pytest.StashKey()  # the session's witness spec (WITNESS_ENV), or None
_OBSERVATION = pytest.StashKey()  # a test's witness run's observation
_NO_DEVICE = pytest.StashKey()  # why the session cannot record the CUDA device (None: it can), asked once
_UNRECORDED = pytest.StashKey()  # how many tests --kvverify-record ran unrecorded for want of a device


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvverify", "kvverify: record each test's device work and fail it on a race")
    group.addoption("--kvverify-record", action="store_true", default=False,
                    help="record every test's CUDA work (streams, events, copies, batched swaps) and fail a "
                         "test whose work races")
    group.addoption("--kvverify-swap-op", action="append", default=[], metavar="NS::NAME",
                    help="an op with the schema of kvverify::swap_blocks_batch under another name")
    group.addoption("--kvverify-trace-dir", default=None, metavar="DIR",
                    help="write each recorded test's trace to DIR (one JSON file per test)")
    group.addoption("--kvverify-no-op-log", action="store_true", default=False,
                    help=NO_OP_LOG_HELP.replace("the program", "the test") + " (kvverify record --no-op-log)")
    group.addoption("--kvverify-confirm", action="store_true", default=False,
                    help="where a recorded test races, run it again in child processes for a device witness "
                         "of each racing pair of lines (kvverify record --confirm); the failure lists them")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "kvverify_record: record this test's CUDA work and fail it on a race")
    # a witness run of one test (--kvverify-confirm's child): taken out of the environment at once, so
    # that nothing the test starts (a pytest of its own, a subprocess) runs as a witness too
    config.stash[_WITNESS] = os.environ.pop(WITNESS_ENV, None)


def _no_device(config) -> str | None:
    """Why tests cannot be recorded on the CUDA device in this session (no torch, a build without
    CUDA, no device visible), or None; asked once."""
    if _NO_DEVICE not in config.stash:
        from kvverify.device.extension import cuda_refusal

        config.stash[_NO_DEVICE] = cuda_refusal()
    return config.stash[_NO_DEVICE]


@pytest.fixture
def kvverify_platform():
    """The device layer recordings use: None means the CUDA device through torch. Override this
    fixture (e.g. in a conftest) to record on a stand-in."""
    return None


@pytest.fixture
def kvverify_record(request, kvverify_platform):
    """The running ``kvverify.record.Recording`` of this test; the test fails when its recorded
    work races (checked right after the test body)."""
    from kvverify.errors import RecordingError
    from kvverify.record.session import recording

    spec = request.config.stash.get(_WITNESS, None)
    if spec:  # a witness run of this test (--kvverify-confirm's child): it starts where its recording did
        yield from _witness_run(spec, request, kvverify_platform)
        return
    if kvverify_platform is None and _no_device(request.config) is not None:
        pytest.skip(f"kvverify record: nothing to record: {_no_device(request.config)}")
    rec = recording(swap_ops=request.config.getoption("kvverify_swap_op"), platform=kvverify_platform,
                    op_log=not request.config.getoption("kvverify_no_op_log"))
    refused = None
    try:
        rec.start()
    except RecordingError as exc:
        refused = str(exc)
    if refused is not None:  # failed outside the handler: the report shows the reason alone, unchained
        pytest.fail(f"kvverify record: {refused}", pytrace=False)
    request.node.stash[_RECORDING] = rec
    if request.config.getoption("kvverify_confirm"):
        from kvverify.record.confirm.witness import Forcer

        rec.follow_calls(Forcer(rec.recorder))
    try:
        yield rec
    finally:
        rec.stop()


def _witness_run(spec: str, request, platform):
    """The test's body as a witness run (``kvverify.record.confirm.witness.witnessing``), its observation
    written where the spec says; the recording is the test's ``kvverify_record``."""
    from kvverify.errors import RecordingError
    from kvverify.record.confirm import witness
    from kvverify.record.confirm.runs import read_witness_spec

    try:
        mode, plan, out = read_witness_spec(spec)
        running = witness.witnessing(plan, mode, swap_ops=request.config.getoption("kvverify_swap_op"),
                                     platform=platform)
        rec, observation = running.__enter__()
    except (RecordingError, ValueError) as exc:
        pytest.fail(f"kvverify record: witness run: {exc}", pytrace=False)
    request.node.stash[_OBSERVATION] = observation  # (pytest_runtest_call sets its status)
    try:
        yield rec
    finally:
        running.__exit__(None, None, None)
        witness.save(observation, out)


@pytest.fixture(autouse=True)
def _kvverify_record_when_asked(request):
    if request.node.get_closest_marker("kvverify_record") or "kvverify_record" in request.fixturenames:
        request.getfixturevalue("kvverify_record")  # (skipped where there is no device to record)
    elif request.config.getoption("kvverify_record"):
        if request.getfixturevalue("kvverify_platform") is None and _no_device(request.config) is not None:
            # a test that did not ask for its recording runs as it would without the option
            request.config.stash[_UNRECORDED] = request.config.stash.get(_UNRECORDED, 0) + 1
            return
        request.getfixturevalue("kvverify_record")


def pytest_terminal_summary(terminalreporter, config) -> None:
    """The one line that says --kvverify-record recorded nothing, and why."""
    count = config.stash.get(_UNRECORDED, 0)
    if count:
        terminalreporter.write_line(f"kvverify record: nothing to record: {config.stash[_NO_DEVICE]}: {count} "
                                    f"test{'s' if count != 1 else ''} ran unrecorded (--kvverify-record)")


def _trace_file(directory: str, nodeid: str) -> str:
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_") + ".json")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        result = yield  # a failing test body raises here, and is reported as it is
    except BaseException:
        observation = item.stash.get(_OBSERVATION, None)
        if observation is not None:  # a witness run whose test failed: the program's own failure
            observation.status = 1
        raise
    rec = item.stash.get(_RECORDING, None)
    if rec is None or not rec.running:
        return result
    rec.stop()
    directory = item.config.getoption("kvverify_trace_dir")
    if directory:
        os.makedirs(directory, exist_ok=True)
        rec.write(_trace_file(directory, item.nodeid))
    verdict = rec.check()
    if not verdict.safe:
        witnesses = ""
        if item.config.getoption("kvverify_confirm"):
            from kvverify.record.confirm.runs import confirm_races

            test = str(item.path) + item.nodeid[len(item.nodeid.split("::")[0]):]  # from any folder
            # the child records the test from where this run did: --kvverify-record's autouse fixture,
            # else the marker or the test's own request for the kvverify_record fixture
            asked = ["--kvverify-record"] if item.config.getoption("kvverify_record") else []
            command = ["pytest", "-q", "-p", "no:cacheprovider", *asked, test]
            found = confirm_races(command, item.config.getoption("kvverify_swap_op"), rec, verdict, per_test=True)
            witnesses = "\n\nwitnesses:\n" + "\n".join(f"  {w.line()}" for w in found)
        pytest.fail(f"kvverify record: the device work of {item.nodeid} races\n\n{rec.report(item.nodeid)}"
                    f"{witnesses}", pytrace=False)
    if not rec.complete():
        pytest.fail(f"kvverify record: the recording of {item.nodeid} missed device work (NOT RECORDED below); "
                    f"no race in the rest\n\n"
                    f"{rec.report(item.nodeid)}", pytrace=False)
    return result
