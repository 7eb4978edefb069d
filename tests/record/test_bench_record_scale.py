"""``benchmarks/bench_record_scale.py``'s reading of a run (which needs a GPU): the figures a run's
child writes down, and the per-decile medians that show a cost growing over the run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_record_scale  # noqa: E402


def test_a_cost_that_grows_late_in_the_run_shows_in_its_last_deciles():
    times = [1000] * 900 + [3000] * 100  # ns: the last tenth three times slower
    medians = bench_record_scale.deciles(times)
    assert medians[:9] == [1.0] * 9 and medians[9] == 3.0


def test_a_run_shorter_than_ten_steps_still_has_ten_deciles():
    assert len(bench_record_scale.deciles([2000, 4000, 6000])) == 10


def test_a_runs_file_gives_its_steps_and_the_loops_end(tmp_path):
    path = tmp_path / "run.times"
    path.write_text("1500\n2500\n3500\nend 1764937200.25\n")
    assert bench_record_scale.read_run(path) == ([1500, 2500, 3500], 1764937200.25)
