"""Tests of rlmetrics.core.reduce: name -> reduction rules, the registry, the seed's API, applying
reductions."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics.core import reduce
from rlmetrics.core.reduce import (
    COUNT,
    DEFAULT_RENAMES,
    MAX,
    MEAN,
    MEDIAN,
    MIN,
    SPECIAL_METRICS,
    STD,
    SUM,
    MaxMetric,
    MeanMetric,
    MedianMetric,
    Metric,
    MetricFunc,
    MinMetric,
    PercentileMetric,
    Reduction,
    SumMetric,
    parse_reduction,
    percentile,
    register_reduction,
    rename,
    resolve,
    unregister_reduction,
)  # fmt: skip
from rlmetrics.core.stat import Stat

BUILTINS = (MEAN, SUM, MIN, MAX, STD, COUNT, MEDIAN)
ARRAY_REDUCTIONS = (MEAN, SUM, MIN, MAX, STD, COUNT)


# ---------------------------------------------------------------------------------------- names -> reductions

NAMES = [
    # the seed's substring rule gets these wrong: "min" in minibatch / minerva / admin, "max" in max_bench
    ("actor/minibatch_loss", "mean"),
    ("val-core/minerva_math/acc/mean@16", "mean"),
    ("admin/score", "mean"),
    ("val-core/max_bench/acc/mean@4", "mean"),
    ("terminal/reward", "mean"),  # "terminal" contains "min"
    ("summary/loss", "mean"),  # "summary" contains "sum"
    ("mini/maxi/score", "mean"),
    # the seed's built-in metrics
    ("critic/score/max", "max"), ("critic/score/min", "min"), ("critic/score/mean", "mean"),
    ("critic/advantages/min", "min"), ("critic/returns/max", "max"), ("critic/vf_explained_var", "mean"),
    ("response/length/min", "min"), ("response/length/max", "max"), ("response/clip_ratio/mean", "mean"),
    ("response/correct_length/max", "max"), ("prompt/length/mean", "mean"),
    ("prompt/clip_ratio/mean", "mean"),
    ("num_turns/min", "min"), ("num_turns/max", "max"), ("num_turns/mean", "mean"),
    ("tool_call_counts/max", "max"),
    ("timing_s/gen", "mean"), ("timing_s/update_actor", "mean"), ("timing_per_token_ms/update_actor", "mean"),
    ("perf/total_num_tokens", "sum"), ("perf/time_per_step", "mean"), ("perf/throughput", "mean"),
    ("perf/max_memory_allocated_gb", "max"), ("perf/max_memory_reserved_gb", "max"),
    ("perf/cpu_memory_used_gb", "mean"), ("perf/process_cpu_mem_used_gb", "mean"),
    ("val-core/openai/gsm8k/reward/best@4/mean", "mean"), ("val-core/openai/gsm8k/reward/maj@8/mean", "mean"),
    ("val/test_score/openai/gsm8k", "mean"),
    ("analysis/unique_transitions/total", "sum"), ("analysis/total_transitions/total", "sum"),
    ("analysis/transition_diversity/mean", "mean"), ("analysis/coherence/median", "median"),
    ("training/loss/std", "std"), ("training/policy_entropy/mean", "mean"), ("graph_output_handling", "max"),
    ("actor/entropy", "mean"), ("actor/pg_clipfrac", "mean"), ("actor/ppo_kl", "mean"),
    ("actor/grad_norm", "mean"),
    # seed-style custom names
    ("custom/latency/median", "median"), ("custom/score/p95", "p95"), ("custom/score/p99.9", "p99.9"),
    ("custom/response_quality/min", "min"),
    # tokens: whole words split on _ @ - . ; the last decisive token of the last decisive segment wins
    ("x/count", "sum"), ("max_len/count", "sum"), ("val/test_score/max_bench", "mean"),
    ("a/b/p50", "p50"), ("lat_p99", "p99"),
    ("lat-p99", "p99"),
    ("lat.p99.9", "p99.9"), ("x/p95_latency", "p95"), ("x/p0", "p0"), ("x/p100", "p100"), ("x/p05", "p5"),
    ("something/p101", "mean"), ("x/p100.5", "mean"), ("x/p", "mean"), ("x/p5e3", "mean"),
    ("x/avg_reward", "mean"), ("x/total_tokens", "sum"), ("x/tokens_sum", "sum"),
    ("perf/min_throughput", "min"),
    ("x/minimum", "min"), ("x/maximum", "max"), ("loss_p95_max", "max"), ("reward/std_dev", "std"),
    ("x/MAX", "max"), ("x/P95", "p95"), ("X/Median", "median"),
    # odd shapes
    ("a//max", "max"), ("a/max/", "max"), ("/max", "max"), ("max/", "max"), ("score/", "mean"), ("", "mean"),
    ("/", "mean"), ("a/b/c/d/e/f", "mean"), ("métrique/最大/max", "max"), ("naïve/ñandú/score", "mean"),
    ("Ωmega/p99", "p99"), ("émoji🙂/sum", "sum"), ("max/loss", "max"),
]  # fmt: skip


def test_table_is_large_and_unique() -> None:
    assert len(NAMES) >= 40
    assert len({n for n, _ in NAMES}) == len(NAMES)


@pytest.mark.parametrize("name, expected", NAMES)
def test_resolve(name: str, expected: str) -> None:
    assert resolve(name).name == expected
    assert MetricFunc(name) is resolve(name)
    assert resolve(name) == parse_reduction(expected)


# ---------------------------------------------------------------------------------------- registry


def test_register_exact_name_and_unregister_restores() -> None:
    assert resolve("actor/minibatch_loss") == MEAN  # cached before registering: registering must clear it
    register_reduction("actor/minibatch_loss", "max")
    assert resolve("actor/minibatch_loss") == MAX
    assert SPECIAL_METRICS["actor/minibatch_loss"] == MAX
    assert resolve("actor/minibatch_loss/x") == MEAN  # exact means exact
    unregister_reduction("actor/minibatch_loss")
    assert resolve("actor/minibatch_loss") == MEAN
    unregister_reduction("never/registered")  # no error


def test_register_glob_beats_tokens_and_unregister_restores() -> None:
    register_reduction("custom/latency/*", "p99")
    assert resolve("custom/latency/median") == percentile(99)
    assert resolve("custom/latency/a/b") == percentile(99)  # fnmatch: * also crosses "/"
    assert resolve("custom/score/median") == MEDIAN
    unregister_reduction("custom/latency/*")
    assert resolve("custom/latency/median") == MEDIAN


def test_exact_beats_glob_whatever_the_order() -> None:
    register_reduction("a/b", MIN)
    register_reduction("a/*", "max")
    register_reduction("c/*", "max")
    register_reduction("c/d", "min")
    assert (resolve("a/b"), resolve("a/c"), resolve("c/d"), resolve("c/e")) == (MIN, MAX, MIN, MAX)


def test_later_glob_wins_and_re_registering_moves_it_last() -> None:
    register_reduction("a/*", "max")
    register_reduction("*/b", "min")
    assert resolve("a/b") == MIN
    register_reduction("a/*", "sum")
    assert resolve("a/b") == SUM
    unregister_reduction("a/*")
    assert resolve("a/b") == MIN
    register_reduction("?/[bc]", "count")
    assert (resolve("a/b"), resolve("x/c"), resolve("xy/c")) == (COUNT, COUNT, MEAN)


def test_register_overrides_special_metric_and_unregister_restores_it() -> None:
    register_reduction("graph_output_handling", "min")
    assert resolve("graph_output_handling") == MIN
    unregister_reduction("graph_output_handling")
    assert resolve("graph_output_handling") == MAX


def test_special_metrics_is_a_plain_dict_read_on_every_resolution() -> None:
    assert resolve("my/metric") == MEAN
    SPECIAL_METRICS["my/metric"] = MAX
    assert resolve("my/metric") == MAX


def test_exact_names_with_glob_characters() -> None:
    register_reduction("acc[0]", "max", glob=False)
    assert (resolve("acc[0]"), resolve("acc0")) == (MAX, MEAN)


def test_specs_are_case_insensitive() -> None:
    assert parse_reduction("P95") == percentile(95) and parse_reduction("MEAN") == MEAN


BAD_SPECS = ["bogus", "p101", "p-1", "", "p", "p95%", "p 95", 95, None, abs]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_invalid_spec_raises_and_leaves_registry_alone(spec) -> None:
    before = (dict(SPECIAL_METRICS), dict(reduce._GLOBS))
    with pytest.raises(ValueError, match=r"unknown reduction .*use one of"):
        register_reduction("x/y", spec)
    with pytest.raises(ValueError, match=r"unknown reduction .*use one of"):
        register_reduction("x/*", spec)
    assert (dict(SPECIAL_METRICS), dict(reduce._GLOBS)) == before
    assert resolve("x/y") == MEAN


@pytest.mark.parametrize("p", [-1, 100.01, math.nan, math.inf])
def test_percentile_out_of_range(p) -> None:
    with pytest.raises(ValueError, match="percentile must be within"):
        percentile(p)


@pytest.mark.parametrize("r", BUILTINS, ids=lambda r: r.name)
def test_parse_reduction_round_trips_builtins(r: Reduction) -> None:
    assert parse_reduction(r.name) is r
    assert parse_reduction(r) is r


@given(st.floats(0.0, 100.0))
def test_parse_reduction_round_trips_percentiles(p: float) -> None:
    r = percentile(p)
    assert r.kind == "quantile" and r.q == p / 100.0 and r.needs_sketch
    assert parse_reduction(r.name) == r
    assert resolve(f"custom/x/{r.name}") == r


def test_percentile_names() -> None:
    assert [percentile(p).name for p in (95, 99.9, 50.0, 0, 100, 99.99999, 1e-5)] == [
        "p95", "p99.9", "p50", "p0", "p100", "p99.99999", "p0.00001",
    ]  # fmt: skip
    assert PercentileMetric(95) == parse_reduction("p95") == percentile(95.0)


# ---------------------------------------------------------------------------------------- the seed's API

scalar = st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.integers(-1000, 1000))
value = st.one_of(scalar, st.lists(scalar, max_size=6))


def flatten(metrics: list[Metric]) -> list[float]:
    """The seed's flattening: a list value is many values, anything else one."""
    return [float(v) for m in metrics for v in (m.value if isinstance(m.value, list) else [m.value])]


