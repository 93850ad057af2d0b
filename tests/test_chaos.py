"""Chaos on real Ray: ranks and the aggregator killed at seeded moments of a 50-step run.

Runs ``benchmarks/chaos.py`` (its own checks must pass), then checks its JSONL again here against
numpy on the regenerated data. Seed 3 kills rank 1 20+ ms into step 2 and rank 4 after step 40
(each leaves the next step partial, at the reader's deadline), and the aggregator four times: 32 ms
into step 11, before step 16, under the waiting ``result`` of step 27, and after the ranks of step
42 delivered. The run is almost all waiting on deadlines (8 s of CPU in a 70 s run with the script's
defaults): so the reader's deadline is 8 s (default 15) and a restarted aggregator's wait for the
ranks' resends 5 s (default 10) — a dead rank's step still ends at the deadline, a live rank still
has seconds to spare, and the reader's deadline stays above the recovery wait (a read during a
recovery is not answered before it ends).
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from rlmetrics.messages import StepMeta
from rlmetrics.sinks import read_jsonl  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"
SEED, STEPS, RANKS = 3, 50, 5
RESULT_TIMEOUT, RECOVERY_TIMEOUT = 8, 5  # seconds; the script's defaults: 15 and 10 (see above)


def data(rank, step):
    """The chaos script's data of ``rank`` at ``step``, regenerated."""
    return np.random.default_rng((SEED, rank, step)).uniform(-1.0, 1.0, size=2 + rank + step % 3) + step


def ranks_of(client_ids):
    return {int(re.match(r"rank(\d+)@", c).group(1)) for c in client_ids}


def test_chaos_every_step_logged_exact_or_partial_naming_only_dead_ranks(tmp_path):
    args = ["--seed", SEED, "--steps", STEPS, "--ranks", RANKS, "--rank-kills", 2, "--aggregator-kills", 4]
    args += ["--result-timeout", RESULT_TIMEOUT, "--recovery-timeout", RECOVERY_TIMEOUT, "--out", tmp_path]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "chaos.json").read_text())
    assert (info["result_timeout"], info["recovery_timeout"]) == (RESULT_TIMEOUT, RECOVERY_TIMEOUT)
    kills = info["kills"]
    assert {k["phase"] for k in kills if k["target"] == "aggregator"} == {"before", "during", "after", "read"}
    assert info["aggregator_restarts"] >= 1 and not info["errors"]
    killed_at = {int(k["target"][4:]): (k["step"], k["phase"]) for k in kills if k["target"] != "aggregator"}
    assert len(killed_at) == 2

    run = read_jsonl(tmp_path / "chaos.jsonl")
    assert run.steps == list(range(STEPS)) and run.truncated is None
    partial = []
    for rec in run.records:
        s, got = rec["step"], rec["metrics"]
        gone = {r for r, (k, ph) in killed_at.items() if k < s or (k == s and ph == "before")}
        dying = {r for r, (k, _) in killed_at.items() if k == s} - gone
        started = set(range(RANKS)) - gone
        meta = StepMeta.from_dict(rec.get("meta", {}))
        # The sink writes meta for partial steps only: a complete step had every rank that started it.
        contributors = ranks_of(meta.contributors) if "meta" in rec else started
        missing = ranks_of(meta.missing_ranks)
        assert started - dying <= contributors <= started, (s, meta)
        assert missing <= gone | dying and not missing & contributors, (s, meta)
        assert meta.complete == (not missing and not meta.missing_metrics), (s, meta)
        if not meta.complete:
            partial.append(s)
        for received, _ in meta.missing_metrics.values():
            assert received == len(contributors), (s, meta)  # each contributor counted once
        allv = np.concatenate([data(r, s) for r in sorted(contributors)])
        assert got["ranks/total"] == len(contributors)
        assert got["x/mean"] == pytest.approx(allv.mean(), rel=1e-9)
        assert got["x/std"] == pytest.approx(allv.std(), rel=1e-9)
        assert got["x/total"] == pytest.approx(allv.sum(), rel=1e-9)
        assert (got["x/min"], got["x/max"]) == (allv.min(), allv.max())
    # Each dead rank leaves exactly one partial step behind (at the deadline it stops being waited for),
    # unless an aggregator restart brought it back from the saved state; later steps complete again.
    assert 2 <= len(partial) <= 4, partial
    assert not set(partial) & set(range(STEPS - 3, STEPS)), partial


def test_a_result_finalized_just_before_a_restart_is_not_lost(ray_session):
    """A ``result()`` call finalizes a step, the aggregator dies before the reply reaches the caller,
    and the caller retries on the next incarnation (as ``ClientCore`` does). The step is recorded as
    finalized for the next incarnation, which drops the ranks' resent data of it as late; the retried
    call must still get the step's values, not an empty "evicted" result. The lost reply is played
    deterministically: the first call goes straight to the actor and its answer is dropped."""
    import ray

    import rlmetrics

    root = rlmetrics.get_metric_worker(name="finalized-then-killed", recovery_timeout=10)
    ranks = [rlmetrics.connect("ray", name="finalized-then-killed", world_size=2) for _ in range(2)]
    reader = rlmetrics.connect("ray", name="finalized-then-killed")
    for step in range(2):
        for r, client in enumerate(ranks):
            client.submit_metric({"x/total": float(r + 1), "x/max": float(step)})
            client.wait_submit()
            client.flush()
        want = {"x/total": 3.0, "x/max": float(step)}
        assert dict(ray.get(root.result.remote(step, 30))) == want  # this reply is "lost"
        time.sleep(1.0)  # the incarnation's state (the step is finalized) reaches Ray's KV store
        ray.kill(root, no_restart=False)
        res = reader.result(step, timeout=60, finalize=True)
        assert dict(res) == want and res.meta.complete, res.meta
