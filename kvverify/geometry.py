"""KV-cache geometry: model presets, Hugging Face ``config.json``, page layout and pointers.

The layout is the one a paged-attention serving engine uses (vLLM's FlashAttention
backend and its CPU offloading connector, for instance):

- one tensor per layer, split into a K and a V tensor where the attention backend splits
  them (``kv_split``), each viewed as ``(num_blocks, page_bytes)``: GPU block ``b`` of a
  tensor starts at ``base + b * page_bytes``;
- MLA models (DeepSeek-V3) keep one latent tensor per layer, a page of
  ``block_size * (kv_lora_rank + qk_rope_head_dim)`` elements, not sharded by TP;
- a CPU block holds ``block_size_factor`` GPU pages back to back, so the CPU tensor is
  viewed as ``(num_cpu_blocks * block_size_factor, page_bytes)`` and CPU block ``c``
  covers pages ``c * f .. c * f + f - 1``.

Everything here is numpy and integer arithmetic; nothing touches a device.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from kvverify.errors import ConfigError

__all__ = [
    "ConfigError",
    "DTYPE_BYTES",
    "KVLayout",
    "ModelGeometry",
    "PRESETS",
    "SwapCopies",
    "from_hf_config",
    "preset",
]

# Bytes per element of each ``torch_dtype`` spelling found in HF configs (with and
# without the ``torch.`` prefix). fp8 appears as a KV-cache dtype override, not as a
# model's torch_dtype, but accepting it here keeps one table.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
}


def _positive_int_problem(value: Any) -> str | None:
    # bool is an int subclass; `true` for a head count is a broken config, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return f"must be an integer, got {value!r}"
    if value <= 0:
        return f"must be positive, got {value}"
    return None


def _check_positive_ints(obj: Any, *fields: str) -> None:
    for field in fields:
        problem = _positive_int_problem(getattr(obj, field))
        if problem:
            raise ValueError(f"{field} {problem}")


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """What a model's KV cache looks like per token and layer.

    ``num_kv_heads`` and ``head_dim`` are the unsharded values. For an MLA model
    ``mla_latent_dim`` is ``kv_lora_rank + qk_rope_head_dim`` and the cache is stored as
    one "head" of that width (``num_kv_heads == 1``, ``head_dim == mla_latent_dim``), as
    engines store it. ``kv_split`` says whether K and V live in separate tensors (two per
    layer, as vLLM's FlashAttention backend keeps them) or in one tensor per layer (MLA, or
    a backend that keeps K and V of a block together, such as FlashInfer's
    ``(num_blocks, 2, ...)``: ``dataclasses.replace(g, kv_split=False)``).

    Raises ValueError when a count is not a positive integer, ``dtype_bytes`` is not
    1, 2 or 4, or the MLA fields disagree.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    mla_latent_dim: int | None = None
    kv_split: bool = True

    def __post_init__(self) -> None:
        _check_positive_ints(self, "num_layers", "num_kv_heads", "head_dim")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes!r}")
        if self.mla_latent_dim is not None:
            _check_positive_ints(self, "mla_latent_dim")
            if (self.num_kv_heads, self.head_dim, self.kv_split) != (1, self.mla_latent_dim, False):
                raise ValueError(
                    "an MLA geometry stores one latent per token: num_kv_heads=1, "
                    "head_dim=mla_latent_dim, kv_split=False"
                )

    @property
    def is_mla(self) -> bool:
        """True for a latent (MLA) cache, which tensor parallelism replicates."""
        return self.mla_latent_dim is not None

    @classmethod
    def mla(cls, name: str, num_layers: int, latent_dim: int, dtype_bytes: int) -> ModelGeometry:
        """An MLA geometry: one latent tensor per layer, ``latent_dim`` elements per token."""
        return cls(
            name, num_layers, 1, latent_dim, dtype_bytes, mla_latent_dim=latent_dim, kv_split=False
        )


