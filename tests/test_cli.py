"""``kvverify --help``: one screen, plain text, examples last; every subcommand it names exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from help_screen import check_screen, help_lines

from kvverify.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_help_fits_a_screen_and_ends_with_examples():
    lines = help_lines()
    examples = check_screen(lines)
    assert {e.split()[1] for e in examples} <= set(SUBCOMMANDS)
    assert all(any(line.strip().startswith(name + " ") for line in lines) for name in SUBCOMMANDS)


def test_a_bad_option_of_a_subcommand_shows_that_subcommand_s_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--jsn", "trace.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvverify check ") and err.rstrip().endswith(
        "kvverify check: error: unrecognized arguments: --jsn")


def test_no_command_is_a_usage_line_on_stderr_and_exit_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("usage: kvverify ") and "name a command" in out.err


def _kvverify_shell(pipeline: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
@pytest.mark.parametrize("command", ["merge tests/data/stress-smoke-h200.json", "stress --no-gpu"])
def test_standard_output_that_cannot_be_written_is_one_line_and_exit_2(command):
    p = _kvverify_shell(f"{sys.executable} -m kvverify {command} > /dev/full")
    assert p.returncode == 2, p.stderr
    name = command.split()[0]
    assert p.stderr.endswith(f"kvverify {name}: cannot write to standard output (No space left on device)\n"), p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("command", ["merge tests/data/stress-smoke-h200.json", "stress --no-gpu --details"])
def test_a_reader_that_goes_away_ends_it_quietly_with_exit_2(command):
    # The reader is gone before the first write: `| head -c 1` raced the writer, and a report that
    # fit the pipe's buffer before head exited was never refused (exit 0, one run in six under load).
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-m", "kvverify", *command.split()], stdout=write, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
                           timeout=120)
    finally:
        os.close(write)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "Broken pipe" not in p.stderr, p.stderr


def test_a_closed_standard_output_is_one_line_and_exit_2():
    p = _kvverify_shell(f"{sys.executable} -m kvverify stress --no-gpu >&-")
    assert p.returncode == 2
    assert p.stderr == "kvverify stress: standard output is closed: nowhere to write the report\n"


def test_record_s_program_arguments_do_not_stand_for_the_command(monkeypatch, capsys, tmp_path):
    # record names its positional `command`, as the top-level parser names the subcommand
    with pytest.raises(SystemExit) as exc:
        main(["record", "-o", str(tmp_path / "t.json"), "--bogus", "--", "python", "x.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvverify record ") and "error: unrecognized arguments: --bogus" in err
    from kvverify.record import cli as record_cli

    seen = {}

    def fake_run(args):
        seen["stdout"] = sys.stdout
        return 0

    monkeypatch.setattr(record_cli, "run", fake_run)
    real = sys.stdout
    assert main(["record", "--", "python", "x.py"]) == 0
    assert seen["stdout"] is real  # the recorded program writes to the real stdout, not a wrapper


def test_record_with_a_closed_standard_output_is_not_refused_by_the_front_door():
    p = _kvverify_shell(f"{sys.executable} -m kvverify record -- python -c pass >&-")
    assert "standard output is closed" not in p.stderr and "kvverify [" not in p.stderr, p.stderr
    assert p.stderr.startswith("kvverify record: nothing to record: ")  # no CUDA device here: its own refusal
