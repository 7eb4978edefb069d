"""Child processes: a recording records the device work of its own process only; a child process
that uses CUDA is named, NOT RECORDED, so that the recording is never called SAFE over it.

The CUDA driver loads the library named in the environment variable ``CUDA_INJECTION64_PATH`` into
a process at ``cuInit`` and calls its exported ``InitializeInjection()`` (the injection entry point
of NVIDIA's CUPTI samples and Nsight tools). While a recording runs, ``ChildWatch`` puts
``kvverify/_inject.so`` (``csrc/inject/inject.c``) there and a folder of the recording's own in
``KVVERIFY_CHILD_DIR``: every process that inherits both and initializes CUDA leaves a marker in
that folder (its pid, its parent's, its command line). At the stop, each marker of a process
other than the recording's own is a line of the summary. The recording's process loads the
library too where it initializes CUDA after the start: its marker is left out by its pid.

How each kind of child gets the two variables:

- ``subprocess`` (fork and exec, ``posix_spawn``, ``vfork``), ``os.system``, ``os.posix_spawn``,
  ``multiprocessing``'s spawn start method, torchrun's workers: they inherit the environment as
  they start, and so do their own children;
- ``os.fork`` and ``multiprocessing``'s fork start method: a child forked before this process
  initialized CUDA initializes it itself, with the variables. One forked after cannot use CUDA
  (CUDA does not support a fork after its initialization; torch raises "Cannot re-initialize CUDA
  in forked subprocess"), so there is nothing to name and no hook at the fork;
- ``multiprocessing``'s forkserver: a forkserver started while recording has the variables, and so
  has every process it forks. One already running at the start has not: the processes it starts
  meanwhile are counted, NOT RECORDED, since whether they used CUDA cannot be seen.

Not seen: a child given an environment of its own without the two variables
(``subprocess.run(cmd, env={...})``); processes started before the recording (a pool's workers)
that initialize CUDA during it; a child whose first CUDA call comes after the recording stopped.

Where ``CUDA_INJECTION64_PATH`` already named another tool's library (Nsight Systems',
compute-sanitizer's), it goes into ``KVVERIFY_INJECTION_NEXT``, which the library loads and calls
in turn: the tool still sees the children. ``outside_environment`` is the environment without a
recording's variables, for processes the recorder itself starts (the witness runs of
``--confirm``, which use CUDA on purpose and are no children of the program).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping

from kvverify.record.capture.threads import NOT_RECORDED

INJECTION = "CUDA_INJECTION64_PATH"
CHILD_DIR = "KVVERIFY_CHILD_DIR"
NEXT = "KVVERIFY_INJECTION_NEXT"
LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "_inject.so")
CHILD = f"{NOT_RECORDED} (a child process that used CUDA, not followed:"
NAMED = 10  # children named one a line; the rest are counted on one
COMMAND_CHARS = 200


class ChildWatch:
    """The child processes of this one that initialize CUDA between ``start()`` and ``stop()``
    (see the module)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.folder: str | None = None
        self.off: str | None = None  # why children are not watched
        self.running = False
        self._saved: dict[str, str | None] = {}
        self._forkserver: int | None = None  # the pid of a forkserver running before the start
        self._unwatched = 0  # processes that forkserver started meanwhile
        self._undo: Callable[[], None] | None = None

    def start(self) -> None:
        """Set the two variables in ``os.environ`` (the previous values are kept for ``stop``).
        Nothing raises: where children cannot be watched, ``stop`` says why as a NOT RECORDED line."""
        self.pid, self.running, self.off, self._unwatched = os.getpid(), True, None, 0
        if not os.path.isfile(LIBRARY):
            self.off = (f"{LIBRARY} is missing (kvverify was installed before it was built): reinstall kvverify "
                        "(from a checkout: pip install --no-build-isolation -e .), which builds it on every host")
            return
        try:
            self.folder = tempfile.mkdtemp(prefix="kvverify-children-")
        except OSError as exc:
            self.off = (f"no folder for their markers could be made in {tempfile.gettempdir()} "
                        f"({exc.strerror or exc}): point TMPDIR at a writable folder")
            return
        self._saved = {name: os.environ.get(name) for name in (INJECTION, CHILD_DIR, NEXT)}
        before = self._saved[INJECTION]
        if not before:
            os.environ.pop(NEXT, None)  # (a stale one would be loaded into every child)
        elif not _is_ours(before):  # (ours: a recording around this one; what it chains to stays)
            os.environ[NEXT] = before
        os.environ[INJECTION] = LIBRARY
        os.environ[CHILD_DIR] = self.folder
        self._watch_forkserver()

    def stop(self) -> dict[str, int]:
        """Restore the variables, remove the folder; returns the NOT RECORDED lines, each with its
        count, for the recorder's notes (nothing at a second stop)."""
        if not self.running:
            return {}
        self.running = False
        if self._undo is not None:
            self._undo()
            self._undo = None
        lines: Counter[str] = Counter()
        if self.off is not None:
            lines[f"{NOT_RECORDED} (child processes are not watched: {self.off}; one that used CUDA is not named)"] += 1
        if self._unwatched:
            lines[f"{NOT_RECORDED} (processes started by multiprocessing's forkserver, pid {self._forkserver}, which "
                  "was running before the recording started and so lacks its environment: whether they used CUDA "
                  "is not seen; start the recording before the program's first forkserver process, or use the "
                  "spawn start method)"] += self._unwatched
        if self.folder is None:
            return dict(lines)
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        folder, self.folder = self.folder, None
        if os.getpid() != self.pid:
            return dict(lines)  # a forked child that ended the recording: the folder is its parent's to read
        try:
            children = [m for m in _markers(folder) if m[1] != self.pid]
        except OSError as exc:  # (the folder removed under the recording: by a cleaner of the temporary folder)
            children = []
            lines[f"{NOT_RECORDED} (child processes: their markers in {folder} could not be read "
                  f"({exc.strerror or exc}); one that used CUDA is not named)"] += 1
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        for _, pid, ppid, command in children[:NAMED]:
            parent = "" if ppid in (None, self.pid) else f" (started by pid {ppid})"
            lines[f"{CHILD} pid {pid}{parent} `{command}`)"] += 1
        if len(children) > NAMED:
            lines[f"{NOT_RECORDED} (more child processes that used CUDA, not followed; the first {NAMED} are "
                  "named above)"] += len(children) - NAMED
        return dict(lines)

    def _watch_forkserver(self) -> None:
        """Count the processes a forkserver that runs already starts while recording: it was
        started without the variables, and so are the processes it forks."""
        module = sys.modules.get("multiprocessing.forkserver")  # (not imported: no forkserver runs)
        server = getattr(module, "_forkserver", None)
        running = getattr(server, "_forkserver_pid", None)
        if running is None:
            return
        self._forkserver = running
        # multiprocessing's Popen calls the module's function, bound to its server at import
        connect = module.connect_to_new_process

        def connect_to_new_process(fds):
            made = connect(fds)
            if server._forkserver_pid == running:  # (not one started anew, with the variables)
                self._unwatched += 1
            return made

        module.connect_to_new_process = connect_to_new_process

        def undo() -> None:
            module.connect_to_new_process = connect

        self._undo = undo


