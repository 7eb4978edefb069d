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


def _why_no_extension():
    """Return None when the extension can be built here, else the reason it cannot."""
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
        include_dirs=[os.path.join(here, "csrc")],
        # Py_LIMITED_API keeps one build loadable by any CPython >= 3.10 (no pybind11 module).
        define_macros=[("Py_LIMITED_API", "0x030a0000")],
        extra_compile_args={"cxx": ["-O2", "-std=c++17"], "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]},
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _ext_modules_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