def torch_ref(values: list[float], q: float | None) -> float:
    """torch.median (the lower middle value) or torch.quantile (linear) of ``values``."""
    torch = pytest.importorskip("torch")
    t = torch.tensor(values, dtype=torch.float64)
    return torch.median(t).item() if q is None else torch.quantile(t, q).item()


@pytest.mark.torch
@settings(max_examples=150, deadline=None)
@given(st.lists(value, min_size=1, max_size=8), st.floats(0.0, 100.0))
def test_seed_reductions_equal_reference(values, p: float) -> None:
    metrics = [Metric("critic/score", v, len(values)) for v in values]
    flat = flatten(metrics)
    if not flat:
        assert math.isnan(MeanMetric(metrics)) and SumMetric(metrics) == 0.0
        return
    scale = max(abs(v) for v in flat)
    assert MaxMetric(metrics) == max(flat)
    assert MinMetric(metrics) == min(flat)
    assert abs(MeanMetric(metrics) - statistics.mean(flat)) <= 1e-13 * scale
    assert abs(SumMetric(metrics) - math.fsum(flat)) <= 1e-13 * scale * len(flat)
    assert MedianMetric(metrics) == torch_ref(flat, None)  # lower middle, as torch.median
    pct = PercentileMetric(p)(metrics)
    assert pct == pytest.approx(torch_ref(flat, p / 100.0), rel=1e-13, abs=1e-13 * scale)
    tol = 1e-13 * scale * len(flat)
    for name, expect in [
        ("critic/score/max", max(flat)), ("response/length/min", min(flat)),
        ("analysis/coherence/median", torch_ref(flat, None)),
        ("custom/score/p95", torch_ref(flat, 0.95)), ("analysis/unique_transitions/total", math.fsum(flat)),
        ("actor/minibatch_loss", statistics.mean(flat)), ("graph_output_handling", max(flat)),
    ]:  # fmt: skip
        assert MetricFunc(name)(metrics) == pytest.approx(expect, rel=1e-13, abs=tol), name


