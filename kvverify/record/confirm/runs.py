"""The witness runs of ``--confirm`` (``kvverify record --confirm``, ``pytest --kvverify-confirm``):
the program run again per racing pair of lines, in child processes (or, with a platform, in this
process: the CPU tests' stand-in), each with the plan the parent wrote in its folder, its
observation read back and judged (``kvverify.record.confirm.witness``). ``confirm_races`` is the
whole of it for a recording's verdict; ``witness_run`` is one child's side
(``kvverify record --witness MODE:FOLDER``).

Importing this module imports neither torch nor numpy (the pytest plugin reads ``WITNESS_ENV`` at
its start).
"""

from __future__ import annotations

import json
import os
import sys

from kvverify.record.inprocess import program, run_program

WITNESS_ENV = "KVVERIFY_WITNESS"  # MODE:FOLDER for the pytest plugin of a witness run of one test


def witness_runs(command: list[str], swap_ops, scratch: str, platform=None, per_test: bool = False):
    """``run(plan, mode)``: one witness run of ``command`` (``python prog.py ...``, ``pytest ...``)
    in a child process, its observation read back from a folder under ``scratch`` (the caller's);
    with ``platform``, in this process (the CPU tests' stand-in). ``per_test``: ``command`` runs
    one pytest test, whose witness run the plugin starts where it starts the test's recording
    (``WITNESS_ENV``), so that calls are counted from the same point; else the whole command is
    the witness run, as it was the recording. A child that fails before it observes anything gives
    an observation that says so. The children use CUDA on purpose and are the recorder's, not the
    program's: they start without a recording's child-process variables
    (``kvverify.record.capture.processes.outside_environment``), so that a recording still running
    (one this is nested in) does not name them."""
    import subprocess

    from kvverify.record.capture.processes import outside_environment
    from kvverify.record.confirm import witness

    kind, target, arguments = program(command)
    if per_test:
        if kind != "pytest":
            raise ValueError(f"a witness run per test needs a pytest command, not {command!r}")
        arguments = [*arguments, *(a for op in swap_ops for a in ("--kvverify-swap-op", op))]
        if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):  # (else its entry point loads the plugin)
            arguments = ["-p", "kvverify.record.pytest_plugin", *arguments]

    def run(plan, mode: str):
        folder = os.path.join(scratch, mode)
        os.makedirs(folder, exist_ok=True)
        plan_file, out = witness_files(folder)
        for leftover in (out, out + ".bin"):
            if os.path.exists(leftover):
                os.remove(leftover)
        with open(plan_file, "w") as f:
            json.dump(plan.to_json(), f)
        spec = f"{mode}:{folder}"
        done = None
        if per_test:
            saved = os.environ.get(WITNESS_ENV)
            os.environ[WITNESS_ENV] = spec  # (the plugin takes it out at once: nothing the test starts sees it)
            try:
                if platform is not None:
                    run_program("pytest", "pytest", arguments)
                else:
                    done = subprocess.run([sys.executable, "-m", "pytest", *arguments], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True, env=outside_environment())
            finally:
                if saved is None:
                    os.environ.pop(WITNESS_ENV, None)
                else:
                    os.environ[WITNESS_ENV] = saved
        elif platform is not None:
            witness_run(spec, kind, target, arguments, swap_ops, platform)
        else:
            swap = [a for op in swap_ops for a in ("--swap-op", op)]
            done = subprocess.run([sys.executable, "-m", "kvverify", "record", "--witness", spec, *swap, "--",
                                   *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env=outside_environment())
        if not os.path.exists(out + ".bin"):
            if done is None:
                return witness.WitnessObservation(
                    mode, note=f"the {mode} run observed nothing (it failed before the pair)")
            tail = " / ".join(done.stderr.strip().splitlines()[-3:])
            return witness.WitnessObservation(mode, status=done.returncode,
                                              note=f"the {mode} run failed (exit {done.returncode}): {tail}")
        return witness.load(out)

    return run


def witness_files(folder: str) -> tuple[str, str]:
    """``(plan file, observation file)`` of a witness run's folder."""
    return os.path.join(folder, "plan.json"), os.path.join(folder, "observation.json")


def read_witness_spec(spec: str):
    """``(mode, plan, observation file)`` of a witness run's ``MODE:FOLDER`` (the folder holds the
    plan, and gets the observation). Raises ValueError naming what is wrong with it."""
    from kvverify.record.confirm import witness

    mode, _, folder = spec.partition(":")
    if mode not in (witness.IN_ORDER, witness.FORCED) or not folder:
        raise ValueError(f"a witness run takes {witness.IN_ORDER}|{witness.FORCED}:FOLDER, not {spec!r}")
    plan_file, out = witness_files(folder)
    try:
        with open(plan_file) as f:
            plan = witness.Plan.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the witness plan {plan_file}: {exc}") from exc
    return mode, plan, out


def confirm_races(command: list[str], swap_ops, rec, verdict, platform=None,
                  progress=lambda line: None, per_test: bool = False) -> list:
    """The witness outcomes (``kvverify.record.confirm.witness.Outcome``) of ``verdict``'s races in the
    recording ``rec`` of ``command``, in the order of the races, its witness runs in child
    processes (see ``witness_runs``)."""
    import shutil
    import tempfile

    from kvverify.record.confirm import witness

    plan_list, outcomes = witness.plans(rec.recorder.ops, rec.summary().sources, verdict.races)
    scratch = tempfile.mkdtemp(prefix="kvverify-witness-")
    try:
        runs = witness_runs(command, swap_ops, scratch, platform, per_test)
        return witness.in_race_order(witness.confirm(plan_list, runs, progress) + outcomes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def witness_run(spec: str, kind: str, target: str, arguments: list[str], swap_ops, platform) -> int:
    """A child of ``--confirm``: the program once as a witness run (``MODE:FOLDER``, the folder
    holding its plan); writes the observation there and returns the program's exit status (2 and
    one line for a bad spec, where no recording can start, or where the program does not start)."""
    from kvverify.errors import NotStartedError, RecordingError
    from kvverify.record.confirm import witness

    try:
        mode, plan, out = read_witness_spec(spec)
        obs = witness.observe(lambda: run_program(kind, target, arguments), plan, mode, swap_ops=swap_ops,
                              platform=platform)
    except (RecordingError, ValueError, NotStartedError) as exc:
        print(f"kvverify record: {exc}", file=sys.stderr)
        return 2
    witness.save(obs, out)
    return obs.status
