"""Health rules on crafted series: each rule alerts exactly at the steps where its condition starts to
hold, computed by an independent reference (numpy, plain loops) on the same series; user rules,
options, the callback, and alerts written to the sinks by Tracking."""

from __future__ import annotations

import doctest
import io
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from rlmetrics import StepMeta, StepResult
from rlmetrics.health import (
    DEFAULT_RULES,
    Alert,
    ClipRatioSpike,
    EntropyCollapse,
    GradNorm,
    KLBlowup,
    Monitor,
    NonFinite,
    ResponseClipSpike,
    Silent,
    ZeroStdGroups,
    coverage_metrics,
    default_rules,
)
from rlmetrics.sinks import ConsoleSink, JsonlSink, Tracking, read_jsonl

NAN, INF = math.nan, math.inf


def alerts_of(rule, series):
    monitor = Monitor([rule])
    return [(a.step, a.metric) for step, metrics in series for a in monitor.observe(step, metrics)]


def starts(series, holds):
    """Reference edge detection: ``(step, metric)`` where ``holds(t)`` (the set of metrics whose
    condition holds at the t-th step) has a metric the previous step's set has not."""
    out, before = [], set()
    for t, (step, _) in enumerate(series):
        now = holds(t)
        out += [(step, m) for m in sorted(now - before)]
        before = now
    return sorted(out)


def check(rule, series, holds):
    got, want = sorted(alerts_of(rule, series)), starts(series, holds)
    assert got == want
    assert want and len(want) < len(series)  # the series exercises the rule both ways
    return got


def finite_history(series, name, t):
    """``(steps, values)`` of the finite values of ``name`` at steps before the t-th."""
    pts = [(s, m[name]) for s, m in series[:t] if name in m and math.isfinite(m[name])]
    return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)


# ------------------------------------------------------------------------------------- each rule
@pytest.mark.parametrize("seed", range(3))
def test_non_finite(seed):
    rng = np.random.default_rng(seed)
    series = []
    for step in range(80):
        m = {}
        for name in ("a", "b/c", "critic/score/mean"):
            if rng.random() < 0.1:
                continue  # absent this step
            m[name] = rng.choice([NAN, INF, -INF]) if rng.random() < 0.25 else float(rng.normal())
        series.append((step, m))

    def holds(t):
        return {n for n, v in series[t][1].items() if not np.isfinite(v)}

    check(NonFinite(), series, holds)
    only_a = check(NonFinite(patterns=["a"]), series, lambda t: holds(t) & {"a"})
    assert {m for _, m in only_a} == {"a"}


@pytest.mark.parametrize("seed", range(3))
def test_grad_norm_zero_or_not_finite(seed):
    rng = np.random.default_rng(seed)
    names = ("actor/grad_norm", "training/grad_norm/mean", "critic/grad_norm")
    series = [
        (
            step,
            {n: float(rng.choice([0.0, NAN, INF, rng.random() + 0.1, 2.0, 3.5])) for n in names}
            | {"lr": 0.0},
        )
        for step in range(60)
    ]

    def holds(t):
        return {n for n in names if series[t][1][n] == 0 or not np.isfinite(series[t][1][n])}

    check(GradNorm(), series, holds)  # "lr" is 0 at every step and never alerts


def test_zero_std_groups_threshold_and_configurable_name():
    rng = np.random.default_rng(7)
    series = [
        (s, {"critic/zero_var_groups/mean": float(rng.random()), "my/flat": float(rng.random())})
        for s in range(60)
    ]
    check(
        ZeroStdGroups(),
        series,
        lambda t: {n for n, v in series[t][1].items() if n.startswith("critic") and v > 0.5},
    )
    check(
        ZeroStdGroups(patterns=["my/flat"], threshold=0.8),
        series,
        lambda t: {"my/flat"} if series[t][1]["my/flat"] > 0.8 else set(),
    )


