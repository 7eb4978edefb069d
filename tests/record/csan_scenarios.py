"""The scenarios PyTorch's CUDA Stream Sanitizer tests its own event handler with
(pytorch/pytorch, ``test/test_cuda_sanitizer.py``, class ``TestEventHandler``: fourteen scenarios,
eight of them racy), each re-created here as a real program: a read-only kernel launch is
``t.sum()`` on that stream, a read-write launch ``t.add_(1)``, record and wait are an event's
``record`` and the stream's ``wait_event``, an event's deletion is dropping the last reference to it.

``SCENARIOS`` maps each scenario's name to the verdict the sanitizer's test expects of it (RACY:
the test expects a bad launch) and the program, written against a device API with two
implementations: ``Cuda`` (torch on a CUDA device) and the CPU stand-in's (``tests/record/fake_cuda.py``,
see ``test_csan_scenarios.py``). Run as a script (``python csan_scenarios.py``) it runs every program
under the sanitizer on the GPU and prints, per scenario, whether the sanitizer reported a race.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from collections.abc import Callable


class Cuda:
    """The scenarios' device API on CUDA through torch."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def tensor(self):
        """A tensor of the scenario, its making finished (CSAN's scenarios start from tensors that
        exist: a launch on a side stream is no race with the factory's kernel)."""
        t = self.torch.ones(1024, device="cuda")
        self.torch.cuda.synchronize()
        return t

    def stream(self):
        return self.torch.cuda.Stream()

    def event(self):
        return self.torch.cuda.Event()

    def on(self, stream):
        return self.torch.cuda.stream(stream)

    def delete(self, holder: list) -> None:
        """Drop the last reference to the event ``holder`` holds (torch destroys the CUDA event)."""
        holder.clear()
        gc.collect()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()


def read(api, stream, *tensors) -> None:
    with api.on(stream):
        for t in tensors:
            t.sum()


def write(api, stream, *tensors) -> None:
    with api.on(stream):
        for t in tensors:
            t.add_(1)


def empty_kernel_launch(api) -> None:
    with api.on(api.stream()):
        api.tensor()  # (CSAN's empty launch: a kernel that touches no tensor of the test's)


def simple_passing(api) -> None:
    t, s1, s2 = api.tensor(), api.stream(), api.stream()
    read(api, s1, t)
    read(api, s2, t)


def simple_error(api) -> None:
    t, s1, s2 = api.tensor(), api.stream(), api.stream()
    read(api, s1, t)
    write(api, s2, t)


def simple_sync(api) -> None:
    t, s1, s2, e = api.tensor(), api.stream(), api.stream(), api.event()
    read(api, s1, t)
    e.record(s1)
    s2.wait_event(e)
    write(api, s2, t)


def reads_check_last_write(api) -> None:
    t, s1, s2, s3, e = api.tensor(), api.stream(), api.stream(), api.stream(), api.event()
    write(api, s1, t)
    e.record(s1)
    s2.wait_event(e)
    read(api, s2, t)
    read(api, s3, t)  # bad: nothing orders it after the write


def branch_sync(api) -> None:
    t, s1, s2, s3, e = api.tensor(), api.stream(), api.stream(), api.stream(), api.event()
    write(api, s1, t)
    e.record(s1)
    s2.wait_event(e)
    s3.wait_event(e)
    read(api, s2, t)
    read(api, s3, t)
    write(api, s2, t)  # bad: s3's read is not ordered before it


def chain_sync(api) -> None:
    t = api.tensor()
    streams = [api.stream() for _ in range(11)]
    read(api, streams[0], t)
    for i in range(10):
        e = api.event()
        e.record(streams[i])
        streams[i + 1].wait_event(e)
    write(api, streams[10], t)


def expired_record(api) -> None:
    t, s1, s2, e = api.tensor(), api.stream(), api.stream(), api.event()
    read(api, s1, t)
    e.record(s1)
    read(api, s1, t)  # after the record: the wait does not cover it
    s2.wait_event(e)
    write(api, s2, t)  # bad


def _deleted(api, delete: bool, create: bool) -> None:
    t, s1, s2 = api.tensor(), api.stream(), api.stream()
    holder = [api.event()]
    read(api, s1, t)
    holder[0].record(s1)
    if delete:
        api.delete(holder)
    if create or not holder:  # (a program cannot wait on an event it let go of: a new one, never recorded)
        holder = [api.event()]
    s2.wait_event(holder[0])
    write(api, s2, t)  # bad: the event waited on was never recorded


