"""Soaks on real Ray (``benchmarks/soak.py``): memory flat after warm-up, every step read logged.

Three patterns: the steady run (16 ranks x 500 metrics, 120 steps); 1,200 steps whose 200 names
change every step (the aggregator and the clients must forget what no step uses any more); and a
driver that reads only every 10th step (the other steps must be finalized all the same).

The new-names run's size: its warm-up (600 steps) is past a client's first schema-cache reset (at
512 schemas, one a step here) and past the aggregator's ``forget_after`` (128 steps), so its memory is
at its high-water mark when the RSS is sampled; the 600 steps after it hold another cache reset, and
a client that never reset its cache would hold 600 to 1,200 schemas at the probes (limit 520), an
aggregator that never forgot names 120,000 to 240,000 (limit 26,410). 2,000 steps (1,000 warm-up)
proved no more and took 25 s longer. The
script's own checks must pass (RSS of the aggregator and of the rank hosts, the engine's and the
clients' counters, every step complete and equal to numpy); its JSONL is then checked again here
against numpy on the regenerated data.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from rlmetrics.sinks import read_jsonl  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
SEED = 7
PATTERNS = {  # name: (steps, ranks, metrics, new names per step, read every, warm-up)
    "steady": (120, 16, 500, 0, 1, 60),
    "new-names": (1200, 2, 10, 200, 1, 600),
    "sparse-reads": (200, 4, 50, 0, 10, 100),
}


@pytest.mark.timeout(960)  # a hang guard: on a 2-core machine under load, one soak took over 280 s
@pytest.mark.parametrize("pattern", PATTERNS)
def test_soak_memory_flat_every_step_read_logged_and_exact(tmp_path, pattern):
    steps, ranks, metrics, new, every, warmup = PATTERNS[pattern]
    args = ["--steps", steps, "--ranks", ranks, "--metrics", metrics, "--new-names", new]
    args += ["--read-every", every, "--warmup", warmup, "--seed", SEED, "--out", tmp_path]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("— MET") == 6 and "NOT MET" not in proc.stdout, proc.stdout

    run = read_jsonl(tmp_path / "soak.jsonl")
    assert run.steps == list(range(0, steps, every)) and run.truncated is None
    for step in run.steps[:: max(1, len(run.steps) // 4)]:
        rec = run.records[run.steps.index(step)]
        assert rec.get("meta", {}).get("complete", True), rec.get("meta")  # meta: on partial steps only
        data = np.stack(
            [
                np.random.default_rng((SEED, r, step)).uniform(0.5, 1.5, size=metrics + new)
                for r in range(ranks)
            ]
        )
        got = rec["metrics"]
        assert len(got) == metrics + new
        for k in (0, 1, 2, 3, metrics + new - 1):  # the names cycle through mean, max, min, total
            kind = k % 4 if k < metrics else (k - metrics) % 4
            base = ("soak/m{}/mean", "soak/m{}/max", "soak/m{}/min", "soak/m{}/total")[kind]
            name = base.format(k // 4) if k < metrics else f"soak/s{step}/" + base.format((k - metrics) // 4)
            want = (np.mean, np.max, np.min, np.sum)[kind](data[:, k])
            assert got[name] == pytest.approx(want, rel=1e-12), name
