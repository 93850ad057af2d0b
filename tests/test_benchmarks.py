"""Benchmarks stay runnable: each runs in its quick mode, including its own equality checks."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.ray]

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("bench_*.py"))


@pytest.mark.timeout(960)  # a hang guard: bench_users --quick took over 300 s on a loaded 2-core machine
@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_benchmark_quick_mode_runs(script):
    out = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "|" in out.stdout  # printed a table