# Numbers checked against each model's public config.json (see docs and the report of
# the change that added them). Mistral-7B is v0.3; DeepSeek-V3's latent is
# kv_lora_rank 512 + qk_rope_head_dim 64.
PRESETS: dict[str, ModelGeometry] = {
    g.name: g
    for g in (
        ModelGeometry("llama-3.1-8b", 32, 8, 128, 2),
        ModelGeometry("llama-3.1-70b", 80, 8, 128, 2),
        ModelGeometry("qwen2.5-7b", 28, 4, 128, 2),
        ModelGeometry("mistral-7b", 32, 8, 128, 2),
        ModelGeometry("gemma-2-9b", 42, 8, 256, 2),
        ModelGeometry.mla("deepseek-v3", 61, 512 + 64, 2),
    )
}


def preset(name: str) -> ModelGeometry:
    """Return the preset called ``name`` (case-insensitive).

    Raises ValueError listing the known presets when there is none of that name.
    """
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


# ---------------------------------------------------------------------------------------
# Hugging Face config.json
# ---------------------------------------------------------------------------------------


def from_hf_config(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    name: str | None = None,
    kv_cache_dtype: str | None = None,
) -> ModelGeometry:
    """Read a model's KV geometry from a Hugging Face ``config.json``.

    ``source`` is a path to the file (or to a directory holding ``config.json``) or the
    already-parsed mapping. A multimodal config whose decoder sits under ``text_config``
    is read from there. Fields read:

    - ``num_hidden_layers``: layers, one (MLA) or two (K, V) cache tensors each;
    - MLA (``kv_lora_rank`` present and not null): ``kv_lora_rank + qk_rope_head_dim``
      elements per token; ``num_key_value_heads`` is ignored (DeepSeek-V3 lists 128 there);
    - otherwise ``num_key_value_heads`` (absent or null means ``num_attention_heads``, as
      in transformers: plain multi-head attention) and ``head_dim``, or
      ``hidden_size / num_attention_heads`` when ``head_dim`` is absent or null;
    - ``torch_dtype`` (or ``dtype``, its newer spelling) unless ``kv_cache_dtype`` is
      given (an engine's ``--kv-cache-dtype``, e.g. ``"fp8"``).

    What is contradictory: ``num_key_value_heads`` greater than ``num_attention_heads`` or
    not dividing it (grouped-query attention shares each KV head among a whole number of
    query heads); ``hidden_size`` not divisible by ``num_attention_heads`` when there is
    no ``head_dim`` to use instead; ``torch_dtype`` and ``dtype`` both present and
    different. An explicit ``head_dim`` that differs from ``hidden_size /
    num_attention_heads`` is *not* contradictory: Gemma-2-9B (3584 / 16 = 224, head_dim
    256) is built that way, and engines size the cache by ``head_dim``.

    Per-layer variations (sliding-window layers, KV sharing across layers) are not
    modelled: every layer gets the same page.

    Raises ConfigError (a ValueError) naming the field that is missing, not a positive
    integer (booleans and floats included), contradictory, or an unknown dtype; and
    ConfigError(field="config.json") when the file cannot be read or is not a JSON object.
    """
    config, default_name = _load_config(source)
    text = config.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" not in config:
        dtype_keys = ("torch_dtype", "dtype")
        if any(text.get(k) is not None for k in dtype_keys):
            config = text
        else:  # multimodal wrappers often keep the dtype at the top level only
            config = {**{k: config[k] for k in dtype_keys if k in config}, **text}
    num_layers = _positive_int(config, "num_hidden_layers")
    dtype_bytes = _dtype_bytes(config, kv_cache_dtype)
    name = name or str(config.get("_name_or_path") or default_name)

    if config.get("kv_lora_rank") is not None:
        latent = _positive_int(config, "kv_lora_rank") + _positive_int(config, "qk_rope_head_dim")
        return ModelGeometry.mla(name, num_layers, latent, dtype_bytes)

    num_heads = _positive_int(config, "num_attention_heads")
    if config.get("num_key_value_heads") is None:
        num_kv_heads = num_heads
    else:
        num_kv_heads = _positive_int(config, "num_key_value_heads")
    if num_kv_heads > num_heads:
        raise ConfigError(
            "num_key_value_heads",
            f"{num_kv_heads} is more than num_attention_heads ({num_heads})",
        )
    if num_heads % num_kv_heads:
        raise ConfigError(
            "num_key_value_heads",
            f"{num_kv_heads} does not divide num_attention_heads ({num_heads})",
        )
    if config.get("head_dim") is not None:
        head_dim = _positive_int(config, "head_dim")
    else:
        hidden = _positive_int(config, "hidden_size")
        if hidden % num_heads:
            raise ConfigError(
                "hidden_size",
                f"{hidden} is not divisible by num_attention_heads ({num_heads}) and there is "
                "no head_dim",
            )
        head_dim = hidden // num_heads
    return ModelGeometry(name, num_layers, num_kv_heads, head_dim, dtype_bytes)


