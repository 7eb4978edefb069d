"""Several ranks in one stress run, on CPU processes: torchrun starts two ranks (gloo), each runs
its share of the cells on the stand-in device (tests/fake_device.py), rank 0 gathers and writes
one report. Also the shares of --shard, the ranks from the environment and the --gpus launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvverify.geometry import KVLayout, preset
from kvverify.stress import distributed, planning
from kvverify.stress.campaign import load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")

# One rank: the stand-in device in place of a GPU, then the command as torchrun gives it.
DRIVER = """
import sys
import pytest
sys.path.insert(0, sys.argv[1])
import fake_device
from kvverify import cli
fake_device.install_for_stress(pytest.MonkeyPatch())
sys.exit(cli.main(["stress", *sys.argv[2:]]))
"""
CAMPAIGN = ('trials = 3\nmax_trials = 6\nmin_checked = "1GiB"\nblock_size = 4\nblocks_per_transfer = 2\n'
            'transfers = 2\nhost_memory = ["pageable"]\nscenarios = ["P2", "H7-broken", "H3-fixed"]\n'
            'writer_delay_us = 0\nreader_us = 0\n')
# A two-layer model: the stand-in device checks every page in numpy.
CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 32,
          "torch_dtype": "bfloat16"}


def _env(tmp: Path):
    """The ranks' environment; torchrun's own log folders go under ``tmp`` (it leaves them behind)."""
    return dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200", CUDA_VISIBLE_DEVICES="", TMPDIR=str(tmp))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same campaign, plain (one process) and under torchrun with two ranks, every cell on each
    or sharded; started at once. Each run's (exit status, report, stderr)."""
    tmp = tmp_path_factory.mktemp("ranks")
    (tmp / "driver.py").write_text(DRIVER)
    (tmp / "c.toml").write_text(CAMPAIGN)
    (tmp / "config.json").write_text(json.dumps(CONFIG))
    args = ["--campaign", str(tmp / "c.toml"), "--model-config", str(tmp / "config.json"), "--no-nvtx"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    started = {}
    for name, launcher, extra in (("plain", [], []), ("torchrun-2", torchrun, []),
                                  ("torchrun-2-shard", torchrun, ["--shard"])):
        report = tmp / f"{name}.json"
        started[name] = (report, subprocess.Popen(
            [sys.executable, *launcher, str(tmp / "driver.py"), TESTS, *args, *extra, "--json", str(report)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(tmp), cwd=tmp))
    out = {}
    for name, (report, p) in started.items():
        try:
            _, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
        out[name] = (p.returncode, json.loads(report.read_text()) if report.exists() else None, err)
    return out


def _verdicts(doc):
    return {c["label"]: c["verdict"] for c in doc["cells"]}


def test_two_ranks_run_every_cell_on_each_and_rank_0_writes_one_report(runs):
    from kvverify.stress.report import load_schema

    rc, doc, err = runs["torchrun-2"]
    assert rc == 0 and doc["exit_status"] == 0, err[-3000:]
    rc_plain, plain, err_plain = runs["plain"]
    assert rc_plain == 0, err_plain[-3000:]
    assert {"CONFIRMED_RACE", "NO_RACE_OBSERVED", "SAFE_CONFIRMED"} <= set(_verdicts(plain).values())
    assert [(g["rank"], g["platform"]["gpu"], g["not_run_reason"]) for g in doc["gpus"]] == \
        [(0, "stand-in", None), (1, "stand-in", None)]
    assert all(g["memory"]["samples"] > 0 for g in doc["gpus"])
    assert _verdicts(doc) == _verdicts(plain)
    by_label = {c["label"]: c for c in plain["cells"]}
    for c in doc["cells"]:
        assert [p["gpu"] for p in c["per_gpu"]] == [0, 1]
        assert [p["verdict"] for p in c["per_gpu"]] == [c["verdict"]] * 2
        assert c["observed"]["trials"] == 2 * by_label[c["label"]]["observed"]["trials"]
    assert doc["execution"]["trials_run"] == 2 * plain["execution"]["trials_run"]
    assert doc["headline"] == plain["headline"]
    assert "GPU 1: " in err and "cells in" in err  # each rank says when its share is done
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, load_schema())


def test_shard_gives_each_cell_to_one_rank(runs):
    rc, doc, err = runs["torchrun-2-shard"]
    assert rc == 0, err[-3000:]
    owners = {c["label"]: [p["gpu"] for p in c["per_gpu"]] for c in doc["cells"]}
    assert all(len(o) == 1 for o in owners.values())
    counts = [sum(o == [rank] for o in owners.values()) for rank in (0, 1)]
    assert min(counts) > 0 and sum(counts) == len(doc["cells"])
    assert _verdicts(doc) == _verdicts(runs["plain"][1])
    assert doc["execution"]["shard"] is True
    assert doc["execution"]["trials_run"] == runs["plain"][1]["execution"]["trials_run"]
    assert "split across 2 GPUs" in err


# The launcher's process as on a host with two GPUs; the ranks it starts see none (CUDA_VISIBLE_DEVICES="").
TWO_GPUS = """
import sys
import torch
from kvverify import cli, device
device.gpu_refusal = lambda: None
torch.cuda.device_count = lambda: 2
sys.exit(cli.main(["stress", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("gpus", ["2", "all"])
def test_gpus_flag_without_a_device_is_refused_in_one_line(tmp_path, gpus):
    """``--gpus 2`` on a host without a GPU once started torchrun, printed its banner and exited 0
    with every cell NOT_RUN on each rank: now nothing starts, as ``probe`` refuses."""
    p = subprocess.run([sys.executable, "-m", "kvverify", "stress", "--gpus", gpus, "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=120, check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (f"kvverify stress: cannot start: --gpus {gpus}: no CUDA device is visible "
                        "(torch.cuda.is_available() is False); run it on a GPU host, or check CUDA_VISIBLE_DEVICES "
                        "and the driver\n")
    assert not (tmp_path / "r.json").exists()


def test_gpus_flag_asking_for_more_gpus_than_the_host_shows_is_refused(tmp_path):
    (tmp_path / "two_gpus.py").write_text(TWO_GPUS)
    p = subprocess.run([sys.executable, str(tmp_path / "two_gpus.py"), "--gpus", "3"], capture_output=True, text=True,
                       env=_env(tmp_path), cwd=tmp_path, timeout=120, check=False)
    assert p.returncode == 2
    assert p.stderr == ("kvverify stress: cannot start: --gpus 3: this host shows 2 CUDA devices; ask for at most 2 "
                        "(or all), or check CUDA_VISIBLE_DEVICES\n")


def test_gpus_flag_starts_the_ranks_through_the_launcher(tmp_path):
    """--gpus 2 where the launcher sees two GPUs: two ranks start (here on no device: each says why
    it ran nothing), rank 0 reports both (contract verdicts only, exit 0)."""
    report = tmp_path / "r.json"
    (tmp_path / "two_gpus.py").write_text(TWO_GPUS)
    p = subprocess.run([sys.executable, str(tmp_path / "two_gpus.py"), "--gpus", "2", "--scenarios", "P2",
                        "--host-memory", "pinned", "--json", str(report)],
                       capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert [g["rank"] for g in doc["gpus"]] == [0, 1]
    assert all("no CUDA device" in g["not_run_reason"] for g in doc["gpus"])
    assert doc["not_run_reason"] and {c["verdict"] for c in doc["cells"]} == {"NOT_RUN"}


def test_gpus_flag_under_torchrun_cannot_start(tmp_path):
    env = _env(tmp_path) | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    p = subprocess.run([sys.executable, "-m", "kvverify", "stress", "--gpus", "2"], capture_output=True, text=True, check=False,
                       env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert "cannot start: --gpus starts its own ranks; under torchrun leave it out" in p.stderr


def test_gpus_flag_checks_the_report_paths_before_starting_ranks(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvverify", "stress", "--gpus", "2", "--json",
                        str(tmp_path / "no" / "such" / "r.json")], capture_output=True, text=True, check=False,
                       env=_env(tmp_path), cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and "cannot start: --json" in p.stderr
    assert "OMP_NUM_THREADS" not in p.stderr  # torch.distributed.run never started


def test_ranks_from_the_environment():
    assert distributed.from_env({}) is None
    r = distributed.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (r.rank, r.world, r.local_rank, r.leader) == (3, 8, 1, False)
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        distributed.from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"})
    with pytest.raises(ValueError, match="do not describe a rank"):
        distributed.from_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shares_cover_every_cell_once_with_about_equal_time(world):
    c = load("smoke")
    layout = KVLayout(preset("llama-3.1-8b"))
    params, _ = planning.fit_params(c, layout)
    planned = planning.plan(c, layout, params)
    shares = distributed.shard(planned, c, layout, world)
    assert len(shares) == world
    assert sorted(pc.cell for share in shares for pc in share) == sorted(pc.cell for pc in planned)
    for share in shares:  # plan order within a share
        assert [planned.index(pc) for pc in share] == sorted(planned.index(pc) for pc in share)
    seconds = [planning.estimate(share, c, layout).seconds for share in shares]
    longest_cell = max(planning.estimate([pc], c, layout).seconds for pc in planned)
    # Longest first to the least loaded: no share exceeds the mean by more than one cell.
    assert max(seconds) <= sum(seconds) / world + longest_cell
    assert distributed.shard(planned, c, layout, world) == shares  # the same on every rank


def test_merge_of_a_two_rank_report_counts_its_gpus_under_one_platform(runs, tmp_path):
    from kvverify.stress import merge

    docs = [runs["plain"][1], runs["torchrun-2"][1], runs["torchrun-2-shard"][1]]
    doc = merge.merge(docs, ["plain.json", "two.json", "shard.json"])
    assert doc["exit_status"] == 0 and doc["conflicts"] == []
    (platform,) = doc["platforms"]
    assert platform["gpu"] == "stand-in" and platform["gpus"] == 1 + 2 + 2 and platform["sources"] == [0, 1, 2]
    assert {c["label"]: c["verdicts"]["P1"] for c in doc["cells"]} == _verdicts(runs["plain"][1])
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, merge.load_schema())
