"""kvverify: proves whether batched KV-cache swaps between GPU and host memory are safe.

- ``kvverify.check(trace)``: the happens-before checker (standard library only): a trace (a
  ``kvverify.check.Trace``, a dict or a JSON file's path) in, a ``Verdict`` out.
- ``kvverify.swap_blocks_batch`` / ``kvverify.SrcAccessOrder``: the batched swap op (needs torch and
  the compiled extension ``kvverify._C``, loaded on first use).

Importing the package needs neither a GPU, torch nor the extension. The folders are the evidence
paths (``docs/architecture.md``): ``check/``, ``scenarios/``, ``stress/``, ``record/``, ``measure/``,
``device/``.
"""

from kvverify.terms import SrcAccessOrder

__version__ = "0.1.0"
__all__ = ["SrcAccessOrder", "__version__", "check", "swap_blocks_batch"]


def __getattr__(name: str):
    # Loaded on first use: `import kvverify` stays cheap for `kvverify check`.
    if name == "check":
        import kvverify.check

        return kvverify.check
    if name == "swap_blocks_batch":
        from kvverify.device.ops import swap_blocks_batch

        return swap_blocks_batch
    raise AttributeError(f"module 'kvverify' has no attribute {name!r}")
