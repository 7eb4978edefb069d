"""The race corpus: known races re-created in kvverify's own code in a broken and a fixed form, one
case per module (docs/corpus.md): races of public reports (issues and pull requests of vLLM,
SGLang, PyTorch and TorchRec) and of kvverify's own demo offload handler.

- :class:`Case` (what a case is: its source, root cause, hazard class, what captures it, the race's
  kind and the pair of functions whose lines issue it) and :class:`Witness` (what a native run saw);
- ``CASES``: every case, in the table's order; :func:`find` picks cases by name;
- ``kvverify corpus`` (:mod:`kvverify.record.corpus.cli`) runs each form natively, recorded and
  under PyTorch's CUDA Stream Sanitizer, and prints the table.

Importing this package imports no torch: the case modules import it inside their functions, so the
corpus can be listed anywhere. Running a case needs a CUDA device and ``kvverify._C``.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvverify.record.corpus import (
    demo_descriptor_rewrite,
    demo_polled_query,
    pytorch_130785,
    sglang_18746,
    sglang_20611,
    sglang_28468,
    sglang_36738,
    torchrec_4231,
    vllm_31341,
    vllm_39306,
    vllm_45268,
    vllm_45704,
    vllm_47282,
    vllm_50696,
    vllm_51667,
)
from kvverify.record.corpus.case import CAPTURES, FORMS, HAZARDS, KINDS, Case, Witness

CASES: tuple[Case, ...] = tuple(m.CASE for m in (
    vllm_31341, vllm_39306, vllm_50696, vllm_47282, vllm_45704, vllm_45268, vllm_51667,
    sglang_20611, sglang_36738, sglang_18746, sglang_28468,
    pytorch_130785, torchrec_4231,
    demo_descriptor_rewrite, demo_polled_query,
))


def find(names: Iterable[str]) -> list[Case]:
    """The cases named, in the order given (every case for no names). Raises ValueError naming the
    unknown names and every known case."""
    names = list(names)
    if not names:
        return list(CASES)
    by_name = {case.name: case for case in CASES}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown case{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"known cases: {', '.join(by_name)}")
    return [by_name[n] for n in names]


__all__ = ["CAPTURES", "CASES", "FORMS", "HAZARDS", "KINDS", "Case", "Witness", "find"]
