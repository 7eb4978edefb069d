"""Hostile programs for the op log (``kvverify.record.capture.oplog``, ``csrc/op_log.cpp``): each is
recorded with the op log and with the dispatch mode it stands in for, on the CPU arena of
``test_oplog.py``; the two must give the same trace, or the op log must name what it did not see
(a NOT RECORDED note). Never silently less device work, never a crash."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from test_oplog import ArenaAsDevice, _comparable  # noqa: E402

from kvverify.record import recording  # noqa: E402


def _dev(arena: torch.Tensor, offset: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """``n`` elements of ``dtype`` at byte ``offset`` of the arena (device memory)."""
    size = torch.empty((), dtype=dtype).element_size()
    return arena[offset:offset + n * size].view(dtype)


def _run(program, op_log: bool, pinned=()):
    arena = torch.zeros(64 << 10, dtype=torch.uint8)
    host = torch.zeros(4096, dtype=torch.uint8)
    platform = ArenaAsDevice(arena, [host, *pinned])
    with recording(platform=platform, op_log=op_log, keep_all=True) as rec:
        program(arena, host, platform)
    return rec


def _both(program):
    return _run(program, op_log=False), _run(program, op_log=True)


def _kernels(rec) -> Counter:
    return Counter(op.get("name") for op in rec.trace()["ops"] if op["op"] in ("kernel", "copy", "copy_batch"))


def _same_or_named(live, logged) -> None:
    """The invariant: the same trace and notes, or the op log says what it did not record."""
    if _comparable(logged) == _comparable(live) and logged.summary().notes == live.summary().notes:
        return
    assert not logged.complete(), ("the op log's trace differs from the dispatch mode's and no NOT RECORDED note "
                                   f"says so: live {_kernels(live)}, logged {_kernels(logged)}")


def test_a_handler_that_reports_several_copies_logs_them_as_live():
    # _foreach_copy_ of host -> device pairs, blocking: the dispatch mode writes its copies and one
    # stream synchronization after them (held back until the op is in the log); the replay must too
    def program(arena, host, platform):
        dsts = [_dev(arena, k * 512, 16) for k in range(4)]
        srcs = [host[k * 64:(k + 1) * 64].view(torch.float32) for k in range(4)]
        torch._foreach_copy_(dsts, srcs)

    live, logged = _both(program)
    assert [op["op"] for op in live.trace()["ops"]] == ["copy"] * 4 + ["sync_stream"]
    assert _comparable(logged) == _comparable(live)


def test_a_sparse_device_tensor_is_not_silently_dropped():
    # a sparse tensor whose indices and values lie in device memory: the dispatch mode records the
    # reads of both; the op log writes it down as not strided memory and must say it did not see it
    def program(arena, host, platform):
        indices = _dev(arena, 0, 4, torch.int64).view(2, 2)
        indices.zero_()
        values = _dev(arena, 4096, 2)
        values.fill_(1.0)
        s = torch.sparse_coo_tensor(indices, values, (2, 2), check_invariants=False)
        s * 2

    live, logged = _both(program)
    assert _kernels(live)["aten.mul.Tensor"] == 1
    _same_or_named(live, logged)