def outside_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` without a recording's variables: the injection library the recording
    replaced (``KVVERIFY_INJECTION_NEXT``) back in ``CUDA_INJECTION64_PATH``, or none, and no
    marker folder. For the processes the recorder starts itself."""
    env = dict(environ)
    env.pop(CHILD_DIR, None)
    injection = env.get(INJECTION)
    if injection and _is_ours(injection):
        before = env.pop(NEXT, None)
        if before:
            env[INJECTION] = before
        else:
            del env[INJECTION]
    return env


def _is_ours(path: str) -> bool:
    try:
        return os.path.samefile(path, LIBRARY)
    except OSError:
        return os.path.realpath(path) == os.path.realpath(LIBRARY)


def _markers(folder: str) -> list[tuple[float, int, int | None, str]]:
    """``(time, pid, ppid, command)`` of each marker in ``folder``, first written first. A marker
    still being written (``.<pid>.part``) counts: its process initialized CUDA; what it does not
    say yet is said so (its ppid None)."""
    found: dict[int, tuple[float, int, int | None, str]] = {}
    for name in os.listdir(folder):
        pid_text = name[1:-len(".part")] if name.startswith(".") and name.endswith(".part") else name
        if not pid_text.isdigit():
            continue
        for candidate in dict.fromkeys((name, pid_text)):  # (a .part renamed since the listing: its final name)
            try:
                with open(os.path.join(folder, candidate), "rb") as f:
                    data, when = f.read(), os.fstat(f.fileno()).st_mtime
                break
            except OSError:
                continue
        else:
            continue
        fields = data.split(b"\n", 2)
        pid = int(pid_text)
        if len(fields) == 3 and fields[1].isdigit():
            found[pid] = (when, pid, int(fields[1]), _command(fields[2]))
        elif pid not in found:  # (the whole marker, where both names were listed, wins)
            found[pid] = (when, pid, None, "(its command line not written yet)")
    return sorted(found.values())


def _command(cmdline: bytes) -> str:
    """The command line of ``/proc/<pid>/cmdline`` (arguments ended by NUL) as a shell would take
    it, cut to ``COMMAND_CHARS``."""
    arguments = [a.decode(errors="replace") for a in cmdline.removesuffix(b"\0").split(b"\0")] if cmdline else []
    text = shlex.join(arguments) if arguments else "(no command line)"
    return text if len(text) <= COMMAND_CHARS else text[:COMMAND_CHARS - 3] + "..."
