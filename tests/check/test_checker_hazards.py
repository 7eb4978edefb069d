"""Hazards H1–H7 (docs/stress.md, "Scenarios"): a broken and a fixed trace each, under every source access order
that applies, asserting the verdict, the racing op pairs and their kinds."""

from __future__ import annotations

import pytest
from trace_helpers import CPU, CPU2, GPU, GPU2, builder, races, run

ORDERS = ("STREAM", "DURING_API_CALL", "ANY")


# H1: a GPU→CPU store reads a GPU block before the compute writer finished -----------------------


@pytest.mark.parametrize("order", ORDERS)
def test_h1_store_without_barrier(order):
    b = builder()
    b.kernel("compute", "write_kv", writes=[GPU])        # 0
    b.copy_batch("offload", order, [(GPU, CPU)])         # 1
    assert races(b) == {(0, 1): "RAW"}


@pytest.mark.parametrize("order, expected", [
    ("STREAM", {}),                          # the fix
    ("DURING_API_CALL", {(0, 2): "RAW"}),    # the barrier does not hold back the source read
    ("ANY", {(0, 2): "RAW"}),
])
def test_h1_store_behind_a_barrier(order, expected):
    b = builder()
    b.kernel("compute", "write_kv", writes=[GPU])        # 0
    b.wait_stream("offload", on="compute")               # 1
    b.copy_batch("offload", order, [(GPU, CPU)])         # 2
    assert races(b) == expected
    if expected:
        (r,) = run(b).races
        assert r.rule == "5" and r.fix.startswith("use STREAM order for op 2")


@pytest.mark.parametrize("order", ORDERS)
def test_h1_fixed_by_host_synchronization_under_every_order(order):
    b = builder()
    b.kernel("compute", "write_kv", writes=[GPU])
    b.record("written", "compute")
    b.sync_event("written")
    b.copy_batch("offload", order, [(GPU, CPU)])
    assert races(b) == {}


# H2: a CPU→GPU load overwrites a GPU block compute still reads (WAR) or writes (WAW) ----------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("access, kind", [("reads", "WAR"), ("writes", "WAW")])
def test_h2_load_without_waiting_on_compute(order, access, kind):
    b = builder()
    b.kernel("compute", "attention" if access == "reads" else "zero_fill", **{access: [GPU]})   # 0
    b.copy_batch("load", order, [(CPU, GPU)])            # 1
    assert races(b) == {(0, 1): kind}
    (r,) = run(b).races
    assert r.rule == "2" and r.fix == "add `load.wait_stream(compute)` before op 1"


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("access", ["reads", "writes"])
def test_h2_fixed_load_waits_on_compute(order, access):
    b = builder()
    b.kernel("compute", "k", **{access: [GPU]})
    b.wait_stream("load", on="compute")
    b.copy_batch("load", order, [(CPU, GPU)])
    assert races(b) == {}


# H3: the host rewrites a pinned source buffer while an H2D copy is pending ------------------------


@pytest.mark.parametrize("order, expected", [
    ("STREAM", {(1, 2): "WAR"}),
    ("DURING_API_CALL", {}),     # the source was read during the call: no pending read to race
    ("ANY", {(1, 2): "WAR"}),
])
def test_h3_staging_buffer_reused_while_the_copy_is_pending(order, expected):
    b = builder()
    b.host_write([CPU])                                  # 0: fill staging
    b.copy_batch("load", order, [(CPU, GPU)])            # 1
    b.host_write([CPU])                                  # 2: next iteration, CPU runs ahead
    assert races(b) == expected
    if expected:
        (r,) = run(b).races
        assert r.rule == "4" and r.fix.startswith("add `sync_stream('load')` before op 2")


@pytest.mark.parametrize("order", ORDERS)
def test_h3_fixed_by_waiting_for_the_copy_before_reuse(order):
    b = builder()
    b.host_write([CPU])
    b.copy_batch("load", order, [(CPU, GPU)])
    b.record("copied", "load")
    b.sync_event("copied")
    b.host_write([CPU])
    assert races(b) == {}


@pytest.mark.parametrize("order", ORDERS)
def test_h3_double_buffering_is_safe(order):
    b = builder()
    b.host_write([CPU])
    b.copy_batch("load", order, [(CPU, GPU)])
    b.record("slot0", "load")
    b.host_write([CPU2])                                 # the other slot meanwhile
    b.copy_batch("load", order, [(CPU2, GPU2)])
    b.sync_event("slot0")
    b.host_write([CPU])                                  # slot 0 again, after its copy
    assert races(b) == {}


# H4: the host consumes a D2H destination before the copy's completion is observed -----------------


@pytest.mark.parametrize("order", ORDERS)
def test_h4_non_blocking_copy_read_before_synchronizing(order):
    b = builder()
    b.kernel("offload", "produce", writes=[GPU])         # 0
    b.copy_batch("offload", order, [(GPU, CPU)])         # 1: stream order keeps it after op 0 ...
    b.host_read([CPU])                                   # 2
    expected = {(1, 2): "RAW"}
    if order != "STREAM":
        expected[(0, 1)] = "RAW"                         # ... except the source read out of order
    assert races(b) == expected