@pytest.mark.parametrize("seed", range(3))
def test_entropy_collapse_slope_over_window(seed):
    rng = np.random.default_rng(seed)
    series, value, step = [], 2.0, 0
    for i in range(120):
        step += int(rng.integers(1, 3))  # gaps: the slope is per training step
        phase = (i // 20 + seed) % 3  # flat, collapsing, recovering
        value *= {0: 1.0, 1: 0.85, 2: 1.12}[phase]
        noisy = value * (1 + 0.05 * rng.normal())
        series.append((step, {"actor/entropy": NAN if rng.random() < 0.05 else noisy, "other": -float(i)}))

    def holds(t):
        v = series[t][1]["actor/entropy"]
        xs, ys = finite_history(series, "actor/entropy", t + 1)
        if not np.isfinite(v) or len(ys) < 10:
            return set()
        slope = np.polyfit(xs[-10:], ys[-10:], 1)[0]
        return {"actor/entropy"} if slope < -0.05 * abs(ys[-10:].mean()) else set()

    check(EntropyCollapse(), series, holds)


def spike_holds(series, name, factor, floor, ceiling=None, window=10):
    def holds(t):
        v = series[t][1].get(name, NAN)
        if not np.isfinite(v):
            return set()
        _, prev = finite_history(series, name, t)
        prev = prev[-window:]
        hit = (ceiling is not None and v > ceiling) or (
            len(prev) >= 3 and v > floor and v > factor * prev.mean()
        )
        return {name} if hit else set()

    return holds


def spiky(rng, n, base, peak, nan=0.05):
    values = base * (1 + 0.3 * rng.random(n))
    hits = rng.random(n) < 0.12
    values[hits] = peak * (0.5 + rng.random(hits.sum()))
    values[rng.random(n) < nan] = NAN
    return values.tolist()


@pytest.mark.parametrize("seed", range(3))
def test_clip_ratio_spikes(seed):
    rng = np.random.default_rng(seed)
    pg, resp, prompt = spiky(rng, 80, 0.02, 0.2), spiky(rng, 80, 0.03, 0.4), spiky(rng, 80, 0.03, 0.9)
    series = [
        (
            s,
            {
                "actor/pg_clipfrac": pg[s],
                "response/clip_ratio/mean": resp[s],
                "prompt/clip_ratio/mean": prompt[s],
            },
        )
        for s in range(80)
    ]
    check(ClipRatioSpike(), series, spike_holds(series, "actor/pg_clipfrac", 3.0, 0.05))
    check(ResponseClipSpike(), series, spike_holds(series, "response/clip_ratio/mean", 3.0, 0.1))
    h = spike_holds(series, "actor/pg_clipfrac", 2.0, 0.0, window=4)
    check(ClipRatioSpike(factor=2.0, floor=0.0, window=4), series, h)


@pytest.mark.parametrize("seed", range(3))
def test_kl_blowup_ceiling_and_jump(seed):
    rng = np.random.default_rng(seed)
    kl = spiky(rng, 80, 0.005, 0.3)
    for i in rng.choice(80, 6, replace=False):
        kl[i] = 1.0 + 5 * rng.random()  # above the ceiling whatever the history
    series = [(s, {"actor/ppo_kl": kl[s], "actor/kl_coef": 5.0}) for s in range(80)]
    check(KLBlowup(), series, spike_holds(series, "actor/ppo_kl", 10.0, 0.01, ceiling=1.0))


@pytest.mark.parametrize("seed", range(3))
def test_silent_metric(seed):
    rng = np.random.default_rng(seed)
    names = ("a", "b/c", "val-core/x/acc/mean@4", "val/test_score/x")
    series, present = [], dict.fromkeys(names, True)
    for step in range(0, 200, 2):
        for n in names:
            if rng.random() < 0.08:
                present[n] = not present[n]
        series.append((step, {n: 1.0 for n in names if present[n]}))

    def holds(t):
        out = set()
        for n in ("a", "b/c"):
            seen = [i for i in range(t + 1) if n in series[i][1]]
            if seen and t - seen[-1] >= 5:
                out.add(n)
        return out

    check(Silent(), series, holds)


# ------------------------------------------------------------------------- monitor and user rules
def test_alert_repeats_only_after_the_condition_cleared():
    monitor = Monitor([GradNorm()])
    values = [1.0, 0.0, 0.0, NAN, 2.0, 0.0, 1.0, 1.0, INF]
    got = [(s, a.message) for s, v in enumerate(values) for a in monitor.observe(s, {"actor/grad_norm": v})]
    assert got == [(1, "actor/grad_norm is 0"), (5, "actor/grad_norm is 0"), (8, "actor/grad_norm is inf")]


def test_user_rules_levels_values_and_a_failing_rule(caplog):
    def low_score(step, metrics):
        if metrics.get("critic/score/mean", 1.0) < 0.1:
            return "mean score below 0.1"

    class Ratio:
        name, level = "ratio", "error"

        def __call__(self, step, metrics):
            return {n: f"{n} above 2" for n, v in metrics.items() if v > 2}

    def broken(step, metrics):
        raise KeyError("boom")

    monitor = Monitor([low_score, broken, Ratio()])
    series = [
        {"critic/score/mean": 0.5, "x": 1.0},
        {"critic/score/mean": 0.05, "x": 3.0},
        {"critic/score/mean": 0.05},
    ]
    with caplog.at_level(logging.ERROR, logger="rlmetrics.health"):
        got = [monitor.observe(s, m) for s, m in enumerate(series)]
    assert got[0] == [] and got[2] == []
    assert got[1] == [
        Alert("low_score", 1, "mean score below 0.1", "warning", None, None),
        Alert("ratio", 1, "x above 2", "error", "x", 3.0),
    ]
    assert (
        list(monitor.disabled) == ["broken"]
        and len([r for r in caplog.records if "broken" in r.getMessage()]) == 1
    )
    odd = Monitor([lambda s, m: 3])
    assert odd.observe(0, {}) == [] and "returns None, a message" in str(odd.disabled["<lambda>"])


def test_default_rules_options():
    assert list(DEFAULT_RULES) == [r.name for r in default_rules()] == [r.name for r in Monitor().rules]
    rules = default_rules(kl_blowup={"ceiling": 5.0}, silent=None)
    assert "silent" not in [r.name for r in rules]
    (kl,) = [r for r in rules if r.name == "kl_blowup"]
    assert kl.ceiling == 5.0 and kl.factor == 10.0 and KLBlowup().ceiling == 1.0
    with pytest.raises(ValueError, match="unknown rule"):
        default_rules(klblowup={})
    with pytest.raises(TypeError, match="no option 'treshold'"):
        ZeroStdGroups(treshold=0.3)


def test_coverage_metrics():
    assert coverage_metrics(StepMeta(complete=False, contributions=[5, 8], late=3)) == {
        "meta/coverage": 0.625,
        "meta/late": 3.0,
    }
    assert coverage_metrics(StepMeta(complete=False, missing_ranks=["r1"])) == {"meta/late": 0.0}
    assert coverage_metrics(StepMeta(contributions=[0, 0])) == {"meta/coverage": 1.0, "meta/late": 0.0}


# ---------------------------------------------------------------------------------------- Tracking
def test_tracking_writes_alerts_to_every_sink_then_calls_back(tmp_path):
    seen = []

    class Stop(Exception):
        pass

    def on_alert(alert):
        seen.append((alert.step, alert.rule, read_jsonl(tmp_path / "m.jsonl").events[-1]["event"]["rule"]))
        if alert.level == "error":
            raise Stop(str(alert))

    out = io.StringIO()
    sinks = [JsonlSink(tmp_path / "m.jsonl"), ConsoleSink(file=out, every=100)]
    tracking = Tracking(sinks, health=Monitor(on_alert=on_alert))
    tracking.log({"actor/grad_norm": 1.0, "actor/pg_clipfrac": 0.01}, 0)
    for s in (1, 2, 3):
        tracking.log({"actor/grad_norm": 1.0, "actor/pg_clipfrac": 0.01}, s)
    tracking.log({"actor/grad_norm": 1.0, "actor/pg_clipfrac": 0.5}, 4)  # a warning: the run goes on
    with pytest.raises(Stop, match="step 5 error grad_norm: actor/grad_norm is 0"):
        tracking.log({"actor/grad_norm": 0.0, "actor/pg_clipfrac": 0.01}, 5)
    tracking.close()
    run = read_jsonl(tmp_path / "m.jsonl")
    assert run.steps == [0, 1, 2, 3, 4, 5]  # the step is logged before its alerts
    events = [(e["step"], e["event"]["rule"], e["event"]["level"], e["event"]["metric"]) for e in run.events]
    assert events == [
        (4, "clip_ratio_spike", "warning", "actor/pg_clipfrac"),
        (5, "grad_norm", "error", "actor/grad_norm"),
    ]
    assert (
        run.events[1]["event"]["value"] == 0.0 and run.events[1]["event"]["message"] == "actor/grad_norm is 0"
    )
    assert seen == [(4, "clip_ratio_spike", "clip_ratio_spike"), (5, "grad_norm", "grad_norm")]
    lines = out.getvalue().splitlines()
    assert (
        "step 4 warning clip_ratio_spike: actor/pg_clipfrac = 0.5 is above 3x its recent mean 0.01" in lines
    )
    assert "step 5 error grad_norm: actor/grad_norm is 0" in lines


def test_tracking_adds_coverage_and_late_to_step_results(tmp_path):
    with Tracking([JsonlSink(tmp_path / "m.jsonl")], health=None) as tracking:
        meta = StepMeta(complete=False, missing_ranks=["r1"], contributions=[3, 4], late=1)
        tracking.log(StepResult({"a": 1.0}, 0, meta), 0)
        tracking.log({"a": 2.0}, 1)  # a plain dict: nothing added
    run = read_jsonl(tmp_path / "m.jsonl")
    assert [r["metrics"] for r in run.records] == [
        {"a": 1.0, "meta/coverage": 0.75, "meta/late": 1.0},
        {"a": 2.0},
    ]
    assert run.records[0]["meta"]["missing_ranks"] == ["r1"]  # the partial step still says what it lacks


@pytest.mark.slow
def test_docs_examples_print_what_they_show():
    docs = Path(__file__).resolve().parents[1] / "docs" / "health.md"
    assert doctest.testfile(str(docs), module_relative=False).failed == 0
