"""A local-backend run that diverges (a rank's grad norm turns NaN, the clip fraction jumps, a rank
stops submitting): the health alerts land in every tracker's files, read back with the trackers' own
readers (tests/trackers.py), at the steps the injected faults dictate, and nowhere else."""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import pytest

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.health import Monitor, default_rules
from rlmetrics.sinks import make_sinks, read_jsonl
from tests.trackers import mlflow_history, swanlab_texts, tensorboard_texts, wandb_alerts, wandb_rows

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("swanlab")
pytest.importorskip("tensorboard")

STEPS, NAN_STEP, SPIKE_STEP, SILENT_RANK_STEP = 12, 6, 8, 10

pytestmark = pytest.mark.slow


def partial_step(step, metrics):
    """A user rule: some contributions of the step did not arrive."""
    if metrics.get("meta/coverage", 1.0) < 1.0:
        return f"only {metrics['meta/coverage']:.0%} of the contributions arrived"


EXPECTED = {  # (step, rule, metric) that the injected faults must raise, and nothing else
    (NAN_STEP, "non_finite", "actor/grad_norm"),
    (NAN_STEP, "grad_norm", "actor/grad_norm"),
    (SPIKE_STEP, "clip_ratio_spike", "actor/pg_clipfrac"),
    (SILENT_RANK_STEP, "partial_step", None),
}


def run_diverging(out, name="health-run"):
    rng = np.random.default_rng(0)
    ranks = [rlmetrics.connect("local", world_size=2, name=name) for _ in range(2)]
    reader = rlmetrics.connect("local", name=name)
    monitor = Monitor([*default_rules(), partial_step])
    try:
        with make_sinks(
            ["jsonl", "tensorboard", "wandb", "mlflow", "swanlab"], out, health=monitor
        ) as tracking:
            for step in range(STEPS):
                for r, client in enumerate(ranks):
                    if step == SILENT_RANK_STEP and r == 1:
                        continue
                    grad = rng.uniform(0.5, 1.5, size=4)
                    if step == NAN_STEP and r == 1:
                        grad[2] = math.nan
                    clip = 0.3 if step == SPIKE_STEP else rng.uniform(0.01, 0.02)
                    metrics = {
                        "actor/grad_norm": grad,
                        "actor/pg_clipfrac": clip,
                        "critic/score/mean": rng.random(),
                    }
                    client.submit_metric(metrics, step=step)
                    client.wait_submit(step=step)
                timeout = 0.3 if step == SILENT_RANK_STEP else 10
                with pytest.warns(RuntimeWarning) if step in (NAN_STEP, SILENT_RANK_STEP) else nullcontext():
                    result = reader.result(step, timeout=timeout, finalize=True)
                tracking.log(result, step)
            assert not tracking.failed
            return tracking.sinks[3].run_id
    finally:
        local.drop_worker(name)


def test_alerts_of_a_diverging_run_land_in_every_tracker(tmp_path):
    out = tmp_path / "run"
    mlflow_run = run_diverging(out)
    rules = {rule for _, rule, _ in EXPECTED}

    run = read_jsonl(out / "metrics.jsonl")
    assert {(e["step"], e["event"]["rule"], e["event"]["metric"]) for e in run.events} == EXPECTED
    assert len(run.events) == len(EXPECTED)
    assert run.series("meta/coverage")[1].tolist() == [1.0] * SILENT_RANK_STEP + [0.5, 1.0]

    tb = tensorboard_texts(out / "tensorboard")
    assert {(s, tag.removeprefix("alert/")) for tag, items in tb.items() for s, _ in items} == {
        (s, r) for s, r, _ in EXPECTED
    }
    assert "actor/grad_norm is nan" in dict(tb["alert/grad_norm"])[NAN_STEP]

    wandb_files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    alerts = wandb_alerts(wandb_files)
    assert sorted(title for title, _, _ in alerts) == sorted(f"{r}: {m}" if m else r for _, r, m in EXPECTED)
    assert {(title, level) for title, _, level in alerts} >= {("grad_norm: actor/grad_norm", "ERROR")}
    rows = wandb_rows(wandb_files)
    assert {(s, k.removeprefix("alert/")) for s, row in rows for k in row if k.startswith("alert/")} == {
        (s, r) for s, r, _ in EXPECTED
    }

    uri = f"sqlite:///{out / 'mlflow.db'}"
    for rule in rules:
        steps = [s for s, r, _ in EXPECTED if r == rule]
        assert mlflow_history(uri, mlflow_run, f"alert/{rule}") == [(s, 1.0) for s in steps]

    texts = swanlab_texts(sorted(out.glob("swanlab/run-*/run-*.swanlab")))
    assert {(s, key.removeprefix("alert/")) for key, items in texts.items() for s, _ in items} == {
        (s, r) for s, r, _ in EXPECTED
    }
    assert "only 50% of the contributions arrived" in dict(texts["alert/partial_step"])[SILENT_RANK_STEP]