def deleted_record(api) -> None:
    for delete, create in ((True, True), (True, False), (False, True)):
        _deleted(api, delete, create)


def all_reads_checked_failing(api) -> None:
    t = api.tensor()
    s0 = api.stream()
    streams = [api.stream() for _ in range(10)]
    events = [api.event() for _ in range(10)]
    for s, e in zip(streams, events):
        read(api, s, t)
        e.record(s)
    for e in events[:-1]:  # the last read's event is not waited for
        s0.wait_event(e)
    write(api, s0, t)  # bad


def all_reads_checked_passing(api) -> None:
    t = api.tensor()
    s0 = api.stream()
    streams = [api.stream() for _ in range(9)]
    events = [api.event() for _ in range(9)]
    for s, e in zip(streams, events):
        read(api, s, t)
        e.record(s)
    for e in events:
        s0.wait_event(e)
    write(api, s0, t)


def multiple_errors(api) -> None:
    tensors = [api.tensor() for _ in range(10)]
    s0, s1 = api.stream(), api.stream()
    write(api, s0, *tensors)
    write(api, s1, *tensors)  # bad, ten times


def correct_state_merging(api) -> None:
    t1, t2, s1, s2 = api.tensor(), api.tensor(), api.stream(), api.stream()
    e1, e2, e3 = api.event(), api.event(), api.event()
    write(api, s1, t1)
    write(api, s2, t2)
    e1.record(s1)
    e2.record(s2)
    write(api, s1, t1)
    write(api, s2, t2)
    s2.wait_event(e1)
    s1.wait_event(e2)
    e3.record(s2)
    s1.wait_event(e3)
    write(api, s1, t1, t2)


def record_override(api) -> None:
    t1, t2, s1, s2, s3, e = api.tensor(), api.tensor(), api.stream(), api.stream(), api.stream(), api.event()
    read(api, s1, t1)
    read(api, s2, t2)
    e.record(s1)
    e.record(s2)  # the event now captures s2's work, not s1's
    s3.wait_event(e)
    write(api, s3, t1)  # bad


def multiple_wait(api) -> None:
    t, s1, s2, s3, e = api.tensor(), api.stream(), api.stream(), api.stream(), api.event()
    write(api, s1, t)
    e.record(s1)
    s2.wait_event(e)
    s3.wait_event(e)
    read(api, s2, t)
    read(api, s3, t)


SCENARIOS: dict[str, tuple[str, Callable]] = {
    "empty_kernel_launch": ("SAFE", empty_kernel_launch),
    "simple_passing": ("SAFE", simple_passing),
    "simple_error": ("RACY", simple_error),
    "simple_sync": ("SAFE", simple_sync),
    "reads_check_last_write": ("RACY", reads_check_last_write),
    "branch_sync": ("RACY", branch_sync),
    "chain_sync": ("SAFE", chain_sync),
    "expired_record": ("RACY", expired_record),
    "deleted_record": ("RACY", deleted_record),
    "all_reads_checked_failing": ("RACY", all_reads_checked_failing),
    "all_reads_checked_passing": ("SAFE", all_reads_checked_passing),
    "multiple_errors": ("RACY", multiple_errors),
    "correct_state_merging": ("SAFE", correct_state_merging),
    "record_override": ("RACY", record_override),
    "multiple_wait": ("SAFE", multiple_wait),
}
"""Scenario name -> (the verdict PyTorch's sanitizer test expects, the program). (CSAN's
``test_deleted_record`` runs three sub-cases; here they are one program, racy three times.)"""


def under_csan() -> dict[str, bool]:
    """Run every scenario under PyTorch's CUDA Stream Sanitizer (enabled in this process, which it
    cannot leave again); return, per scenario, whether it reported a race (it raises at the first
    bad launch of a program)."""
    import torch
    from torch.cuda._sanitizer import CUDASanitizerErrors, enable_cuda_sanitizer

    enable_cuda_sanitizer()
    api, reported = Cuda(), {}
    for name, (_, program) in SCENARIOS.items():
        try:
            program(api)
            reported[name] = False
        except CUDASanitizerErrors:
            reported[name] = True
        with contextlib.suppress(CUDASanitizerErrors):
            torch.cuda.synchronize()
        gc.collect()
    return reported


if __name__ == "__main__":
    json.dump(under_csan(), sys.stdout)
