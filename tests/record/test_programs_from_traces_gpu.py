"""Programs from traces on a CUDA device: a random trace of the shapes one torch call can issue
becomes a program with one line per op (``trace_programs``): CUDA and pinned tensors, pageable CPU
tensors, a page registered with ``cudaHostRegister``, ``torch.cuda`` streams and events,
``kvverify.swap_blocks_batch`` in each order, ``queue.Queue`` hand-offs between two threads that
take turns as the trace interleaves them. Run under ``kvverify.record.recording()`` with torch's
real hooks, the allocators and native capture, the recording races on exactly the pairs of lines
that ``kvverify.check`` finds racing in the trace itself.

A disagreement hypothesis finds here is kept on the property test as an ``@example`` (the trace as
a dict literal), so that every GPU run runs it again. Those found on the stand-in are ``HANDED_ON``,
run here too."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from trace_programs import HANDED_ON, TorchCuda, disagreement, realizable_traces

pytestmark = pytest.mark.gpu


@settings(max_examples=300, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=realizable_traces())
def test_a_program_made_from_a_trace_races_recorded_on_the_lines_the_trace_races_on(trace, tmp_path_factory):
    found = disagreement(trace, TorchCuda(), tmp_path_factory.mktemp("program"))
    assert found is None, found


@pytest.mark.parametrize("name", list(HANDED_ON))
def test_a_stream_op_that_orders_nothing_itself_still_orders_another_threads_later_work(name, tmp_path):
    found = disagreement(HANDED_ON[name], TorchCuda(), tmp_path)
    assert found is None, found
