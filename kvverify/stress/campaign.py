"""Campaign files (``stress/*.toml``): what ``kvverify stress`` runs.

A campaign is one flat TOML table; every key is optional and falls back to the
``Campaign`` field's default.
Command-line options override it (``Campaign.override``). Errors name the file and the
key, and say what would be accepted.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import tomllib

from kvverify import units
from kvverify.errors import CampaignError
from kvverify.terms import EXECUTORS, HOST_MEMORY_KINDS, ORDERS

DATA_MODES = ("pattern", "random")
# stress/ beside the package in a checkout (editable install); a wheel ships the same files as
# data files under <prefix>/share/kvverify/stress (pyproject.toml, [tool.setuptools.data-files]).
_CHECKOUT_DIR = Path(__file__).resolve().parents[2] / "stress"
_INSTALLED_DIR = Path(sys.prefix) / "share" / "kvverify" / "stress"
CAMPAIGN_DIR = _CHECKOUT_DIR if _CHECKOUT_DIR.is_dir() else _INSTALLED_DIR


def parse_size(value: str | int) -> int:
    """A TOML size: a byte count (integer) or text for ``kvverify.units.parse_size`` (``"8GiB"``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"size {value} must be positive")
        return value
    return units.parse_size(value)


@dataclasses.dataclass(frozen=True)
class Campaign:
    name: str
    description: str = ""
    models: tuple[str, ...] = ("llama-3.1-8b",)
    block_size: int = 16
    tp: int = 1
    scenarios: tuple[str, ...] = ("all",)
    orders: tuple[str, ...] = ORDERS
    host_memory: tuple[str, ...] = HOST_MEMORY_KINDS
    executors: tuple[str, ...] = EXECUTORS
    trials: int = 3  # at least this many per cell; more where min_checked needs them
    max_trials: int = 64
    min_checked: int = 2**30  # bytes of blocks checked per cell, across its trials
    blocks_per_transfer: int = 16
    transfers: int = 4
    writer_delay_us: int = 1000  # spin before each compute write: the window a racing copy falls into
    reader_us: int = 1000  # how long a compute reader scans its blocks
    hold_timeout_s: float = 30.0  # a host wait longer than this is a harness hang, reported as an error
    data: str = "pattern"
    seed: int = 0
    gpu_mem: int = 8 * 2**30
    host_mem: int = 6 * 2**30  # fits a 24 GiB host with room for the rest of the process
    source: str = ""  # the file it came from

    def override(self, **changes: Any) -> Campaign:
        """A copy with the non-None ``changes`` applied and validated as command-line values."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return _validated(dataclasses.replace(self, **changes), "command line")


_TYPES: dict[str, type | tuple[type, ...]] = {
    "description": str, "models": list, "block_size": int, "tp": int, "scenarios": list, "orders": list,
    "host_memory": list, "executors": list, "trials": int, "max_trials": int, "min_checked": (str, int),
    "blocks_per_transfer": int, "transfers": int, "writer_delay_us": int, "reader_us": int,
    "hold_timeout_s": (int, float), "data": str, "seed": int, "gpu_mem": (str, int), "host_mem": (str, int),
}
_CHOICES = {"orders": ORDERS, "host_memory": HOST_MEMORY_KINDS, "executors": EXECUTORS}
_POSITIVE = ("block_size", "tp", "trials", "max_trials", "blocks_per_transfer", "transfers")


def _validated(c: Campaign, where: str) -> Campaign:
    def fail(key: str, problem: str) -> None:
        raise CampaignError(f"{where}: {key}: {problem}")

    for key, allowed in _CHOICES.items():
        values = getattr(c, key)
        if not values:
            fail(key, f"must name at least one of {', '.join(allowed)}")
        for v in values:
            if v not in allowed:
                fail(key, f"unknown value {v!r}; use {', '.join(allowed)}")
    for key in _POSITIVE:
        if getattr(c, key) < 1:
            fail(key, f"must be at least 1, got {getattr(c, key)}")
    if c.max_trials < c.trials:
        fail("max_trials", f"{c.max_trials} is less than trials ({c.trials})")
    if not 2 <= c.transfers <= 32:
        fail("transfers", f"transfers in flight must lie in [2, 32], got {c.transfers}")
    for key in ("writer_delay_us", "reader_us", "seed"):
        if getattr(c, key) < 0:
            fail(key, f"must not be negative, got {getattr(c, key)}")
    if c.hold_timeout_s <= 0:
        fail("hold_timeout_s", "must be positive")
    if c.data not in DATA_MODES:
        fail("data", f"unknown value {c.data!r}; use {', '.join(DATA_MODES)}")
    if not c.models:
        fail("models", "must name at least one model preset or config.json")
    return c


def parse(table: dict[str, Any], name: str, where: str) -> Campaign:
    """A validated Campaign from a parsed TOML table; ``where`` names it in errors."""
    fields: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _TYPES:
            raise CampaignError(f"{where}: unknown key {key!r}; known keys: {', '.join(_TYPES)}")
        expected = _TYPES[key]
        if isinstance(value, bool) or not isinstance(value, expected):
            names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
            raise CampaignError(f"{where}: {key}: expected {names}, got {type(value).__name__} {value!r}")
        if isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                raise CampaignError(f"{where}: {key}: expected a list of strings, got {value!r}")
            value = tuple(value)
        if key in ("min_checked", "gpu_mem", "host_mem"):
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise CampaignError(f"{where}: {key}: {exc}") from None
        fields[key] = value
    return _validated(Campaign(name=name, source=where, **fields), where)


def available() -> list[str]:
    return sorted(p.stem for p in CAMPAIGN_DIR.glob("*.toml"))


def load(name_or_path: str) -> Campaign:
    """Load a campaign by name (``stress/<name>.toml``) or by path to a TOML file."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" or path.exists()):
        path = CAMPAIGN_DIR / f"{name_or_path}.toml"
        if not path.exists():
            raise CampaignError(
                f"no campaign named {name_or_path!r}; available: {', '.join(available()) or 'none'} "
                f"(in {CAMPAIGN_DIR}), or give the path to a .toml file"
            )
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CampaignError(f"{path}: cannot read the campaign file: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CampaignError(f"{path}: not valid TOML: {exc}") from None
    return parse(table, path.stem, str(path))
