"""A Python program run in this process, as ``kvverify record -- COMMAND`` and each witness run of
``--confirm`` run it: the program a command line names (``program``: a script, ``-m MODULE``, ``-c
CODE`` or pytest), whether it can start (``check_start``, asked before a recording starts) and
running it on this thread (``run_program``: its exit status, or NotStartedError where it did not
start). Knows no recording.
"""

from __future__ import annotations

import os
import sys


def program(command: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, arguments)`` of a command line: kind ``"script"`` (target: its path),
    ``"module"``, ``"code"`` or ``"pytest"``. Raises ValueError for a command that cannot run
    in-process, naming it."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("name the program to record after '--', e.g. kvverify record -- python prog.py")
    first, rest = command[0], command[1:]
    name = os.path.basename(first)
    if name in ("pytest", "py.test"):
        return "pytest", "pytest", rest
    if name.startswith("python"):
        if not rest:
            raise ValueError(f"'{first}' without a script, -m MODULE or -c CODE has nothing to run")
        if rest[0] == "-m" and len(rest) > 1:
            if rest[1] == "pytest":
                return "pytest", "pytest", rest[2:]
            return "module", rest[1], rest[2:]
        if rest[0] == "-c" and len(rest) > 1:
            return "code", rest[1], rest[2:]
        if rest[0] in ("-m", "-c"):
            raise ValueError(f"'{first} {rest[0]}' needs a {'module name' if rest[0] == '-m' else 'line of code'} "
                             "after it")
        if rest[0].startswith("-"):
            raise ValueError(f"python option {rest[0]} is not supported in-process; give python SCRIPT.py, "
                             "-m MODULE or -c CODE")
        return "script", rest[0], rest[1:]
    if first.endswith(".py"):
        return "script", first, rest
    raise ValueError(f"'{first}' is not a Python program this can run in-process; give python SCRIPT.py ..., "
                     "python -m MODULE ..., or pytest ...")



def check_start(kind: str, target: str) -> None:
    """Raise NotStartedError, with the line ``run_program`` would give, where the program cannot
    start: a script that is not a file or does not compile, a module python -m would not find (found
    here without running any package's code) or that does not compile, code for -c that does not
    compile, pytest not installed. Asked before the recording starts, so that a host without a
    CUDA device says so only of a program that could run."""
    import importlib.util

    from kvverify.errors import NotStartedError

    try:
        if kind == "pytest":
            if importlib.util.find_spec("pytest") is None:
                raise ModuleNotFoundError("No module named 'pytest'")
        elif kind == "code":
            compile(target, "<string>", "exec")
        elif kind == "script":
            if not os.path.isfile(target):
                raise NotStartedError(_no_script(target))
            _compile_source(target, target)
        else:
            origin = _module_origin(target)
            if origin is not None:
                _compile_source(origin, origin)
    except NotStartedError:
        raise
    except (ImportError, SyntaxError, ValueError) as exc:  # (ValueError: a null byte in source, before 3.12)
        raise NotStartedError(_could_not_start(kind, target, exc)) from exc


def _compile_source(path: str, filename: str) -> None:
    """Compile the Python source at ``path`` as runpy would (a zip archive or bytecode, which runpy
    also runs, is left to it)."""
    import importlib.util
    import zipfile

    if zipfile.is_zipfile(path):
        return
    with open(path, "rb") as f:
        source = f.read()
    if not source.startswith(importlib.util.MAGIC_NUMBER):
        compile(source, filename, "exec")


def _module_origin(name: str) -> str | None:
    """The source file python -m ``name`` runs (a package's ``__main__``), looked up as runpy looks it
    up but without importing any package, from the working directory first; None where it is no
    source file. Raises ImportError as runpy words it where the module or a package is missing."""
    import importlib.machinery
    import importlib.util

    parts = name.split(".")
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(parts[0])  # (a top-level name: nothing is imported)
        for depth in range(1, len(parts) + 1):
            if spec is None:
                missing = ".".join(parts[:depth])
                raise ImportError(f"No module named {name}") if depth == len(parts) else \
                    ModuleNotFoundError(f"No module named {missing!r}")
            if depth < len(parts):
                if spec.submodule_search_locations is None:
                    raise ModuleNotFoundError(f"No module named {name!r}; {spec.name!r} is not a package")
                spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth + 1]),
                                                                list(spec.submodule_search_locations))
        if spec.submodule_search_locations is not None:
            main = importlib.machinery.PathFinder.find_spec(f"{name}.__main__", list(spec.submodule_search_locations))
            if main is None:
                raise ImportError(f"No module named {name}.__main__; {name!r} is a package and cannot be directly "
                                  "executed")
            spec = main
    finally:
        sys.path.remove(os.getcwd())
    origin = spec.origin
    return origin if spec.has_location and origin and origin.endswith(".py") else None


