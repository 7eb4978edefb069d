"""kvverify's errors: one base class, one subclass per thing that can be wrong.

Each also derives from the built-in error it always was (``ValueError`` for bad input,
``RuntimeError`` for what went wrong while running), so ``except ValueError`` keeps working.
Messages say what was wrong, where, and what to do.
"""

from __future__ import annotations


class KvverifyError(Exception):
    """Base class of every error kvverify raises on purpose."""


class TraceError(KvverifyError, ValueError):
    """An invalid trace. ``op_index`` is the 0-based op (None for the document's header) and
    ``field`` the offending field, e.g. ``"copies[1].src"``; ``str(err)`` is one line naming both."""

    def __init__(self, message: str, *, op_index: int | None = None, field: str | None = None,
                 op_kind: str | None = None):
        self.message = message
        self.op_index = op_index
        self.field = field
        self.op_kind = op_kind
        super().__init__(self._line())

    def _line(self) -> str:
        where = []
        if self.op_index is not None:
            where.append(f"op {self.op_index}" + (f" ({self.op_kind})" if self.op_kind else ""))
        if self.field is not None:
            where.append(f"field '{self.field}'")
        return (", ".join(where) + ": " if where else "") + self.message


class ConfigError(KvverifyError, ValueError):
    """A model config is missing a field or has an invalid or contradictory one.

    ``field`` names the offending config key; the message starts with it.
    """

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"{field}: {problem}")


class ProgramError(KvverifyError, ValueError):
    """A scenario's program is inconsistent (a scenario bug, caught before any GPU work)."""


class CampaignError(KvverifyError, ValueError):
    """A campaign file or option is invalid; the message names where and what."""


class CalibrationError(KvverifyError, ValueError):
    """A paths document (``kvverify bench --calibrate -o PATH``) that cannot be used, or a shape
    ``calibration.choose`` cannot answer. ``field`` is the offending field, e.g.
    ``"entries[3].page_bytes"`` (None where the fault is not one field's)."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)


class PlanError(KvverifyError, ValueError):
    """The options name an impossible or unknown benchmark (reported as one line, exit status 2)."""


class HarnessError(KvverifyError, RuntimeError):
    """The harness could not carry out a trial (a hang, a refused copy): not a verdict."""


class ExtensionUnavailableError(KvverifyError, RuntimeError):
    """The CUDA extension, torch, or a CUDA device needed by an op is missing."""


class RecordingError(KvverifyError, RuntimeError):
    """``kvverify record`` cannot record here: no CUDA device, a torch that does not report stream
    and event work to Python, or a recording already running in this process."""


class NotStartedError(KvverifyError, RuntimeError):
    """``kvverify record``'s program did not start: its script or module was not found, or could not
    be read or compiled, so none of it ran (as ``python -m`` does, a parent package may have been
    imported on the way). The message names it, where it was looked for, and what to do."""
