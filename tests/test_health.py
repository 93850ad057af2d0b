"""Health rules on crafted series: each rule alerts exactly at the steps where its condition starts to
hold, computed by an independent reference (numpy, plain loops) on the same series; user rules,
options, the callback, and alerts written to the sinks by Tracking."""

from __future__ import annotations

import doctest
import fnmatch
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
    WindowRule,
    ZeroStdGroups,
    coverage_metrics,
    default_rules,
)
from rlmetrics.sinks import ConsoleSink, JsonlSink, Tracking, make_sinks, read_jsonl

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


SILENT_OPTIONS = [
    {},  # the defaults: steps 5, regular 5, val/*, group/*, correct/wrong lengths ignored
    {"steps": 3, "regular": 2, "ignore": ["val*"]},
    {"regular": 1, "ignore": []},  # every name once logged, as a name opted in
]


@pytest.mark.parametrize("options", SILENT_OPTIONS)
@pytest.mark.parametrize("seed", range(3))
def test_silent_metric(seed, options):
    rng = np.random.default_rng(seed)
    names = (
        "a", "b/c", "val-core/x/acc/mean@4", "val/test_score/x", "group/task/1/score/mean",
        "response/correct_length/mean",
    )  # fmt: skip
    series, present = [], dict.fromkeys(names, True)
    for step in range(0, 400, 2):
        for n in names:
            if rng.random() < 0.1:
                present[n] = not present[n]
        series.append((step, {n: 1.0 for n in names if present[n]}))
    rule = Silent(**options)
    watched = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in rule.ignore)]

    def holds(t):
        """Names last logged ``steps`` logged steps before the t-th, after ``regular`` in a row."""
        start = t - rule.steps - rule.regular + 1
        if start < 0:
            return set()
        logged = [series[i][1] for i in range(start, t + 1)]
        return {
            n for n in watched
            if all(n in m for m in logged[: rule.regular]) and not any(n in m for m in logged[rule.regular :])
        }  # fmt: skip

    got = check(rule, series, holds)
    assert {m for _, m in got} == set(watched)


def test_silent_state_holds_only_recent_names_whatever_the_churn():
    """Names live a few steps each (a new batch of names every step, as per-prompt or per-task
    names): each one logged on ``regular`` steps or more alerts once, ``steps`` after it is gone;
    the rule holds the names of its last ``steps`` logged steps at most."""
    rule = Silent()
    monitor = Monitor([rule])
    lives = [1, 2, 4, 5, 9]  # logged steps of the names born at a step, by their index in it
    got, held, logged = [], [], []
    for step in range(300):
        metrics = {f"task/{born}/{i}/score": 1.0 for born in range(step - 8, step + 1)
                   for i, life in enumerate(lives) if born >= 0 and step - born < life}  # fmt: skip
        got += [(a.step, a.metric) for a in monitor.observe(step, metrics)]
        logged.append(set(metrics))
        held.append((len(rule._last), len(set().union(*logged[-rule.steps :]))))
    want = [
        (born + life - 1 + rule.steps, f"task/{born}/{i}/score")
        for born in range(300)
        for i, life in enumerate(lives)
        if life >= rule.regular and born + life - 1 + rule.steps < 300
    ]
    assert sorted(got) == sorted(want)
    assert len(rule._steps) <= rule.steps and rule._start.keys() == rule._last.keys()
    assert all(n <= bound for n, bound in held)  # the names of its last ``steps`` logged steps at most
    assert max(held[100:]) == max(held[:100])  # flat after warm-up


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


# ------------------------------------------------------------- names that churn or come and go
STEADY = {  # names of every step, with values no rule objects to
    "actor/entropy": 1.0, "actor/pg_clipfrac": 0.02, "actor/ppo_kl": 0.001, "actor/grad_norm": 1.0,
    "critic/score/mean": 0.5, "response/clip_ratio/mean": 0.05, "critic/zero_var_groups/mean": 0.1,
}  # fmt: skip
GROUPED = ("critic/score/mean", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "response/length/max")


def churned_step(step: int, tasks: int = 40) -> dict[str, float]:
    """STEADY and 200 names never seen before: the breakdowns of ``tasks`` new tasks."""
    grouped = {f"group/task/{step * tasks + i}/{n}": 0.5 + i / 100 for i in range(tasks) for n in GROUPED}
    return STEADY | grouped


def rule_state(monitor: Monitor) -> dict[str, int]:
    """How much the default rules hold: Silent's names, the longest window rule's histories, the
    conditions the Monitor remembers."""
    (silent,) = [r for r in monitor.rules if isinstance(r, Silent)]
    return {
        "silent names": len(silent._last),
        "histories": max(len(r._history) for r in monitor.rules if isinstance(r, WindowRule)),
        "holding": sum(map(len, monitor._holding.values())),
    }


