"""What machine a measurement ran on: GPU, driver, CUDA, torch, PCIe link, batch API.

``collect()`` never raises and never needs a GPU: a field it cannot read is ``"unknown"``
(and the reason is kept under ``"errors"``). NVML (the ``nvidia-ml-py`` package, imported as
``pynvml``) is imported lazily and only gives the driver version and the PCIe link; its absence
leaves those fields ``"unknown"``. ``kvverify probe``, ``kvverify bench`` and the stress report
embed this dictionary in their JSON.
"""

from __future__ import annotations

import ctypes
import platform as _platform
from typing import Any

UNKNOWN = "unknown"


def _cuda_version_string(encoded: int) -> str:
    """CUDA encodes versions as ``1000 * major + 10 * minor``: 13000 -> ``"13.0"``, 12080 -> ``"12.8"``."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def _cuda_driver_api_version() -> str:
    """The CUDA version the installed driver supports (``cuDriverGetVersion``), via ctypes on libcuda."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return _cuda_version_string(version.value)
    return UNKNOWN


def _torch_fields(info: dict[str, Any], errors: dict[str, str], device_index: int | None) -> Any:
    try:
        import torch
    except ImportError as exc:
        errors["torch"] = str(exc)
        return None
    info["torch_version"] = torch.__version__
    info["cuda_runtime_version"] = torch.version.cuda or UNKNOWN  # the CUDA toolkit torch was built with
    try:
        if not torch.cuda.is_available():
            errors["gpu"] = "no CUDA device visible to torch"
            return None
        index = torch.cuda.current_device() if device_index is None else int(device_index)
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:
        errors["gpu"] = str(exc)
        return None
    info["device_index"] = index
    info["gpu_name"] = props.name
    info["compute_capability"] = f"{props.major}.{props.minor}"
    info["gpu_memory_bytes"] = int(props.total_memory)
    info["multiprocessors"] = int(props.multi_processor_count)
    l2 = getattr(props, "L2_cache_size", None)
    info["l2_cache_bytes"] = int(l2) if l2 else UNKNOWN
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        info["gpu_uuid"] = f"GPU-{uuid}" if not str(uuid).startswith("GPU-") else str(uuid)
    return torch


