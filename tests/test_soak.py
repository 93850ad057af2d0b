"""A 200-step soak on real Ray (``benchmarks/soak.py --quick``): 16 ranks x 500 metrics.

The script's own checks must pass (aggregator RSS flat after warm-up, finalized steps freed, every
step complete and equal to numpy); its JSONL is then checked again here against numpy on the
regenerated data.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from rlmetrics.sinks import read_jsonl  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
STEPS, RANKS, METRICS, SEED = 200, 16, 500, 7


def test_soak_quick_memory_flat_every_step_logged_and_exact(tmp_path):
    args = ["--quick", "--ranks", RANKS, "--metrics", METRICS, "--seed", SEED, "--out", tmp_path]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("— MET") == 5 and "NOT MET" not in proc.stdout, proc.stdout

    run = read_jsonl(tmp_path / "soak.jsonl")
    assert run.steps == list(range(STEPS)) and run.truncated is None
    for step in (0, 99, 137, STEPS - 1):
        rec = run.records[step]
        assert rec.get("meta", {}).get("complete", True), rec.get("meta")  # meta: on partial steps only
        data = np.stack(
            [np.random.default_rng((SEED, r, step)).uniform(0.5, 1.5, size=METRICS) for r in range(RANKS)]
        )
        got = rec["metrics"]
        assert len(got) == METRICS
        for k in (0, 1, 2, 3, METRICS - 1):  # the names cycle through mean, max, min, total
            name = ("soak/m{}/mean", "soak/m{}/max", "soak/m{}/min", "soak/m{}/total")[k % 4].format(k // 4)
            want = (np.mean, np.max, np.min, np.sum)[k % 4](data[:, k])
            assert got[name] == pytest.approx(want, rel=1e-12), name