def log_through_jsonl(out: Path, steps: list[tuple[int, dict[str, float]]]):
    """``steps`` logged through ``make_sinks(["jsonl"], out)`` (the default health rules): the run
    read back, and the Monitor."""
    with make_sinks(["jsonl"], out) as tracking:
        for step, metrics in steps:
            tracking.log(metrics, step)
    return read_jsonl(out / "metrics.jsonl"), tracking.health


def test_200_new_group_names_per_step_raise_no_alert_and_the_rules_stay_bounded(tmp_path):
    sizes = []
    with make_sinks(["jsonl"], tmp_path) as tracking:
        for step in range(1000):
            tracking.log(churned_step(step), step)
            if step % 50 == 49:
                sizes.append(rule_state(tracking.health))
    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.events == []
    assert run.steps == list(range(1000))
    assert [r["metrics"] for r in run.records[::97]] == [churned_step(s) for s in range(0, 1000, 97)]
    # the bounds of docs/health.md: Silent holds the watched names of its last ``steps`` steps (here
    # the steady ones: group names are not watched), a window rule ``max_names`` histories, the
    # Monitor the conditions of the previous step (none), a rule's name matching its answers for
    # at most twice the step's names plus 1024
    assert max(s["silent names"] for s in sizes) <= len(STEADY)
    (silent,) = [r for r in tracking.health.rules if isinstance(r, Silent)]
    assert len(silent._steps) <= silent.steps
    step_names = len(churned_step(0))
    assert all(len(r.matches._known) <= 2 * step_names + 1024 for r in tracking.health.rules)
    assert max(s["histories"] for s in sizes) <= WindowRule.max_names
    assert max(s["holding"] for s in sizes) == 0
    assert sizes[-1] == sizes[0]  # nothing grows after warm-up
    for rule in tracking.health.rules:  # the steady names keep their history among the churn
        if isinstance(rule, WindowRule):
            kept = [n for n in STEADY if rule.matches(n)]
            assert kept and all(len(rule._history[n]) == rule.window for n in kept), rule


def test_a_source_sampled_every_10th_step_is_not_silent(tmp_path):
    sampled = {"data/aime/acc": 0.3, "group/data_source/aime/critic/score/mean": 0.3}
    steps = [(s, STEADY | (sampled if s % 10 == 0 else {})) for s in range(60)]
    run, _ = log_through_jsonl(tmp_path, steps)
    assert run.steps == list(range(60))
    assert run.events == []


def test_a_metric_logged_every_step_then_gone_alerts_once_and_is_forgotten(tmp_path):
    gone, source_gone = 20, 30  # the first steps without actor/pg_loss, and without the gsm8k source
    steps = []
    for s in range(60):
        m = dict(STEADY)
        if s < gone:
            m["actor/pg_loss"] = 0.1
        if s < source_gone:  # a data source that leaves the mix: normal
            m["group/data_source/gsm8k/critic/score/mean"] = 0.4
        steps.append((s, m))
    run, monitor = log_through_jsonl(tmp_path, steps)
    events = [(e["step"], e["event"]["rule"], e["event"]["metric"]) for e in run.events]
    assert events == [(gone - 1 + Silent.steps, "silent", "actor/pg_loss")]
    assert f"since step {gone - 1} " in run.events[0]["event"]["message"]
    (silent,) = [r for r in monitor.rules if isinstance(r, Silent)]
    assert "actor/pg_loss" not in silent._last and rule_state(monitor)["holding"] == 0  # forgotten


@pytest.mark.torch
def test_correct_and_wrong_lengths_on_some_steps_only_raise_no_alert(tmp_path):
    """Real data metrics of batches whose responses are sometimes all wrong or all correct:
    ``response/correct_length/*`` or ``response/wrong_length/*`` is absent for 8 steps in a row."""
    from rlmetrics.metrics.data import compute_data_metric

    rng = np.random.default_rng(3)
    steps = []
    for s in range(80):
        share = (0.5, 0.0, 0.5, 1.0)[(s // 8) % 4]  # of correct responses, in phases of 8 steps
        rewards = np.zeros((8, 4))
        rewards[:, -1] = rng.random(8) < share
        batch = {"responses": np.zeros((8, 4)), "attention_mask": np.ones((8, 6), np.int64)}
        steps.append((s, compute_data_metric(batch | {"token_level_rewards": rewards})))
    present = {("response/correct_length/mean" in m, "response/wrong_length/mean" in m) for _, m in steps}
    assert present == {(True, True), (False, True), (True, False)}
    run, _ = log_through_jsonl(tmp_path, steps)
    assert run.steps == list(range(80))
    assert run.events == []


@pytest.mark.slow
def test_docs_examples_print_what_they_show():
    docs = Path(__file__).resolve().parents[1] / "docs" / "health.md"
    assert doctest.testfile(str(docs), module_relative=False).failed == 0
