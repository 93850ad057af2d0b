"""examples/verl_style.py runs end to end: Ray rank actors, a real PPO update, merged steps in the sinks."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from rlmetrics.sinks import read_jsonl  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.ray, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verl_style.py"


def test_verl_style_example(tmp_path):
    """Two steps on two Ray rank actors: every step in the JSONL sink under verl's names
    (``timing_s/*`` kept), update metrics merged, validation keys on the last step, and the merged
    batch, timing and throughput metrics equal to the same functions on the full batch (the example
    prints the largest difference)."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    worst = float(out.stdout.split("largest relative difference ")[1].split()[0])
    assert worst < 1e-12  # the ranks' merged batch, timing and throughput metrics are the full batch's
    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.steps == [1, 2]  # verl's global_steps, from 1
    last = run.records[-1]["metrics"]
    names = (
        *("critic/score/mean", "response_length_non_aborted/mean", "timing_s/gen", "timing_per_token_ms/gen"),
        *("perf/throughput", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"),
    )
    assert not [name for name in names if name not in last]
    assert any(k.startswith("val-core/") for k in last) and not any(
        k.startswith("perf/delta_time") for k in last
    )