def test_seed_reductions_on_unequal_batches() -> None:
    # mean over all values, not the mean of the per-metric means
    metrics = [Metric("x", [1.0, 2.0, 3.0, 4.0], 2), Metric("x", 10.0, 2)]
    assert MeanMetric(metrics) == 4.0
    assert MedianMetric(metrics) == 3.0
    assert PercentileMetric(50)(metrics) == 3.0
    assert PercentileMetric(100)(metrics) == 10.0
    assert MeanMetric([1.0, [2.0, 3.0]]) == 2.0  # bare values work too
    assert math.isnan(MeanMetric([])) and SumMetric([]) == 0.0 and math.isnan(MedianMetric([]))


def test_seed_metric_is_a_plain_record() -> None:
    m = Metric("a", [1.0], 4)
    assert (m.name, m.value, m.world_size) == ("a", [1.0], 4)
    assert Metric("a", 1.0, 2) == Metric("a", 1.0, 2)


# ---------------------------------------------------------------------------------------- applying reductions

data_lists = st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=12)
NUMPY = {"mean": np.mean, "sum": np.sum, "min": np.min, "max": np.max, "std": np.std, "count": np.size}


@settings(max_examples=100, deadline=None)
@given(st.lists(data_lists, min_size=1, max_size=6))
def test_apply_and_apply_arrays_agree_with_numpy(columns) -> None:
    stats = [Stat.of(c) for c in columns]
    arrays = np.stack([s.to_array() for s in stats], axis=1)
    for r in ARRAY_REDUCTIONS:
        vec = r.apply_arrays(arrays)
        assert vec.shape == (len(columns),)
        for j, c in enumerate(columns):
            got = r.apply(stats[j])
            assert got == vec[j] or (math.isnan(got) and math.isnan(vec[j])), r.name
            x = np.array(c)
            if x.size == 0:
                assert (got == 0.0) if r in (SUM, COUNT) else math.isnan(got)
                continue
            scale = float(np.abs(x).max()) * (x.size if r is SUM else 1)
            assert abs(got - NUMPY[r.name](x)) <= 1e-12 * scale, r.name


