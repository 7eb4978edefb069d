"""Every path of this repository that a doc or a comment names exists, and none names a file outside
it: a reader who follows ``docs/record.md`` or ``kvverify/record/cli.py`` from a comment finds it."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A relative path to a file: a folder, a slash, and a name with one of these endings; what a
# doc links to or backquotes (`docs/record.md`, [text](../kvverify/schemas/paths-v1.json)).
PATH = re.compile(r"(?<![\w/.$-])((?:\.\.?/)*[A-Za-z_][\w.-]*/[\w./-]*\.(?:md|py|json|sh|cpp|cu|cuh|h|toml|png))"
                  r"(?![\w/-])")
OUTSIDE = re.compile(r"(?<![\w.-])/work/\S+|(?<![\w./-])shared/[\w./-]+")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout ({out.stderr.strip()}): no list of the repository's files")
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


def prose(name: str, text: str) -> str:
    """What of a file a reader is pointed by: a Python file's comments and docstrings (and, outside
    tests/, its other strings too: help and messages; a test's strings are its data); all of any
    other file."""
    if not name.endswith(".py"):
        return text
    parts = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and not name.startswith("tests/"):
            parts.append(node.value)
    return "\n".join(parts)


def named_paths(name: str, text: str) -> tuple[set[str], set[str]]:
    """``(missing, outside)``: the repository paths ``text`` (of file ``name``) names that do not
    exist, and the paths outside the repository it names."""
    files = {f.split("/")[0] for f in tracked()}
    missing = set()
    for ref in PATH.findall(text):
        if ref.startswith("."):  # relative to the file's folder
            target = (ROOT / name).parent / ref
            if ROOT.resolve() not in target.resolve().parents or not target.exists():
                missing.add(ref)
        elif ref.split("/")[0] in files and not (ROOT / ref).exists():
            missing.add(ref)
    return missing, set(OUTSIDE.findall(text))


def test_every_repository_path_a_doc_or_comment_names_exists_and_none_lies_outside():
    missing, outside = [], []
    for name in tracked():
        if not name.endswith((".md", ".py", ".sh", ".toml", ".cpp", ".cu", ".cuh", ".h")):
            continue
        gone, away = named_paths(name, prose(name, (ROOT / name).read_text(encoding="utf-8", errors="replace")))
        missing += [(name, ref) for ref in sorted(gone)]
        outside += [(name, ref) for ref in sorted(away)]
    assert not missing, "paths named that do not exist:\n" + "\n".join(f"  {f}: {r}" for f, r in missing)
    assert not outside, "paths outside the repository:\n" + "\n".join(f"  {f}: {r}" for f, r in outside)


def test_the_scan_finds_a_missing_path_a_path_outside_and_resolves_links_from_the_file():
    """The scan itself: a backquoted missing file, a link up from docs/, an absolute path elsewhere."""
    missing, outside = named_paths("docs/x.md", "see `docs/no-such.md`, [schema](../kvverify/schemas/paths-v1.json), "
                                                "../shared/DESIGN.md, shared/DESIGN.md and /work/shared/DESIGN.md")
    assert missing == {"docs/no-such.md", "../shared/DESIGN.md"}
    assert outside == {"/work/shared/DESIGN.md", "shared/DESIGN.md"}
    assert prose("tests/t.py", '"""See `docs/a.md`."""\nx = "tests/data.py"  # and docs/b.md\n') == \
        "# and docs/b.md\nSee `docs/a.md`."
