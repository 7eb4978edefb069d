"""Where the program issued an op: the innermost frame of the user's own code.

An op reaches the recorder through torch's Python wrappers, the dispatcher, kvverify's op
wrappers and the recorder itself; none of those is where the user wrote the call. ``Locator``
walks the Python stack from the innermost frame outwards and returns the first frame whose
file lies outside the library folders (torch, ``kvverify/record``, ``kvverify/device``, the
standard library), as the trace format's ``at`` field: ``"file.py:123 in function"``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

_RECORD_DIR = Path(__file__).resolve().parent.parent
_DEVICE_DIR = _RECORD_DIR.parent / "device"
_RECORDER_PARTS = ("capture", "trace", "confirm")  # (not corpus/: its cases are programs, the user's code)
USER_CODE = ("demo.py",)  # the recorder's demo stands for a user's program
CALL_SITES = 1 << 16  # ``at`` strings a Locator keeps; past that it starts afresh


def library_dirs() -> tuple[str, ...]:
    """The folders (and files) whose frames are never the user's: torch, the recorder's modules
    (not its demo), kvverify's op wrappers (``kvverify/device``: a swap issued through
    ``kvverify.swap_blocks_batch`` is located at the user's call), Triton's runtime and numpy where
    they are loaded. The standard library
    (``runpy``, ``contextlib``, ``threading``) is library code too, but not the installed packages
    under it (``site-packages``)."""
    dirs = ([str(p) for p in sorted(_RECORD_DIR.glob("*.py")) if p.name not in USER_CODE]
            + [str(_RECORD_DIR / part) for part in _RECORDER_PARTS] + [str(_DEVICE_DIR)])
    # triton: its launcher's frames, between a kernel's caller and the launch; numpy: its Python
    # wrappers, between the line that reads an array and the read (a touch the host watch sees)
    for package in ("torch", "triton", "numpy"):
        module = sys.modules.get(package)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(str(Path(module.__file__).resolve().parent))
    return tuple(dirs)


def _prefix(path: str) -> str:
    # a folder matches the files under it; a file matches itself
    real = os.path.realpath(path)
    return real if os.path.isfile(real) else os.path.join(real, "")


class Locator:
    """``locate()`` returns ``"file.py:123 in function"`` for the innermost user frame, or None
    when every frame on the stack is library code.

    ``skip``: folders (or files) whose frames are library code (default ``library_dirs()``),
    besides the standard library; file names that
    are not paths (``<frozen runpy>``, ``<string>`` of ``exec``) count as library code except
    ``<string>`` and ``<stdin>``, which are the user's. Paths are shown relative to the working
    directory when under it.
    """

    def __init__(self, skip: Iterable[str] | None = None) -> None:
        self._prefixes = tuple(_prefix(p) for p in (library_dirs() if skip is None else skip))
        paths = sysconfig.get_paths()
        self._stdlib = _prefix(paths["stdlib"])
        self._site = tuple({_prefix(paths["purelib"]), _prefix(paths["platlib"])})
        self._cwd = os.path.join(os.getcwd(), "")
        # Keyed by file name, not by code object: hashing a code object hashes its constants,
        # every time, and whether a frame is library code depends on its file alone.
        self._is_library: dict[str, bool] = {}
        self._shown: dict[str, str] = {}  # file name -> as shown in ``at``
        # (id(code), f_lasti) -> (code, at): a frame's line is found by walking its code's line
        # table (microseconds at the end of a long function), the same call site gives the same
        # line, and holding the code object keeps its id from naming another one meanwhile.
        self._at: dict[tuple[int, int], tuple[object, str]] = {}

    def _library(self, name: str) -> bool:
        if name.startswith("<"):
            return name not in ("<string>", "<stdin>")
        real = os.path.realpath(name)
        if any(real.startswith(p) for p in self._prefixes):
            return True
        return real.startswith(self._stdlib) and not any(real.startswith(p) for p in self._site)

    def _show(self, filename: str) -> str:
        shown = self._shown.get(filename)
        if shown is None:
            real = os.path.realpath(filename) if not filename.startswith("<") else filename
            shown = real.removeprefix(self._cwd)
            self._shown[filename] = shown
        return shown

    def library_code(self, code) -> bool:
        """Whether frames of ``code`` (a code object) are library code."""
        library = self._is_library.get(code.co_filename)
        if library is None:
            library = self._is_library[code.co_filename] = self._library(code.co_filename)
        return library

    def locate_frames(self, frames) -> str | None:
        """The ``at`` string of the innermost user frame among ``frames`` (``(code, line)`` pairs,
        innermost first, as native capture keeps them, or ``(file, line, function)`` where it read
        them as text: ``locate_text``); None where there is none."""
        if frames and len(frames[0]) == 3:
            return self.locate_text(frames)
        cache = self._is_library
        for code, line in frames:
            name = code.co_filename
            library = cache.get(name)
            if library is None:
                library = cache[name] = self._library(name)
            if not library:
                return f"{self._show(name)}:{line} in {code.co_name}"
        return None

    def locate_text(self, frames) -> str | None:
        """As ``locate_frames``, of ``(file, line, function)`` frames read as text
        (``kvverify.record.capture.native.text_frames``)."""
        cache = self._is_library
        for name, line, function in frames:
            library = cache.get(name)
            if library is None:
                library = cache[name] = self._library(name)
            if not library:
                return f"{self._show(name)}:{line} in {function}"
        return None

    def frame_at(self, frame) -> str:
        """The ``at`` string of ``frame`` itself, library code or not (where a call was made)."""
        return f"{self._show(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"

    def locate(self, depth: int = 1) -> str | None:
        """The ``at`` string of the innermost user frame above the caller's ``depth``-th frame."""
        frame = sys._getframe(depth)
        cache = self._is_library
        while frame is not None:
            code = frame.f_code
            name = code.co_filename
            library = cache.get(name)
            if library is None:
                library = cache[name] = self._library(name)
            if not library:
                key = (id(code), frame.f_lasti)
                known = self._at.get(key)
                if known is None:
                    if len(self._at) >= CALL_SITES:
                        self._at.clear()
                    known = self._at[key] = (code, f"{self._show(name)}:{frame.f_lineno} in {code.co_name}")
                return known[1]
            frame = frame.f_back
        return None
