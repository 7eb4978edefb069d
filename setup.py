"""Build kvverify, with the CUDA extension ``kvverify._C`` where a CUDA torch and nvcc exist.

Every ``csrc/*.cpp`` and ``csrc/*.cu`` goes into the one extension; each file registers its
own ops with ``TORCH_LIBRARY_FRAGMENT(kvverify, ...)``. The extension never links libcuda:
driver entry points are resolved at run time, so build hosts need no driver.

Environment:
- ``TORCH_CUDA_ARCH_LIST``: honoured; the default is ``9.0`` (sm_90, Hopper).
- ``KVVERIFY_REQUIRE_EXTENSION=1``: a skipped build is an error instead of a notice.
"""

import glob
import os
import sys

from setuptools import setup

REQUIRE = os.environ.get("KVVERIFY_REQUIRE_EXTENSION", "") == "1"


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


def _why_no_extension():
    """Return None when the extension can be built here, else the reason it cannot."""
    _find_cuda_home()
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return "torch is not installed in the build environment"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if cpp_extension.CUDA_HOME is None:
        return "nvcc was not found (set CUDA_HOME)"
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


def _ext_modules_and_cmdclass():
    reason = _why_no_extension()
    if reason is not None:
        message = f"kvverify: not building the CUDA extension kvverify._C ({reason}); swap_blocks_batch will be unavailable"
        if REQUIRE:
            sys.exit(f"{message}\nKVVERIFY_REQUIRE_EXTENSION=1 was set, so this is an error.")
        print(message, file=sys.stderr)
        return [], {}

    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(
        os.path.relpath(p, here)
        for p in glob.glob(os.path.join(here, "csrc", "*.cpp")) + glob.glob(os.path.join(here, "csrc", "*.cu"))
    )
    ext = CUDAExtension(
        name="kvverify._C",
        sources=sources,
        include_dirs=[os.path.join(here, "csrc")] + _pip_cuda_include_dirs(),
        extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        # The stable ABI keeps one build loadable by any CPython >= 3.10 (no pybind11 module).
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _ext_modules_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
