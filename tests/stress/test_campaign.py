"""Campaign files: the shipped ones load; mistakes name the file, the key and what to write."""

from __future__ import annotations

import pytest

from kvverify.stress import campaign
from kvverify.stress.campaign import CampaignError, load, parse, parse_size


@pytest.mark.parametrize("name", ["smoke", "nightly", "soak"])
def test_shipped_campaigns_load(name):
    c = load(name)
    assert c.name == name and c.trials >= 3 and c.min_checked >= 2**30
    assert name in campaign.available()


def test_smoke_is_every_cell_with_llama_and_a_gib_per_cell():
    c = load("smoke")
    assert c.models == ("llama-3.1-8b",)
    assert set(c.orders) == {"STREAM", "DURING_API_CALL", "ANY"}
    assert set(c.host_memory) == {"pinned", "registered", "pageable"}
    assert set(c.executors) == {"native", "adversarial", "kernel"}
    assert c.scenarios == ("all",) and c.min_checked == 2**30


def test_nightly_runs_every_preset():
    from kvverify.geometry import PRESETS

    assert set(load("nightly").models) == set(PRESETS)


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('orders = ["ANY"]\ntrials = 5\nmin_checked = "64MiB"\n')
    c = load(str(path))
    assert (c.name, c.orders, c.trials, c.min_checked) == ("mine", ("ANY",), 5, 64 * 2**20)


def test_unknown_campaign_lists_the_available_ones():
    with pytest.raises(CampaignError, match=r"no campaign named 'nope'; available: .*smoke"):
        load("nope")


@pytest.mark.parametrize(
    "text, message",
    [
        ("trails = 3", r"unknown key 'trails'; known keys: .*trials"),
        ('trials = "3"', r"trials: expected int, got str"),
        ("trials = 0", r"trials: must be at least 1"),
        ('orders = ["ANY", "SOMETIMES"]', r"orders: unknown value 'SOMETIMES'; use STREAM, DURING_API_CALL, ANY"),
        ('host_memory = ["cached"]', r"host_memory: unknown value 'cached'"),
        ('gpu_mem = "lots"', r"gpu_mem: 'lots' is not a size"),
        ("transfers = 1", r"transfers: transfers in flight must lie in \[2, 32\]"),
        ('data = "zeros"', r"data: unknown value 'zeros'"),
        ("orders = []", r"orders: must name at least one"),
        ("orders = [1]", r"orders: expected a list of strings"),
        ("trials = 8\nmax_trials = 4", r"max_trials: 4 is less than trials"),
        ("trials = true", r"trials: expected int, got bool"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(CampaignError, match=message) as info:
        load(str(path))
    assert str(path) in str(info.value)


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("trials = = 3\n")
    with pytest.raises(CampaignError, match=r"broken.toml: not valid TOML"):
        load(str(path))


def test_command_line_overrides_are_validated():
    c = load("smoke")
    assert c.override(trials=7, orders=("ANY",), seed=None).trials == 7
    with pytest.raises(CampaignError, match=r"command line: transfers"):
        c.override(transfers=99)


@pytest.mark.parametrize("value, size", [("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20), (4096, 4096)])
def test_sizes_in_campaigns(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("value", [0, -1, "0", "8 GiBs", "lots"])
def test_bad_sizes_in_campaigns(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_parse_defaults_fit_a_24_gib_host():
    c = parse({}, "empty", "test")
    assert c.host_mem + 4 * 2**30 <= 24 * 2**30


def test_estimate_charges_native_copies_into_pageable_memory_per_page():
    """The plan line's model: a native D2H batch into pageable memory costs per page
    (planning.PAGEABLE_D2H_PAGE_S); the adversarial executor's landing does not."""
    from kvverify import geometry
    from kvverify.stress import planning

    c = load("smoke").override(scenarios=("P1",), orders=("STREAM",))
    layout = geometry.KVLayout(geometry.preset("llama-3.1-8b"), block_size=16)
    params, _ = planning.fit_params(c, layout)
    by_cell = {(pc.cell.host_memory, pc.cell.executor): pc for pc in planning.plan(c, layout, params)}

    def seconds(host, executor):
        return planning.estimate([by_cell[(host, executor)]], c, layout).seconds

    pc = by_cell[("pageable", "native")]
    pages = planning.program_blocks(pc.program)["copied_to_host"] * layout.num_tensors
    trials = planning.trials_for(c, planning.program_blocks(pc.program)["checked"] * layout.block_bytes, "native")
    assert pages > 0
    per_page = seconds("pageable", "native") - seconds("pageable", "adversarial")
    assert per_page == pytest.approx(trials * pages * (planning.PAGEABLE_D2H_PAGE_S - layout.page_bytes / planning.PAGEABLE_BPS))
    assert seconds("pinned", "native") < seconds("pageable", "adversarial") < seconds("pageable", "native")
