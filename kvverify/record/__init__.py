"""``kvverify record``: the races of a user's own PyTorch program, found from a recording of it.

A live program runs under the recorder; what it asks the CUDA device to do (streams, events with
their query results, synchronization, aten kernels on CUDA tensors, host/device copies, batched
swaps with every raw pointer resolved to its allocation, host accesses to pinned memory) becomes a
trace (``docs/trace-format.md``), each op with ``at``, the line of the user's code that issued it;
``kvverify.check`` decides it. ``docs/record.md`` says what is seen and what is not.

- :func:`recording` (``with recording() as rec: ...; rec.check()``) and :class:`Recording`;
- :func:`host_write`, :func:`host_read`, :func:`host_buffer`, :func:`free`, :func:`reuse`,
  :func:`kernel`:
  annotations for what the dispatcher cannot see (no-ops outside a recording);
- ``kvverify record -- python prog.py`` / ``-- pytest ...`` (:mod:`kvverify.record.cli`), and the
  pytest plugin ``pytest --kvverify-record`` (:mod:`kvverify.record.pytest_plugin`).

Importing this package imports neither torch nor numpy; a recording does.
"""

from kvverify.record.session import (
    Recording,
    free,
    host_buffer,
    host_read,
    host_write,
    kernel,
    recording,
    reuse,
)

__all__ = ["Recording", "free", "host_buffer", "host_read", "host_write", "kernel", "recording", "reuse"]
