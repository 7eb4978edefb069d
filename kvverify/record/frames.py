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

_RECORD_DIR = Path(__file__).resolve().parent
_DEVICE_DIR = _RECORD_DIR.parent / "device"
USER_CODE = ("demo.py",)  # the recorder's demo stands for a user's program


def library_dirs() -> tuple[str, ...]:
    """The folders (and files) whose frames are never the user's: torch, the recorder's modules
    (not its demo) and kvverify's op wrappers (``kvverify/device``: a swap issued through
    ``kvverify.swap_blocks_batch`` is located at the user's call). The standard library
    (``runpy``, ``contextlib``, ``threading``) is library code too, but not the installed packages
    under it (``site-packages``)."""
    dirs = [str(p) for p in sorted(_RECORD_DIR.glob("*.py")) if p.name not in USER_CODE] + [str(_DEVICE_DIR)]
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        dirs.append(str(Path(torch.__file__).resolve().parent))
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
        self._is_library: dict[object, bool] = {}  # code object -> library frame?
        self._shown: dict[str, str] = {}  # file name -> as shown in ``at``

    def _library(self, code) -> bool:
        name = code.co_filename
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

    def locate(self, depth: int = 1) -> str | None:
        """The ``at`` string of the innermost user frame above the caller's ``depth``-th frame."""
        frame = sys._getframe(depth)
        cache = self._is_library
        while frame is not None:
            code = frame.f_code
            library = cache.get(code)
            if library is None:
                library = cache[code] = self._library(code)
            if not library:
                return f"{self._show(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
            frame = frame.f_back
        return None