def test_apply_arrays_does_not_alias_input() -> None:
    arrays = Stat.of([1.0, 2.0]).to_array()[:, None]
    for r in ARRAY_REDUCTIONS:
        r.apply_arrays(arrays)[:] = -1.0
    np.testing.assert_array_equal(arrays[:, 0], Stat.of([1.0, 2.0]).to_array())


def test_std_is_pooled_population_std() -> None:
    a, b = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0])
    assert STD.apply(Stat.of(a).merge(Stat.of(b))) == pytest.approx(np.std(np.concatenate([a, b])), rel=1e-15)


@pytest.mark.torch
@pytest.mark.parametrize("r", [MEDIAN, percentile(95), percentile(0), percentile(100)], ids=lambda r: r.name)
def test_quantile_reductions_need_a_sketch(r: Reduction) -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal(101)
    with pytest.raises(ValueError, match="sketch"):
        r.apply(Stat.of(x))
    with pytest.raises(ValueError, match="sketch"):
        r.apply_arrays(Stat.of(x).to_array()[:, None])
    merged = Stat.of(x[:40], sketch=True).merge(Stat.of(x[40:], sketch=True))
    assert r.apply(merged) == pytest.approx(torch_ref(x.tolist(), None if r is MEDIAN else r.q), rel=1e-15)
    assert math.isnan(r.apply(Stat.of([], sketch=True)))


def test_rename() -> None:
    assert rename("timing_s/gen", DEFAULT_RENAMES) == "perf/delta_time/gen"
    assert rename("timing_s/update_actor", DEFAULT_RENAMES) == "perf/delta_time/update_actor"
    for unchanged in ("timing_per_token_ms/gen", "timing_s", "perf/timing_s/gen", "critic/score/max"):
        assert rename(unchanged, DEFAULT_RENAMES) == unchanged
    assert rename("timing_s/gen", {}) == "timing_s/gen"
    assert rename("a/b/c", {"a/": "x/", "a/b/": "y/"}) == "x/b/c"  # the first matching prefix
    assert rename("a/b/c", {"a/b/": "y/", "a/": "x/"}) == "y/c"
    assert resolve(rename("timing_s/gen", DEFAULT_RENAMES)) == MEAN


def test_a_reduction_registered_after_a_first_reduce_applies_to_the_next():
    """Reducing caches each name list's reductions; registering (and unregistering) a reduction
    later still changes the next reduce of those names."""
    from rlmetrics.metrics.assemble import column_values

    arrays = np.array([[2.0], [6.0], [0.0], [1.0], [5.0]])  # count 2, sum 6, min 1, max 5
    assert column_values(["lat/decode"], arrays).tolist() == [3.0]  # mean
    register_reduction("lat/decode", "max")
    try:
        assert column_values(["lat/decode"], arrays).tolist() == [5.0]
    finally:
        unregister_reduction("lat/decode")
    assert column_values(["lat/decode"], arrays).tolist() == [3.0]