@pytest.mark.parametrize("order", ORDERS)
def test_h4_fixed_by_syncing_the_copy_event(order):
    b = builder()
    b.copy_batch("offload", order, [(GPU, CPU)])
    b.record("stored", "offload")
    b.sync_event("stored")
    b.host_read([CPU])
    assert races(b) == {}


def test_h4_syncing_an_event_recorded_before_the_copy_does_not_help():
    b = builder()
    b.record("stored", "offload")                        # 0: too early
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])      # 1
    b.sync_event("stored")                               # 2
    b.host_read([CPU])                                   # 3
    (r,) = run(b).races
    assert (r.first, r.second, r.kind, r.rule) == (1, 3, "RAW", "4")


# H5: a host block reloaded while its store is in flight, ordered only by a device event ----------


@pytest.mark.parametrize("order, expected", [
    ("STREAM", {}),
    ("DURING_API_CALL", {(0, 3): "RAW"}),
    ("ANY", {(0, 3): "RAW"}),
])
def test_h5_reload_ordered_by_a_device_event_only(order, expected):
    b = builder()
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])      # 0: store block
    b.record("stored", "offload")                        # 1
    b.wait_event("load", "stored")                       # 2: the device orders the reload ...
    b.copy_batch("load", order, [(CPU, GPU2)])           # 3: ... but not its source read
    assert races(b) == expected
    if expected:
        (r,) = run(b).races
        assert r.rule == "5"
        assert "op 2's wait on event 'stored'" in r.reason
        assert r.fix.startswith("use STREAM order for op 3")


@pytest.mark.parametrize("order", ORDERS)
def test_h5_fixed_by_observing_the_store_on_the_host(order):
    b = builder()
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])
    b.record("stored", "offload")
    b.query_event("stored", True)                        # the engine polls the store's event
    b.copy_batch("load", order, [(CPU, GPU2)])
    assert races(b) == {}


# H6: compute reads a loaded GPU block without waiting for the load's end event --------------------


@pytest.mark.parametrize("order", ORDERS)
def test_h6_compute_reads_a_loaded_block_without_waiting(order):
    b = builder()
    b.copy_batch("load", order, [(CPU, GPU)])            # 0
    b.record("loaded", "load")                           # 1
    b.kernel("compute", "attention", reads=[GPU])        # 2
    assert races(b) == {(0, 2): "RAW"}
    (r,) = run(b).races
    assert r.rule == "2" and r.fix == "add `compute.wait_stream(load)` before op 2"


@pytest.mark.parametrize("order", ORDERS)
def test_h6_waiting_before_the_record_does_not_help(order):
    b = builder()
    b.wait_event("compute", "loaded")                    # 0: never recorded yet
    b.copy_batch("load", order, [(CPU, GPU)])            # 1
    b.record("loaded", "load")                           # 2
    b.kernel("compute", "attention", reads=[GPU])        # 3
    assert races(b) == {(1, 3): "RAW"}


@pytest.mark.parametrize("order", ORDERS)
def test_h6_fixed_by_waiting_on_the_load_event(order):
    b = builder()
    b.copy_batch("load", order, [(CPU, GPU)])
    b.record("loaded", "load")
    b.wait_event("compute", "loaded")
    b.kernel("compute", "attention", reads=[GPU])
    assert races(b) == {}


# H7: copies inside one batch overlap -------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_h7_two_copies_of_one_batch_share_a_destination(order):
    b = builder()
    b.copy_batch("load", order, [(CPU, GPU), (CPU2, GPU)])   # a block listed twice
    assert races(b) == {(0, 0): "WAW"}


@pytest.mark.parametrize("order", ORDERS)
def test_h7_a_batch_that_moves_a_block_onto_its_neighbour(order):
    b = builder()
    # compaction in one batch: copy 0 writes the block that copy 1 moves away
    b.copy_batch("compute", order, [(GPU, GPU2), (GPU2, ("gpu_b", 0, 4096))])
    assert races(b) == {(0, 0): "RAW"}   # by copy index: copy 0's write, then copy 1's read


@pytest.mark.parametrize("order", ORDERS)
def test_h7_fixed_by_disjoint_copies(order):
    b = builder()
    b.copy_batch("load", order, [(CPU, GPU), (CPU2, GPU2)])
    assert races(b) == {}


@pytest.mark.parametrize("order", ORDERS)
def test_h7_fixed_by_splitting_the_batch(order):
    b = builder()
    b.copy_batch("compute", order, [(GPU2, ("gpu_b", 0, 4096))])
    b.copy_batch("compute", order, [(GPU, GPU2)])
    assert races(b) == {}   # the second batch writes in stream order, after the first one read
