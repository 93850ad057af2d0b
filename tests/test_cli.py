"""The command line, run as a user would."""

import subprocess
import sys

import numpy as np
import pytest

from rlmetrics.cli import main
from rlmetrics.cli.demo import run_local, simulate_batch


def test_demo_values_equal_numpy_on_all_ranks_data():
    steps, workers = 4, 3
    results = run_local(steps, workers, out=lambda line: None)
    assert [r.step for r in results] == list(range(steps))
    for res in results:
        batches = [simulate_batch(r, res.step, steps) for r in range(workers)]
        scores = np.concatenate([b["critic/score/mean"] for b in batches])
        assert res.meta["complete"]
        assert res["critic/score/mean"] == pytest.approx(scores.mean(), rel=1e-12)
        assert res["perf/total_num_tokens"] == sum(b["perf/total_num_tokens"] for b in batches)
        assert res["perf/delta_time/gen"] == pytest.approx(np.mean([b["timing_s/gen"] for b in batches]))


def test_demo_command_prints_one_line_per_step(capsys):
    assert main(["demo", "--steps", "3", "--workers", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["0", "1", "2"]
    assert all("critic/score/mean=" in line for line in lines)


def test_help_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "rlmetrics", "demo", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--workers" in out.stdout
