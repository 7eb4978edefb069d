"""setup.py: the extension is built or the install fails saying why, unless KVVERIFY_CPU_ONLY=1;
the default architectures are ones nvcc knows."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def setup_py(**env) -> subprocess.CompletedProcess:
    """``python setup.py --name`` (runs the extension decision, builds nothing) with ``env`` set, and
    KVVERIFY_CPU_ONLY only if ``env`` sets it (``KVVERIFY_CPU_ONLY=1 bash ci/cpu.sh`` exports it)."""
    base = {k: v for k, v in os.environ.items() if k != "KVVERIFY_CPU_ONLY"}
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                          env=base | env, timeout=120, check=False)


def test_a_host_without_nvcc_fails_the_install_with_the_reason_and_the_ways_out(tmp_path):
    p = setup_py(CUDA_HOME=str(tmp_path / "no-cuda"))
    assert p.returncode != 0
    assert "cannot build the CUDA extension kvverify._C: nvcc was not found" in p.stderr
    assert "pip install --no-build-isolation -e ." in p.stderr and "KVVERIFY_CPU_ONLY=1 pip install -e ." in p.stderr


# A Python without torch: ``import torch`` finds nothing (a finder ahead of all others says so).
NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTorch())
"""


def _first_line(p: subprocess.CompletedProcess) -> str:
    return p.stderr.strip().splitlines()[0]


def test_a_torch_that_cannot_be_imported_is_named_with_its_error(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('a broken torch')\n")
    p = setup_py(PYTHONPATH=str(tmp_path))
    assert p.returncode != 0
    assert _first_line(p) == (f"kvverify: cannot build the CUDA extension kvverify._C: torch is installed ({fake}) "
                              "but cannot be imported: ImportError: a broken torch.")


def test_without_torch_and_without_build_isolation_the_message_says_torch_is_not_installed(tmp_path):
    """``pip install --no-build-isolation`` into a Python without torch once blamed build isolation."""
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    p = setup_py(PYTHONPATH=str(tmp_path))
    assert p.returncode != 0
    assert _first_line(p) == (f"kvverify: cannot build the CUDA extension kvverify._C: torch is not installed in this "
                              f"Python ({sys.executable}): install a CUDA build of torch first.")
    assert "pip install --no-build-isolation -e ." in p.stderr  # the ways out follow


def test_in_pips_isolated_environment_the_message_names_the_isolation_and_the_torch_it_hides(tmp_path):
    """pip (no --no-build-isolation) runs setup.py with its own folders on sys.path, named
    pip-build-env-..., and torch out of reach; this Python's own torch, if it has one, is named."""
    import importlib.machinery
    import sysconfig

    site = tmp_path / "pip-build-env-abc" / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(NO_TORCH)
    p = setup_py(PYTHONPATH=str(site))
    assert p.returncode != 0
    own = importlib.machinery.PathFinder.find_spec("torch", [sysconfig.get_paths()[k] for k in ("purelib", "platlib")])
    reason = ("pip builds in an isolated environment, which hides the torch installed in "
              f"{os.path.dirname(os.path.dirname(own.origin))}: add --no-build-isolation" if own is not None else
              "pip builds in an isolated environment, which has no torch (nor has this Python, "
              f"{sys.executable}): install a CUDA build of torch, then build with --no-build-isolation")
    assert _first_line(p) == f"kvverify: cannot build the CUDA extension kvverify._C: {reason}."


def test_cpu_only_installs_without_the_extension_and_says_so(tmp_path):
    p = setup_py(CUDA_HOME=str(tmp_path / "no-cuda"), KVVERIFY_CPU_ONLY="1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "kvverify"
    assert "KVVERIFY_CPU_ONLY=1: installing without the CUDA extension kvverify._C" in p.stderr


def test_cpu_only_builds_the_injection_library_as_a_plain_shared_library(tmp_path):
    """kvverify/_inject.so is built on every host, by the C compiler alone, under its own name (no
    interpreter suffix: the CUDA driver loads it, not Python), exporting InitializeInjection."""
    import ctypes

    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler to build it with")
    env = {k: v for k, v in os.environ.items() if k != "KVVERIFY_CPU_ONLY"} | {"KVVERIFY_CPU_ONLY": "1"}
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "temp")], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert [f.name for f in (tmp_path / "lib" / "kvverify").iterdir()] == ["_inject.so"]
    assert ctypes.CDLL(str(tmp_path / "lib" / "kvverify" / "_inject.so")).InitializeInjection


def _default_archs() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    value = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "DEFAULT_ARCHS" for t in n.targets))
    return value.split(";")


def test_default_architectures_cover_ampere_to_blackwell_and_nvcc_knows_them():
    archs = _default_archs()
    assert {a.removesuffix("+PTX") for a in archs} >= {"8.0", "8.6", "8.9", "9.0", "10.0", "12.0"}
    assert archs[-1].endswith("+PTX")  # later GPUs compile the PTX of the newest
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH to ask which architectures it supports")
    known = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout.split()
    missing = [a for a in archs if f"compute_{a.removesuffix('+PTX').replace('.', '')}" not in known]
    assert not missing, f"nvcc does not know {missing}; it knows {known}"