def run_program(kind: str, target: str, arguments: list[str]) -> int:
    """Run the program here, on this thread; return its exit status (an uncaught exception is
    printed and gives 1, as python does). Raises NotStartedError, one line naming what, where and
    what to do, where the program did not start: its script or module not found, or not read or
    compiled (an exception with none of the program's code in its traceback, see ``_not_started``)."""
    import runpy
    import traceback

    from kvverify.errors import NotStartedError

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if kind == "pytest":
            import pytest

            return int(pytest.main(arguments))
        if kind == "script":
            if not os.path.isfile(target):
                raise NotStartedError(_no_script(target))
            sys.argv = [target, *arguments]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.argv = [target, *arguments]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *arguments]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except NotStartedError:
        raise
    except Exception as exc:
        if _not_started(exc):
            raise NotStartedError(_could_not_start(kind, target, exc)) from exc
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


# Python's own code that finds, reads and compiles a program before any of it runs (runpy's lookup
# of a module, importlib's finders and loaders); frozen modules have file names "<frozen NAME>".
_MACHINERY = ("runpy", "pkgutil", "importlib", "zipimport")


def _machinery(filename: str) -> bool:
    if filename.startswith("<frozen ") and filename.endswith(">"):
        return filename[len("<frozen "):-1].partition(".")[0] in _MACHINERY
    import importlib
    import pkgutil
    import runpy

    path = os.path.normcase(os.path.realpath(filename))
    files = {os.path.normcase(os.path.realpath(m.__file__)) for m in (runpy, pkgutil)}
    return path in files or os.path.dirname(path) == os.path.normcase(
        os.path.dirname(os.path.realpath(importlib.__file__)))


def _not_started(exc: BaseException) -> bool:
    """Whether ``exc``, caught in run_program, was raised before the program started: no frame of
    its traceback after run_program's own runs other code than Python's import machinery (a
    missing module, or a script or module that cannot be read or compiled). An exception from the
    program's own code, a ModuleNotFoundError of an import it makes included, has its frames."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # (the first: run_program)
    while tb is not None:
        if not _machinery(tb.tb_frame.f_code.co_filename):
            return False
        tb = tb.tb_next
    return True


def _working_directory() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "(unknown: it was removed)"


def _no_script(target: str) -> str:
    """The line for a script that is not there (or not a file)."""
    from kvverify.check.model import printable

    try:
        where = os.path.abspath(target)
    except OSError:  # (no working directory)
        where = target
    problem = ("is a directory, not a script file" if os.path.isdir(target) else
               "is not a regular file" if os.path.exists(target) else "does not exist")
    return printable(f"python {target} did not start: {where} {problem} (the working directory is "
                     f"{_working_directory()}): no trace, no verdict; check the script's path")


def _could_not_start(kind: str, target: str, exc: BaseException) -> str:
    """The line for a program that did not start (``exc``: why)."""
    from kvverify.check.model import printable

    what = {"module": f"python -m {target}", "script": f"python {target}", "code": "python -c CODE"}.get(kind, kind)
    if isinstance(exc, (SyntaxError, ValueError)):  # (ValueError: a null byte in source, before 3.12)
        todo = {"module": "fix the module", "script": "fix the script", "code": "fix the code given to -c"}.get(
            kind, "fix it")
    elif kind == "module":
        todo = (f"check the module name (python -m takes a dotted name without .py; run a file as python PATH) "
                f"and the working directory ({_working_directory()}), where python -m looks first")
    elif kind == "pytest":
        todo = "install pytest where this python finds it"
    else:
        todo = f"check the path (relative to the working directory, {_working_directory()}) and its permissions"
    return printable(f"{what} did not start: {type(exc).__name__}: {exc}: no trace, no verdict; {todo}")
