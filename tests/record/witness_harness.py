"""What the tests of ``--confirm`` share: a racing store program and ``kvverify record --confirm``
run in-process on the CUDA stand-in, and a child pytest with the plugin whose witness runs are
made in-process on the stand-in."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fake_cuda import shared

import kvverify.record as record
from kvverify.record import cli
from kvverify.record.confirm import runs, witness

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

def recorded(fake, program, *args, forcer=None):
    """``program(fake, *args)`` recorded on the stand-in ``fake``, each op's calls counted
    (``forcer``: a ``witness.Forcer`` of the test's own, else the recording's counting one)."""
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        rec.follow_calls(forcer or witness.Forcer(rec.recorder))
        program(fake, *args)
    return rec


def plans_of(rec):
    """``witness.plans`` of a recording's races: ``(plans, outcomes of what no run can witness)``."""
    return witness.plans(rec.recorder.ops, rec.summary().sources, rec.check().races)


STORE = textwrap.dedent("""\
    import fake_cuda

    fake = fake_cuda.shared()
    kv, host = fake.device(4096), fake.pinned(4096)
    side = fake.stream()
    kv.fill_(1)
    with fake.use(side):
        host.copy_(kv, non_blocking=True)
    fake.synchronize()
    """)
"""A store copied to pinned memory on its own stream right after compute wrote the block: one RAW."""


def record_run(tmp_path: Path, monkeypatch, capsys, *options: str, program: str = STORE, report: str = "report.json"):
    """``kvverify record OPTIONS --json REPORT -- python prog.py`` in this process on the stand-in;
    returns ``(exit status, the JSON report, captured output)``."""
    (tmp_path / "prog.py").write_text(program)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    status = cli.run(parser.parse_args([*options, "--json", report, "--", "python", "prog.py"]), platform=shared())
    return status, json.loads((tmp_path / report).read_text()), capsys.readouterr()


CONFTEST = textwrap.dedent("""\
    import fake_cuda
    import pytest

    import kvverify.record.confirm.runs as runs

    _confirm = runs.confirm_races


    def _on_the_stand_in(command, swap_ops, rec, verdict, platform=None, progress=lambda line: None, **kwargs):
        # the plugin's witness runs, in this process on the stand-in (a child would need a CUDA device)
        return _confirm(command, swap_ops, rec, verdict, fake_cuda.shared(), progress, **kwargs)


    runs.confirm_races = _on_the_stand_in


    @pytest.fixture
    def kvverify_platform():
        return fake_cuda.shared()
    """)

REFILL = textwrap.dedent("""\
    import os
    import subprocess
    import sys

    import fake_cuda
    import pytest


    def refill(size, synchronized):
        fake = fake_cuda.shared()
        gpu, staging, load, done = fake.device(size), fake.pinned(size), fake.stream(), fake.event()
        with fake.use(load):
            gpu.copy_(staging, non_blocking=True)
            done.record()
        if synchronized:
            done.synchronize()
        staging.fill_(2)
    """)
"""A pinned staging block refilled while its H2D copy may still be pending (a WAR unless synchronized)."""


def plugin_run(tmp_path: Path, tests: str, *options: str) -> str:
    """``REFILL`` and ``tests`` in a child pytest with the plugin as installed (its entry point) and
    ``--kvverify-confirm``; the witness runs are in-process on the stand-in. Returns the output."""
    (tmp_path / "standin").mkdir()
    (tmp_path / "standin" / "test_offload.py").write_text(REFILL + tests)
    (tmp_path / "standin" / "conftest.py").write_text(CONFTEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    env.pop(runs.WITNESS_ENV, None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--kvverify-confirm",
                           *options, "standin/test_offload.py"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def witness_lines(output: str, test: str) -> list[str]:
    """The first witness line in ``test``'s failure in a pytest output."""
    section = output.split(f"_ {test} _", 1)[1]
    return [line.strip() for line in section.split("witnesses:", 1)[1].splitlines()[1:] if line.startswith("  ")][:1]
