"""The package's layout is its architecture (docs/architecture.md): these tests keep it so.

- imports flow one way: cli → paths (check, scenarios, stress, record, measure) → device / check →
  leaves (terms, errors, units, geometry, annotate, stats, screen); no import cycle between modules;
- no module uses another module's private names;
- ``kvverify check`` and ``kvverify --help`` import neither torch, numpy, scipy nor rich (in a
  fresh interpreter, as hypothesis checks its own lazy imports);
- the top of ``kvverify/`` holds folders and at most 8 modules.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvverify"
ROOT = PACKAGE.parent

LEAVES = {"kvverify.terms", "kvverify.errors", "kvverify.units", "kvverify.geometry", "kvverify.annotate",
          "kvverify.stats", "kvverify.screen"}
# What each part may import besides itself (a part is a folder, or a leaf module).
ALLOWED = {
    "kvverify.terms": set(),
    "kvverify.errors": set(),
    "kvverify.units": set(),
    "kvverify.stats": set(),
    "kvverify.screen": set(),
    "kvverify.annotate": {"kvverify.screen"},
    "kvverify.geometry": {"kvverify.errors"},
    "kvverify.check": {"kvverify.terms", "kvverify.errors", "kvverify.units", "kvverify.screen"},
    "kvverify.device": LEAVES,
    "kvverify.scenarios": LEAVES | {"kvverify.check"},
    "kvverify.stress": LEAVES | {"kvverify.check", "kvverify.scenarios", "kvverify.device"},
    "kvverify.measure": LEAVES | {"kvverify.device", "kvverify.check"},
    "kvverify.record": LEAVES | {"kvverify.check", "kvverify.device"},
    "kvverify.cli": {"kvverify", "kvverify.annotate"},
    "kvverify.__main__": {"kvverify.cli"},
    "kvverify": {"kvverify.terms", "kvverify.check", "kvverify.device"},
}
HEAVY = ("torch", "numpy", "scipy", "rich", "matplotlib")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    is_package = (PACKAGE.parent / Path(*package) / "__init__.py").exists()
    base = package if is_package else package[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import anywhere in the module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for a in node.names:
                # `from kvverify.device import ops` imports the module kvverify.device.ops
                sub = f"{base}.{a.name}"
                if sub in MODULES:
                    out.append((sub, [], node.lineno))
                else:
                    out.append((base, [a.name], node.lineno))
    return out


def _part(module: str) -> str:
    """The folder or leaf a module belongs to: kvverify.stress.executors.base → kvverify.stress."""
    parts = module.split(".")
    if len(parts) == 1:
        return module
    candidate = ".".join(parts[:2])
    return candidate


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, tree in MODULES.items():
        for target, _, _ in _imports(module, tree):
            # an import of a.b.c also runs a and a.b: edges to the named module only
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def test_imports_flow_one_way():
    wrong = []
    for module, tree in MODULES.items():
        mine = _part(module)
        allowed = ALLOWED.get(mine)
        assert allowed is not None, f"{module}: part {mine} has no entry in ALLOWED; add it with its layer"
        for target, names, line in _imports(module, tree):
            if not target.startswith("kvverify"):
                continue
            if target == "kvverify" and names and set(names) <= {"__version__", "_C"}:
                continue  # the version string and the compiled extension: no code of the package
            theirs = _part(target)
            if theirs != mine and theirs not in allowed and target not in allowed:
                wrong.append(f"{module}:{line} imports {target} ({mine} may import {sorted(allowed) or 'nothing'})")
    assert not wrong, "\n".join(wrong)


# Inside record/ (docs/architecture.md): cli / pytest_plugin -> confirm/ -> session -> capture/ -> trace/,
# and inprocess (a program run in this process) under cli and confirm/. The plugin and the command line
# are two faces side by side: the plugin imports no command line (what both need lies below them).
RECORD_BELOW = {
    "kvverify.record.trace": set(),
    "kvverify.record.capture": {"kvverify.record.trace"},
    "kvverify.record.inprocess": set(),
    # (capture/: the witness runs start without a recording's child-process variables, processes.py)
    "kvverify.record.confirm": {"kvverify.record.trace", "kvverify.record.capture", "kvverify.record.session",
                                "kvverify.record.inprocess"},
    "kvverify.record.pytest_plugin": {"kvverify.record.confirm", "kvverify.record.session", "kvverify.record.capture",
                                      "kvverify.record.trace", "kvverify.record.inprocess"},
}


def test_the_recorders_parts_import_only_the_parts_below_them():
    wrong = []
    for module, tree in MODULES.items():
        mine = next((part for part in RECORD_BELOW if module == part or module.startswith(part + ".")), None)
        if mine is None:
            continue
        for target, _, line in _imports(module, tree):
            if not target.startswith("kvverify.record") or target == mine or target.startswith(mine + "."):
                continue
            if not any(target == ok or target.startswith(ok + ".") for ok in RECORD_BELOW[mine]):
                wrong.append(f"{module}:{line} imports {target} ({mine} may import {sorted(RECORD_BELOW[mine]) or 'nothing of record/'})")
    assert not wrong, "\n".join(wrong)


def test_the_pytest_plugin_does_not_import_the_record_command_line():
    """``pytest_plugin`` loads in every pytest session where kvverify is installed; ``kvverify.record.cli``
    is ``kvverify record``'s argument handling and report. The witness runs both start live in
    ``confirm/``, the program runner in ``inprocess``: the plugin needs nothing of the command line."""
    imported = {target for target, _, _ in _imports("kvverify.record.pytest_plugin",
                                                    MODULES["kvverify.record.pytest_plugin"])}
    assert not {t for t in imported if t == "kvverify.record.cli" or t.startswith("kvverify.record.cli.")}, imported
    assert "kvverify.record.confirm.runs" in imported  # (the rule above sees the plugin's imports)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def _without(graph: dict[str, set[str]], package: str, members: list[str]) -> dict[str, set[str]]:
    """The graph among ``members`` with ``package`` (their package's __init__) left out."""
    kept = set(members) - {package}
    return {m: graph[m] & kept for m in kept}


def test_no_import_cycle():
    graph = _graph()
    real = []
    for cycle in _cycles(graph):
        package = cycle[0]
        if all(m == package or m.startswith(package + ".") for m in cycle):
            # A package's __init__ re-exporting its own modules (and a module taking kvverify._C from
            # the package) closes a loop through the package only: its modules must still not loop.
            real += _cycles(_without(graph, package, cycle))
        else:
            real.append(cycle)
    assert not real, f"import cycles: {real}"


def test_device_modules_import_the_loader_never_the_reverse():
    """``device/extension.py`` loads kvverify._C; the modules that use it import it, and it knows none of them."""
    graph = _graph()
    device = [m for m in graph if m.startswith("kvverify.device.")]
    assert "kvverify.device.extension" in device
    assert not _cycles({m: graph[m] & set(device) for m in device})
    assert not {t for t in graph["kvverify.device.extension"] if t.startswith("kvverify.device")}


def _private_members(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, module globals, and attributes its classes
    set on ``self`` or define in their bodies."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") \
                and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def test_no_module_reaches_into_private_members_of_another():
    """``obj._name`` where ``_name`` is private to another kvverify module (an executor's, a pool's, a
    host buffer's): that module should offer what the caller needs."""
    owned = {m: _private_members(t) for m, t in MODULES.items()}
    everywhere: dict[str, set[str]] = {}
    for m, names in owned.items():
        for n in names:
            everywhere.setdefault(n, set()).add(m)
    wrong = []
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in everywhere and node.attr not in owned[module]):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            wrong.append(f"{module}:{node.lineno} uses .{node.attr}, private to {sorted(everywhere[node.attr])}")
    assert not wrong, "\n".join(wrong)


