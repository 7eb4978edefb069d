"""Build kvverify with its CUDA extension ``kvverify._C``, or fail saying why it cannot be built;
and, on every host, the CUDA injection library ``kvverify/_inject.so``.

Every ``.cpp`` and ``.cu`` under ``csrc/op/``, ``csrc/harness/`` and ``csrc/record/`` (see
``csrc/README.md``) goes into the one extension; each file registers its own ops with
``TORCH_LIBRARY_FRAGMENT(kvverify, ...)``. The extension never links libcuda:
driver entry points are resolved at run time, so build hosts need no driver. It is built
against the torch already installed (``pip install --no-build-isolation``): pyproject.toml does
not ask pip for torch, which would otherwise put an unpinned CUDA torch of ~3 GB into a
throwaway build environment and compile against a torch that is then not the one installed.

Environment:
- ``TORCH_CUDA_ARCH_LIST``: the GPU architectures to compile for; default ``DEFAULT_ARCHS``
  (Ampere, Ada, Hopper, Blackwell, and PTX for later GPUs; needs nvcc 12.8 or newer). One
  architecture (``9.0`` for an H100 / H200) builds in about a third of the time.
- ``KVVERIFY_CPU_ONLY=1``: install without the extension (``kvverify check`` and the stress
  contract verdicts work; the op, ``probe``, ``bench`` and ``stress`` on a GPU refuse). Without
  it, a host where the extension cannot be built fails the install with the reason.

``csrc/inject/inject.c`` is plain C (no CUDA headers, no torch, no Python API): the CUDA driver
loads it into the recorded program's child processes (``CUDA_INJECTION64_PATH``,
``kvverify/record/capture/processes.py``). It is built with the C compiler as setuptools sets it
up, before torch's build command rewires that compiler for ``kvverify._C`` (ninja, C++ flags),
and named ``_inject.so``: it is no Python module, so it gets no interpreter suffix.
"""

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEFAULT_ARCHS = "8.0;8.6;8.9;9.0;10.0;12.0+PTX"
CPU_ONLY = os.environ.get("KVVERIFY_CPU_ONLY", "") == "1"
HOW = """\
  On a GPU host: a CUDA build of torch, nvcc 12.8 or newer (CUDA_HOME) and the build tools, then
      pip install "setuptools>=70.1" ninja && pip install --no-build-isolation -e .
  Without a GPU or nvcc (kvverify check; kvverify stress prints contract verdicts only):
      KVVERIFY_CPU_ONLY=1 pip install -e ."""
INJECT = "kvverify._inject"


def _find_cuda_home():
    """Point CUDA_HOME at a toolkit with headers before torch looks for one.

    torch derives CUDA_HOME from the `nvcc` on PATH; where that is a wrapper script outside the
    toolkit (as on our CI image: /usr/local/bin/nvcc), it guesses a folder without headers.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    toolkits = ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in toolkits:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = home
            return


def _isolated_build():
    """Whether this runs in a build front end's isolated environment: pip's puts its folders
    ("pip-build-env-...") on sys.path, pypa/build's is a virtual environment in a "build-env-..."
    folder. Neither sets a marker of its own."""
    parts = {part for entry in sys.path for part in entry.split(os.sep)} | set(sys.prefix.split(os.sep))
    return any(part.startswith(("pip-build-env-", "build-env-")) for part in parts)


def _why_no_torch(error):
    """Why ``import torch`` failed (``error``), told apart: an isolated build hiding the torch this
    Python has, no torch at all, or a torch that is there and breaks."""
    import importlib.machinery
    import importlib.util
    import sysconfig

    if _isolated_build():
        sites = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
        found = importlib.machinery.PathFinder.find_spec("torch", sites)
        if found is not None:
            return (f"pip builds in an isolated environment, which hides the torch installed in "
                    f"{os.path.dirname(os.path.dirname(found.origin))}: add --no-build-isolation")
        return ("pip builds in an isolated environment, which has no torch (nor has this Python, "
                f"{sys.executable}): install a CUDA build of torch, then build with --no-build-isolation")
    try:
        found = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        found = None
    if found is None:
        return f"torch is not installed in this Python ({sys.executable}): install a CUDA build of torch first"
    return (f"torch is installed ({os.path.dirname(found.origin or '') or found.name}) but cannot be imported: "
            f"{type(error).__name__}: {error}")


def _why_no_extension():
    """Return None when the extension can be built here, else the reason it cannot."""
    _find_cuda_home()
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        return _why_no_torch(exc)
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    home = cpp_extension.CUDA_HOME
    if home is None or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        return f"nvcc was not found (CUDA_HOME: {home}); install the CUDA toolkit or set CUDA_HOME"
    return None


def _pip_cuda_include_dirs():
    """Headers of the CUDA libraries torch's wheel depends on (cuSPARSE, cuBLAS, ...).

    ATen's CUDA headers include them, and a toolkit holding only the compiler and runtime
    (as on our CI image) lacks them; the `nvidia-*` wheels installed with torch carry them.
    """
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for root in nvidia.__path__ for d in glob.glob(os.path.join(root, "*", "include")))


def _inject_extension() -> Extension:
    """The injection library: only ``InitializeInjection`` is exported (-fvisibility=hidden), so
    that nothing of it can stand in for a symbol of the program it is loaded into."""
    return Extension(INJECT, sources=[os.path.join("csrc", "inject", "inject.c")], libraries=["dl"],
                     extra_compile_args=["-O2", "-Wall", "-fvisibility=hidden"])


def _with_inject(base):
    """``base`` (torch's build command, or setuptools' own) building the injection library first."""

    class BuildExt(base):
        def build_extensions(self):
            plain = [ext for ext in self.extensions if ext.name == INJECT]
            for ext in plain:
                build_ext.build_extension(self, ext)
            rest = self.extensions
            self.extensions = [ext for ext in rest if ext.name != INJECT]
            try:
                base.build_extensions(self)
            finally:
                self.extensions = rest

        def get_ext_filename(self, fullname):
            # asked by the full name and by the last part alone (distutils' get_ext_fullpath)
            ext = self.ext_map.get(fullname)
            if ext is not None and ext.name == INJECT:
                return os.path.join(*fullname.split(".")) + ".so"
            return super().get_ext_filename(fullname)

    return BuildExt


def _ext_modules_and_cmdclass():
    if CPU_ONLY:
        print("kvverify: KVVERIFY_CPU_ONLY=1: installing without the CUDA extension kvverify._C", file=sys.stderr)
        return [_inject_extension()], {"build_ext": _with_inject(build_ext)}
    reason = _why_no_extension()
    if reason is not None:
        sys.exit(f"kvverify: cannot build the CUDA extension kvverify._C: {reason}.\n{HOW}")

    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(
        os.path.relpath(p, here)
        for ext in ("cpp", "cu")
        for p in glob.glob(os.path.join(here, "csrc", "**", f"*.{ext}"), recursive=True)
    )
    ext = CUDAExtension(
        name="kvverify._C",
        sources=sources,
        # csrc/ itself: a product's file includes its own headers by name, and another's by their
        # folder ("record/host_watch.h"), and message.h, which two products share, at the top
        include_dirs=[os.path.join(here, "csrc")] + _pip_cuda_include_dirs(),
        extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        # The stable ABI keeps one build loadable by any CPython >= 3.10 (no pybind11 module).
        py_limited_api=True,
    )
    return [ext, _inject_extension()], {"build_ext": _with_inject(BuildExtension.with_options(use_ninja=True))}


ext_modules, cmdclass = _ext_modules_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