def _load_config(source: str | os.PathLike | Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    if isinstance(source, Mapping):
        return source, "config"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("config.json", f"cannot read {path}: {exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("config.json", f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError("config.json", f"{path} does not hold a JSON object")
    # A checkpoint directory's name is the usual way people tell models apart.
    return config, path.parent.name or path.stem


def _positive_int(config: Mapping[str, Any], field: str) -> int:
    if field not in config or config[field] is None:
        raise ConfigError(field, "missing")
    problem = _positive_int_problem(config[field])
    if problem:
        raise ConfigError(field, problem)
    return int(config[field])


def _dtype_bytes(config: Mapping[str, Any], override: str | None) -> int:
    if override is not None:
        return _lookup_dtype("kv_cache_dtype", override)
    torch_dtype, dtype = config.get("torch_dtype"), config.get("dtype")
    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise ConfigError("dtype", f"{dtype!r} contradicts torch_dtype {torch_dtype!r}")
    if torch_dtype is None and dtype is None:
        raise ConfigError("torch_dtype", "missing (and no dtype); pass a KV-cache dtype (kv_cache_dtype=, or kvverify stress --kv-cache-dtype)")
    field = "torch_dtype" if torch_dtype is not None else "dtype"
    return _lookup_dtype(field, config[field])


def _lookup_dtype(field: str, value: Any) -> int:
    key = value.removeprefix("torch.") if isinstance(value, str) else None
    if key not in DTYPE_BYTES:
        raise ConfigError(field, f"unknown dtype {value!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


# ---------------------------------------------------------------------------------------
# Page layout and pointers
# ---------------------------------------------------------------------------------------

Direction = Literal["store", "load"]


class SwapCopies(NamedTuple):
    """The copies of one batched swap: three 1-D int64 arrays of equal length.

    ``src_ptrs`` and ``dst_ptrs`` are raw byte addresses, ``sizes`` are bytes; the order is
    tensor-major (all pages of tensor 0, then tensor 1, ...), the order in which an engine
    issues them. Hand them to ``kvverify.device.ops.swap_blocks_batch``.
    """

    src_ptrs: np.ndarray
    dst_ptrs: np.ndarray
    sizes: np.ndarray


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """A model's paged KV cache on one tensor-parallel rank.

    - ``block_size``: tokens per GPU page;
    - ``tp``: tensor-parallel ranks. KV heads are split across ranks; where there are
      fewer KV heads than ranks each rank keeps one head (replicated), which needs ``tp``
      to be a multiple of the head count, as vLLM requires. MLA latents are not split;
    - ``block_size_factor``: GPU pages per CPU block (the CPU block holds
      ``block_size * block_size_factor`` tokens).

    Raises ValueError when a count is not a positive integer, ``tp`` and the KV head
    count do not divide one another, or a page is not a multiple of 8 bytes (the block
    pattern writes 8-byte words).
    """

    geometry: ModelGeometry
    block_size: int = 16
    tp: int = 1
    block_size_factor: int = 1

    def __post_init__(self) -> None:
        _check_positive_ints(self, "block_size", "tp", "block_size_factor")
        heads = self.geometry.num_kv_heads
        if not self.geometry.is_mla:
            if heads >= self.tp and heads % self.tp:
                raise ValueError(f"tp={self.tp} does not divide num_kv_heads={heads}")
            if heads < self.tp and self.tp % heads:
                raise ValueError(
                    f"tp={self.tp} is not a multiple of num_kv_heads={heads}, so the heads "
                    "cannot be replicated evenly"
                )
        if self.page_bytes % 8:
            raise ValueError(f"page_bytes={self.page_bytes} is not a multiple of 8")

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank stores (1 for MLA; at least 1 when heads are replicated)."""
        if self.geometry.is_mla:
            return 1
        return max(1, self.geometry.num_kv_heads // self.tp)

    @property
    def page_bytes(self) -> int:
        """Bytes of one GPU block in one tensor: one layer's K (or V, or latent) page.

        ``block_size * kv_heads_per_rank * head_dim * dtype_bytes``, doubled where K and V
        share the tensor (``kv_split`` false on a non-MLA geometry).
        """
        g = self.geometry
        kv_per_tensor = 2 if not g.kv_split and not g.is_mla else 1
        return self.block_size * self.kv_heads_per_rank * g.head_dim * g.dtype_bytes * kv_per_tensor

    @property
    def num_tensors(self) -> int:
        """Cache tensors per rank: ``num_layers * 2`` with K and V split, else one per layer."""
        return self.geometry.num_layers * (2 if self.geometry.kv_split else 1)

    @property
    def block_bytes(self) -> int:
        """Bytes of one GPU block across all tensors (what one block swap moves)."""
        return self.num_tensors * self.page_bytes

    @property
    def cpu_page_bytes(self) -> int:
        """Bytes of one CPU block in one tensor: ``block_size_factor`` GPU pages."""
        return self.page_bytes * self.block_size_factor

    @property
    def cpu_block_bytes(self) -> int:
        """Bytes of one CPU block across all tensors."""
        return self.block_bytes * self.block_size_factor

    def gpu_tensor_bytes(self, num_gpu_blocks: int) -> int:
        """Bytes to allocate for one GPU cache tensor of ``num_gpu_blocks`` blocks."""
        return _count("num_gpu_blocks", num_gpu_blocks) * self.page_bytes

    def cpu_tensor_bytes(self, num_cpu_blocks: int) -> int:
        """Bytes to allocate for one CPU cache tensor of ``num_cpu_blocks`` blocks."""
        return _count("num_cpu_blocks", num_cpu_blocks) * self.cpu_page_bytes

    def describe(self) -> dict[str, Any]:
        """The layout as a JSON-ready dict (the ``layout`` object of the stress report)."""
        g = self.geometry
        return {
            "model": g.name,
            "num_layers": g.num_layers,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "dtype_bytes": g.dtype_bytes,
            "mla_latent_dim": g.mla_latent_dim,
            "kv_split": g.kv_split,
            "block_size": self.block_size,
            "tp": self.tp,
            "block_size_factor": self.block_size_factor,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "num_tensors": self.num_tensors,
            "page_bytes": self.page_bytes,
            "block_bytes": self.block_bytes,
            "cpu_block_bytes": self.cpu_block_bytes,
        }

    # -- pointers ---------------------------------------------------------------------

    def page_ptrs(self, tensor_base_ptrs: Sequence[int], block_ids: np.ndarray) -> np.ndarray:
        """GPU page addresses, as an engine computes them: ``base + block_id * page_bytes``.

        ``tensor_base_ptrs``: ``num_tensors`` base addresses (bytes), one per cache tensor,
        in layer order (K before V). ``block_ids``: 1-D integer array of GPU block ids.
        Returns int64 ``(num_tensors, len(block_ids))``.

        Raises ValueError for the wrong number of bases or invalid block ids.
        """
        return self._bases(tensor_base_ptrs)[:, None] + _ids(block_ids)[None, :] * self.page_bytes

    def cpu_page_ptrs(
        self, tensor_base_ptrs: Sequence[int], cpu_block_ids: np.ndarray, skip: int = 0
    ) -> np.ndarray:
        """Addresses of the GPU-page-sized slots of the given CPU blocks.

        CPU block ``c`` holds ``block_size_factor`` (``f``) pages, slot ``s`` at
        ``base + (c * f + s) * page_bytes``. The slots of all blocks come in order, the
        first ``skip`` slots of the first block left out (a load that needs only the tail
        of its first CPU block). Returns int64
        ``(num_tensors, len(cpu_block_ids) * f - skip)``.

        Raises ValueError for the wrong number of bases, invalid block ids, or
        ``skip`` outside ``[0, f)``.
        """
        pages = self.cpu_slot_ids(cpu_block_ids, skip)
        return self._bases(tensor_base_ptrs)[:, None] + pages[None, :] * self.page_bytes

    def cpu_slot_ids(self, cpu_block_ids: np.ndarray, skip: int = 0) -> np.ndarray:
        """CPU block ids expanded to page-slot indices: ``c * f + s`` for each slot ``s``.

        1-D int64 of length ``len(cpu_block_ids) * f - skip`` (vLLM's ``expand_block_ids``).
        Raises ValueError when ``skip`` is outside ``[0, f)`` or the ids are invalid.
        """
        f = self.block_size_factor
        if not 0 <= skip < f:
            raise ValueError(f"skip={skip} must lie in [0, block_size_factor={f})")
        slots = _ids(cpu_block_ids)[:, None] * f + np.arange(f, dtype=np.int64)[None, :]
        return slots.reshape(-1)[skip:]

    def transfer_triples(
        self,
        direction: Direction,
        gpu_base_ptrs: Sequence[int],
        cpu_base_ptrs: Sequence[int],
        gpu_block_ids: np.ndarray,
        cpu_block_ids: np.ndarray,
    ) -> SwapCopies:
        """The (src, dst, size) copies that move GPU blocks to CPU blocks or back.

        ``direction``: ``"store"`` (GPU→CPU, D2H) or ``"load"`` (CPU→GPU, H2D). The i-th
        GPU block pairs with slot i of the expanded CPU blocks (``cpu_slot_ids``), so GPU
        block j of the list lands in CPU block ``cpu_block_ids[j // f]`` at byte offset
        ``(j % f) * page_bytes``. As in vLLM's offloading handler a store fills whole CPU
        blocks (``len(gpu) == len(cpu) * f``); a load may start inside its first CPU block,
        reading only its last ``len(gpu) - (len(cpu) - 1) * f`` slots. Every copy is
        ``page_bytes`` long. Returns the ``SwapCopies`` of ``num_tensors * len(gpu_block_ids)``
        copies, tensor-major.

        Raises ValueError for an unknown direction, block counts that do not match, or
        invalid bases or ids.
        """
        if direction not in ("store", "load"):
            raise ValueError(f"direction must be 'store' or 'load', got {direction!r}")
        gpu_ids, n_cpu = _ids(gpu_block_ids), len(_ids(cpu_block_ids))
        skip = n_cpu * self.block_size_factor - len(gpu_ids)
        # vLLM asserts the same: stores write whole CPU blocks; loads may skip the head
        # of the first CPU block but never a whole block.
        allowed = range(1) if direction == "store" else range(self.block_size_factor)
        if skip not in allowed or not len(gpu_ids):
            raise ValueError(
                f"{len(gpu_ids)} GPU blocks do not match {n_cpu} CPU blocks of "
                f"{self.block_size_factor} pages for a {direction}"
            )
        gpu = self.page_ptrs(gpu_base_ptrs, gpu_ids).reshape(-1)
        cpu = self.cpu_page_ptrs(cpu_base_ptrs, cpu_block_ids, skip).reshape(-1)
        src, dst = (gpu, cpu) if direction == "store" else (cpu, gpu)
        return SwapCopies(src, dst, np.full(src.shape, self.page_bytes, dtype=np.int64))

    def _bases(self, tensor_base_ptrs: Sequence[int]) -> np.ndarray:
        bases = np.asarray(tensor_base_ptrs, dtype=np.int64)
        if bases.shape != (self.num_tensors,):
            raise ValueError(
                f"expected {self.num_tensors} tensor base pointers, got shape {bases.shape}"
            )
        return bases


def _count(field: str, value: Any) -> int:
    problem = _positive_int_problem(value)
    if problem:
        raise ValueError(f"{field} {problem}")
    return int(value)


def _ids(block_ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"block ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size and ids.min() < 0:
        raise ValueError("block ids must be non-negative")
    return ids.astype(np.int64, copy=False)
