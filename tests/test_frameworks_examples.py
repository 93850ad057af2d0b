"""examples/openrlhf_style.py and examples/trl_style.py run end to end on two real gloo ranks: the
merged numbers equal numpy on the concatenated data of both ranks, the framework's own reduction
differs where the ranks' tokens differ."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from rlmetrics.sinks import read_jsonl  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ROW = re.compile(r"^  (\S+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)$", re.M)


def run(name: str, out: Path, steps: int = 2) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--steps", str(steps), "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def printed(stdout: str, what: str) -> float:
    return float(stdout.split(f"largest difference {what}")[1].split(":")[1].split()[0])


def rows(stdout: str) -> list[dict[str, tuple[float, float, float]]]:
    """Per step, {key: (framework, rlmetrics, numpy)} from the printed tables."""
    steps = []
    for block in ("\n" + stdout).split("\nstep ")[1:]:
        steps.append({k: (float(a), float(b), float(c)) for k, a, b, c in ROW.findall(block)})
    return steps


def token_mean(data, key: str) -> float:
    return float(np.mean(np.asarray(data[key], dtype=np.float64)))


@pytest.mark.torch
@pytest.mark.ray
@pytest.mark.slow
def test_openrlhf_style_example(tmp_path):
    """Two steps on two Ray rank actors in a gloo group. rlmetrics' merged step equals numpy on both
    ranks' tokens (printed, and recomputed here from the JSONL sink and the saved per-token data);
    OpenRLHF's token-weighted actor keys whose rank value is a local token mean (``ppo_kl``,
    ``ppo_clip_ratio``, ``response_length``) are exact too; its ``policy_loss`` (the globally scaled
    loss, token-weighted again) and the critic's plain-mean ``values`` are not."""
    pytest.importorskip("ray")
    stdout = run("openrlhf_style.py", tmp_path)
    assert printed(stdout, "rlmetrics vs numpy") < 1e-12
    assert printed(stdout, "openrlhf-style vs numpy") > 1e-3
    steps = rows(stdout)
    assert len(steps) == 2 and all(len(s) == 6 for s in steps)
    for s in steps:
        for k in ("ppo_kl", "ppo_clip_ratio", "response_length"):
            assert s[k][0] == pytest.approx(s[k][2], abs=2e-6)  # printed with 6 decimals
        assert max(abs(s[k][0] - s[k][2]) for k in ("policy_loss", "values", "critic_loss")) > 1e-4
    check_jsonl(tmp_path, [("policy_loss", "loss"), ("values", "values"), ("ppo_kl", "ppo_kl"),
                           ("response_length", "response_length")])  # fmt: skip


def check_jsonl(out, columns):
    """Steps 0 and 1 in the JSONL sink, each metric of ``columns`` (``(key, saved column)``) equal
    to the token mean of the example's saved per-token data of that step."""
    run_ = read_jsonl(out / "metrics.jsonl")
    assert run_.steps == [0, 1]
    for record in run_.records:
        data = np.load(out / f"batch-{record['step']}.npz")
        for key, column in columns:
            assert record["metrics"][key] == pytest.approx(token_mean(data, column), rel=1e-12, abs=1e-15)


@pytest.mark.torch
@pytest.mark.slow
def test_trl_style_example(tmp_path):
    """Two steps on two gloo processes. rlmetrics' merged step equals numpy on both processes'
    tokens (printed, and recomputed here from the JSONL sink and the saved per-token data); TRL's
    gathered lengths are exact, its mean of per-process or per-micro-batch means (``policy_loss``,
    ``good_token_rate`` from ``log_metric``) is not."""
    stdout = run("trl_style.py", tmp_path)
    assert printed(stdout, "rlmetrics vs numpy") < 1e-12
    assert printed(stdout, "trl-style vs numpy") > 1e-3
    steps = rows(stdout)
    assert len(steps) == 2 and all(len(s) == 4 for s in steps)
    for s in steps:
        k = "completions/mean_length"
        assert s[k][0] == pytest.approx(s[k][2], abs=2e-6)
        assert max(abs(s[k][0] - s[k][2]) for k in ("policy_loss", "good_token_rate")) > 1e-4
    check_jsonl(tmp_path, [("policy_loss", "loss"), ("entropy", "entropy"), ("good_token_rate", "good"),
                           ("completions/mean_length", "length")])  # fmt: skip