def _nvml_fields(info: dict[str, Any], errors: dict[str, str]) -> None:
    try:
        import pynvml
    except ImportError:
        errors["nvml"] = "pynvml (package nvidia-ml-py) is not installed"
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        errors["nvml"] = f"nvmlInit failed: {exc}"
        return
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver_version"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        handle = None
        if "gpu_uuid" in info:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(info["gpu_uuid"])
            except Exception:
                handle = None
        if handle is None:
            # Without a UUID match, NVML's index can differ from CUDA's under CUDA_VISIBLE_DEVICES.
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(info.get("device_index", 0)))
            info["pcie_device_match"] = "nvml index (uuid unavailable)"
        pcie: dict[str, Any] = {}
        for key, fn in (
            ("gen_current", "nvmlDeviceGetCurrPcieLinkGeneration"),
            ("width_current", "nvmlDeviceGetCurrPcieLinkWidth"),
            ("gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
            ("width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
            ("gen_gpu_max", "nvmlDeviceGetGpuMaxPcieLinkGeneration"),
        ):
            try:
                pcie[key] = int(getattr(pynvml, fn)(handle))
            except Exception as exc:
                pcie[key] = UNKNOWN
                errors[f"pcie.{key}"] = str(exc)
        info["pcie"] = pcie
    except Exception as exc:
        errors["nvml"] = str(exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _batch_api(errors: dict[str, str]) -> Any:
    try:
        from kvverify.device import ops

        return bool(ops.batch_api_available())
    except Exception as exc:
        errors["batch_api"] = str(exc)
        return UNKNOWN


def collect(device_index: int | None = None) -> dict[str, Any]:
    """Describe this machine for a report; never raises, never requires a GPU.

    Keys: ``gpu_name``, ``compute_capability``, ``gpu_memory_bytes`` (bytes), ``l2_cache_bytes``
    (bytes), ``multiprocessors``, ``driver_version`` (NVML, e.g. ``"580.159.03"``),
    ``cuda_driver_version`` (the CUDA version the driver supports, ``cuDriverGetVersion``),
    ``cuda_runtime_version`` (the CUDA toolkit torch was built with), ``torch_version``,
    ``python_version``, ``pcie`` (``gen_current``, ``width_current``, ``gen_max``, ``width_max``,
    ``gen_gpu_max``: NVML; the current generation can read low while the link idles),
    ``batch_api_available`` (``cuMemcpyBatchAsync`` resolvable), ``errors`` (field -> why it is unknown).
    """
    errors: dict[str, str] = {}
    info: dict[str, Any] = {
        "gpu_name": UNKNOWN,
        "compute_capability": UNKNOWN,
        "gpu_memory_bytes": UNKNOWN,
        "l2_cache_bytes": UNKNOWN,
        "multiprocessors": UNKNOWN,
        "driver_version": UNKNOWN,
        "cuda_driver_version": UNKNOWN,
        "cuda_runtime_version": UNKNOWN,
        "torch_version": UNKNOWN,
        "python_version": _platform.python_version(),
        "pcie": {k: UNKNOWN for k in ("gen_current", "width_current", "gen_max", "width_max", "gen_gpu_max")},
        "batch_api_available": UNKNOWN,
    }
    try:
        info["cuda_driver_version"] = _cuda_driver_api_version()
    except Exception as exc:
        errors["cuda_driver_version"] = str(exc)
    torch = _torch_fields(info, errors, device_index)
    if torch is not None:
        _nvml_fields(info, errors)
        info["batch_api_available"] = _batch_api(errors)
    else:
        errors.setdefault("nvml", "skipped: no CUDA device")
    info["errors"] = errors
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for a table caption: ``NVIDIA H200 · driver 580.159.03 · CUDA 13.0 (torch 2.11.0, built for 13.0) · PCIe Gen5 x16 · batch API yes``."""
    pcie = info.get("pcie", {})
    gen = pcie.get("gen_max", UNKNOWN)
    width = pcie.get("width_max", UNKNOWN)
    link = f"PCIe Gen{gen} x{width}" if UNKNOWN not in (gen, width) else "PCIe unknown"
    cur_gen, cur_width = pcie.get("gen_current", UNKNOWN), pcie.get("width_current", UNKNOWN)
    if UNKNOWN not in (cur_gen, cur_width) and (cur_gen, cur_width) != (gen, width):
        link += f" (now Gen{cur_gen} x{cur_width})"
    batch = info.get("batch_api_available", UNKNOWN)
    batch_text = {True: "yes", False: "no"}.get(batch, str(batch))
    return (
        f"{info.get('gpu_name', UNKNOWN)} · driver {info.get('driver_version', UNKNOWN)} · "
        f"CUDA {info.get('cuda_driver_version', UNKNOWN)} (torch {info.get('torch_version', UNKNOWN)}, "
        f"built for {info.get('cuda_runtime_version', UNKNOWN)}) · {link} · batch API {batch_text}"
    )


def render(info: dict[str, Any], console) -> None:
    """Print ``info`` as a two-column rich table (what probe and bench show above their results)."""
    from rich.markup import escape
    from rich.table import Table

    pcie = info.get("pcie", {})
    gen, width = pcie.get("gen_max", UNKNOWN), pcie.get("width_max", UNKNOWN)
    cur_gen, cur_width = pcie.get("gen_current", UNKNOWN), pcie.get("width_current", UNKNOWN)
    batch = info.get("batch_api_available", UNKNOWN)
    l2 = info.get("l2_cache_bytes", UNKNOWN)
    rows = [
        ("GPU", f"{info.get('gpu_name', UNKNOWN)} (compute {info.get('compute_capability', UNKNOWN)}, "
                f"L2 {l2 / 1e6:.0f} MB)" if isinstance(l2, int) else str(info.get("gpu_name", UNKNOWN))),
        ("driver", str(info.get("driver_version", UNKNOWN))),
        ("CUDA (driver supports)", str(info.get("cuda_driver_version", UNKNOWN))),
        ("CUDA (torch built for)", str(info.get("cuda_runtime_version", UNKNOWN))),
        ("torch / Python", f"{info.get('torch_version', UNKNOWN)} / {info.get('python_version', UNKNOWN)}"),
        ("PCIe (max, NVML)", f"Gen{gen} x{width}" if UNKNOWN not in (gen, width) else UNKNOWN),
        ("PCIe (now, NVML)", f"Gen{cur_gen} x{cur_width}" if UNKNOWN not in (cur_gen, cur_width) else UNKNOWN),
        ("batch API (cuMemcpyBatchAsync)", {True: "present", False: "absent"}.get(batch, str(batch))),
    ]
    table = Table(title="platform", show_header=False)
    table.add_column("field")
    table.add_column("value")
    for key, value in rows:
        table.add_row(escape(key), escape(value))
    console.print(table)
