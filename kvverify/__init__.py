"""kvverify: proves whether batched KV-cache swaps between GPU and host memory are safe.

Importing the package needs neither a GPU nor the compiled extension; the parts that
drive the device (``kvverify.device.ops``, the stress executors, probe, bench) load
``kvverify._C`` on first use and raise a clear error where it is missing.
"""

__version__ = "0.1.0"