def test_no_module_uses_another_modules_private_names():
    wrong = []
    for module, tree in MODULES.items():
        aliases: dict[str, str] = {}
        for target, names, line in _imports(module, tree):
            if target.startswith("kvverify") and target != module:
                # kvverify._C is the compiled extension: private to the package, loaded by device/
                wrong += [f"{module}:{line} imports {n} from {target}" for n in names
                          if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" != "kvverify._C"]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("kvverify") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                wrong.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_the_top_of_the_package_holds_folders_and_few_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 8, modules


def test_check_imports_only_the_standard_library():
    for module, tree in MODULES.items():
        if not module.startswith("kvverify.check"):
            continue
        for target, _, line in _imports(module, tree):
            top = target.split(".")[0]
            assert top == "kvverify" or top in sys.stdlib_module_names, f"{module}:{line} imports {target}"


_PROBE = """
import json, sys
from kvverify.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as e:
    status = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print(json.dumps({"status": status, "heavy": heavy}), file=sys.stderr)
""" % (HEAVY,)


@pytest.mark.parametrize("argv", [["check", "TRACE"], ["check", "--json", "TRACE"], ["--help"], ["check", "--help"]])
def test_check_and_help_start_without_heavy_libraries(tmp_path, argv):
    trace = tmp_path / "empty.json"
    trace.write_text(json.dumps({"version": 1, "buffers": {}, "streams": [], "ops": []}))
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=ROOT, timeout=60)
    result = json.loads(r.stderr.strip().splitlines()[-1])
    assert result["status"] == 0, r.stdout + r.stderr
    assert result["heavy"] == [], f"kvverify {' '.join(argv)} imported {result['heavy']}"


def test_every_import_of_a_kvverify_name_resolves():
    """Imports inside functions run only on the paths that need them (many only on a GPU): each one
    must name a module or attribute that exists, or a GPU run is the first to find out."""
    import importlib

    wrong = []
    for module, tree in MODULES.items():
        for target, names, line in _imports(module, tree):
            if not target.startswith("kvverify") or target == "kvverify._C" or "_C" in names:
                continue
            try:
                imported = importlib.import_module(target)
            except ImportError as exc:
                wrong.append(f"{module}:{line} imports {target}: {exc}")
                continue
            wrong += [f"{module}:{line} imports {n} from {target}, which has no such name"
                      for n in names if not hasattr(imported, n)]
    assert not wrong, "\n".join(wrong)
