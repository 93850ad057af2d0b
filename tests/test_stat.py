"""Tests of rlmetrics.core.stat: merged summaries equal numpy on the concatenated data, input handling,
errors."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import (
    MetricValueError,
    Stat,
    empty_arrays,
    merge_arrays,
    reduce_parts,
    stats_of_rows,
)
from tests.torch_params import TORCH, made, tensor

REL = 1e-9
NAN, INF = math.nan, math.inf

finite = st.floats(min_value=-1e100, max_value=1e100, allow_nan=False, allow_infinity=False)
# |x| spans 1e-8 .. 1e8 with random signs
wide = st.builds(
    lambda sign, exp, mant: sign * mant * 10.0**exp,
    st.sampled_from([-1.0, 1.0]),
    st.integers(-8, 7),
    st.floats(1.0, 10.0),
)
weights = st.one_of(st.just(0.0), st.floats(1e-3, 10.0))


# ---------------------------------------------------------------------------------------- helpers


def reference(x: np.ndarray, w: np.ndarray | None = None) -> dict[str, float]:
    """Statistics of the concatenated data, computed directly with numpy (``w``: effective weights)."""
    x = np.asarray(x, dtype=np.float64)
    if w is None:
        x = x.ravel()
        if x.size == 0:
            return {"count": 0.0, "sum": 0.0, "mean": NAN, "var": NAN, "min": INF, "max": -INF}
        return {
            "count": float(x.size), "sum": float(np.sum(x)), "mean": float(np.mean(x)),
            "var": float(np.var(x)), "min": float(np.min(x)), "max": float(np.max(x)),
        }  # fmt: skip
    w = np.broadcast_to(np.asarray(w, dtype=np.float64), x.shape).ravel()
    x = x.ravel()
    keep = w > 0
    if not keep.any():
        return {"count": 0.0, "sum": 0.0, "mean": NAN, "var": NAN, "min": INF, "max": -INF}
    xk, wk = x[keep], w[keep]
    mean = float(np.average(xk, weights=wk))
    var = float(np.average((xk - mean) ** 2, weights=wk))
    return {
        "count": float(wk.sum()), "sum": math.fsum(wk * xk), "mean": mean, "var": var,
        "min": float(xk.min()), "max": float(xk.max()),
    }  # fmt: skip


def scales(x: np.ndarray, w: np.ndarray | None = None) -> dict[str, float]:
    """What each statistic's round-off is proportional to: sum |w x|, mean |x|, mean x^2 (= mean^2 + var)."""
    x = np.asarray(x, dtype=np.float64)
    w = np.ones_like(x) if w is None else np.broadcast_to(np.asarray(w, dtype=np.float64), x.shape)
    x, w = x.ravel(), w.ravel()
    n = w.sum()
    abs_sum = float(np.sum(w * np.abs(x)))
    return {
        "count": n, "sum": abs_sum, "mean": abs_sum / n if n else 0.0,
        "var": float(np.sum(w * x * x) / n) if n else 0.0,
    }  # fmt: skip


def same(got: float, want: float) -> bool:
    return got == want or (math.isnan(got) and math.isnan(want))


def assert_matches(stat: Stat, x: np.ndarray, w: np.ndarray | None = None, rel: float = REL) -> None:
    ref, sc = reference(x, w), scales(x, w)
    got = {key: getattr(stat, key) for key in ("count", "sum", "mean", "var", "min", "max")}
    for key in ("min", "max"):
        assert got[key] == ref[key], (key, got, ref)
    for key in ("count", "sum", "mean", "var"):
        ok = same(got[key], ref[key]) or abs(got[key] - ref[key]) <= rel * sc[key]
        assert ok, (key, got[key], ref[key], sc[key])


def split(n: int, cuts: list[int]) -> list[slice]:
    """Slices of ``range(n)`` at the given cut points (empty parts allowed)."""
    edges = [0, *sorted(min(c, n) for c in cuts), n]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def random_tree_merge(stats: list[Stat], rnd: random.Random) -> Stat:
    """Merge in a random order and tree shape: pick two, merge either way round, put the result anywhere."""
    items = list(stats)
    while len(items) > 1:
        i, j = sorted(rnd.sample(range(len(items)), 2))
        b, a = items.pop(j), items.pop(i)
        items.insert(rnd.randint(0, len(items)), a.merge(b) if rnd.random() < 0.5 else b.merge(a))
    return items[0]


@st.composite
def split_data(draw, elements=finite, max_size: int = 120):
    x = draw(st.lists(elements, max_size=max_size))
    cuts = draw(st.lists(st.integers(0, len(x)), max_size=10))
    return np.array(x, dtype=np.float64), split(len(x), cuts)


# ------------------------------------------------------------------------------ merging = concatenation


@settings(max_examples=150, deadline=None)
@given(split_data(), st.randoms(use_true_random=False))
def test_merge_of_parts_equals_numpy(data, rnd: random.Random) -> None:
    x, parts = data
    assert_matches(random_tree_merge([Stat.of(x[p]) for p in parts], rnd), x)


@settings(max_examples=150, deadline=None)
@given(split_data(wide), st.randoms(use_true_random=False))
def test_merge_of_parts_equals_numpy_wide_magnitudes(data, rnd: random.Random) -> None:
    x, parts = data
    assert_matches(random_tree_merge([Stat.of(x[p]) for p in parts], rnd), x)


@pytest.mark.parametrize(
    "kinds", [("list", "numpy"), pytest.param(("list", "numpy", "torch"), marks=pytest.mark.torch)]
)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), elements=st.sampled_from([finite, wide]), rnd=st.randoms(use_true_random=False))
def test_merge_of_weighted_masked_parts_equals_numpy(kinds, data, elements, rnd: random.Random) -> None:
    x, parts = data.draw(split_data(elements))
    w = np.array(data.draw(st.lists(weights, min_size=x.size, max_size=x.size)), dtype=np.float64)
    m = np.array(data.draw(st.lists(st.booleans(), min_size=x.size, max_size=x.size)), dtype=bool)
    convert = {"list": lambda a: a.tolist(), "numpy": lambda a: a}
    if "torch" in kinds:
        convert["torch"] = pytest.importorskip("torch").from_numpy
    stats = []
    for p in parts:  # each part as a list, a numpy array or a tensor
        c = convert[data.draw(st.sampled_from(sorted(convert)))]
        stats.append(Stat.of(c(x[p]), mask=c(m[p]), weight=c(w[p])))
    assert_matches(random_tree_merge(stats, rnd), x, w * m)


def test_million_values_in_1000_random_parts() -> None:
    rng = np.random.default_rng(1234)
    x = rng.standard_normal(1_000_000) * 10.0 ** rng.integers(-8, 9, size=1_000_000) + 3.0
    w = rng.random(x.size) * (rng.random(x.size) > 0.1)
    parts = split(x.size, rng.integers(0, x.size + 1, size=999).tolist())
    assert len(parts) == 1000
    stats = [Stat.of(x[p], weight=w[p]) for p in parts]
    assert_matches(random_tree_merge(stats, random.Random(7)), x, w)
    folded = Stat()
    for s in stats:
        folded = folded.merge(s)
    assert_matches(folded, x, w)
    parts = np.stack([s.to_array() for s in stats], axis=1)[:, :, None]  # (5, 1000, 1)
    assert_matches(Stat.from_array(reduce_parts(parts)[:, 0]), x, w)


def test_large_offset_small_spread_keeps_variance() -> None:
    # A sum-of-squares implementation loses every digit here (x^2 ~ 1e18, var ~ 1); Chan's merge keeps them.
    rng = np.random.default_rng(0)
    x = 1e9 + rng.standard_normal(100_000)
    parts = split(x.size, rng.integers(0, x.size + 1, size=63).tolist())
    merged = random_tree_merge([Stat.of(x[p]) for p in parts], random.Random(0))
    assert abs(merged.var - np.var(x)) <= 1e-7 * np.var(x)
    assert merged.mean == pytest.approx(np.mean(x), rel=1e-15)


# ---------------------------------------------------------------------------------------- vector merges


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_merge_arrays_and_reduce_parts_equal_pairwise_merge(data) -> None:
    k, m = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 5))
    elements = data.draw(st.sampled_from([finite, wide]))
    cells = [[np.array(data.draw(st.lists(elements, max_size=8))) for _ in range(m)] for _ in range(k)]
    stats = [[Stat.of(x) for x in row] for row in cells]  # some cells are empty: zero-count parts
    parts = np.stack([np.stack([s.to_array() for s in row], axis=1) for row in stats], axis=1)
    assert parts.shape == (5, k, m)
    folded = []
    for j in range(m):
        acc = Stat()
        for i in range(k):
            acc = acc.merge(stats[i][j])
        folded.append(acc.to_array())
    folded = np.stack(folded, axis=1)
    vec = empty_arrays(m)
    for i in range(k):
        vec = merge_arrays(vec, parts[:, i])
    np.testing.assert_array_equal(vec, folded)  # the same formula, on all columns at once
    reduced = reduce_parts(parts)
    assert reduced.shape == (5, m)
    np.testing.assert_array_equal(reduced[[0, 3, 4]], folded[[0, 3, 4]])
    for j in range(m):
        x = np.concatenate([cells[i][j] for i in range(k)])
        assert_matches(Stat.from_array(reduced[:, j]), x)
        assert_matches(Stat.from_array(folded[:, j]), x)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_stats_of_rows_equals_numpy_per_column(data) -> None:
    k, m = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4))
    elements = data.draw(st.sampled_from([finite, wide]))
    rows = np.array(data.draw(st.lists(st.lists(elements, min_size=m, max_size=m), min_size=k, max_size=k)))
    out = stats_of_rows(rows)
    assert out.shape == (5, m)
    for j in range(m):
        assert_matches(Stat.from_array(out[:, j]), rows[:, j])


def test_reduce_parts_all_empty_column_is_identity() -> None:
    parts = np.stack([empty_arrays(3), empty_arrays(3)], axis=1)
    parts[:, 1, 2] = Stat.of([1.0, 2.0]).to_array()
    out = reduce_parts(parts)
    np.testing.assert_array_equal(out[:, :2], empty_arrays(2))
    np.testing.assert_array_equal(out[:, 2], Stat.of([1.0, 2.0]).to_array())


# ---------------------------------------------------------------------------------------- algebra

stats = st.lists(st.sampled_from([finite, wide]).flatmap(lambda e: e), max_size=20).map(Stat.of)


@settings(max_examples=200, deadline=None)
@given(stats, stats, stats)
def test_merge_is_associative_and_commutative(a: Stat, b: Stat, c: Stat) -> None:
    assert a.merge(b) == b.merge(a)  # exactly
    left, right = a.merge(b).merge(c), a.merge(b.merge(c))
    assert (left.count, left.min, left.max) == (right.count, right.min, right.max)
    sum_scale = sum(abs(s.sum) for s in (a, b, c)) + sum(abs(s.mean) * s.count for s in (a, b, c) if s.count)
    assert abs(left.sum - right.sum) <= 1e-14 * sum_scale
    sq_scale = sum(s.m2 + s.count * s.mean**2 for s in (a, b, c) if s.count)
    assert abs(left.m2 - right.m2) <= 1e-13 * sq_scale


@given(stats)
def test_empty_stat_is_identity(a: Stat) -> None:
    assert Stat().merge(a) == a
    assert a.merge(Stat()) == a
    assert Stat().merge(Stat()) == Stat()


# ---------------------------------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "value, expect",
    [
        (3, [3.0]), (2.5, [2.5]), (True, [1.0]), (False, [0.0]),
        (np.float32(1.5), [1.5]), (np.int64(7), [7.0]), (np.bool_(True), [1.0]), (np.float16(0.5), [0.5]),
        (np.array(2.5), [2.5]), (np.array(3, dtype=np.int8), [3.0]),
        ([[1, 2], [3, 4]], [1.0, 2.0, 3.0, 4.0]), ([[1.5], [2.5]], [1.5, 2.5]), ([True, False], [1.0, 0.0]),
        tensor(lambda torch: [torch.tensor(1.5), 2.0], [1.5, 2.0]), ((1.0, 2.0), [1.0, 2.0]),
        (range(3), [0.0, 1.0, 2.0]), tensor(lambda torch: torch.tensor(2.5), [2.5]),
        tensor(lambda torch: torch.tensor(3), [3.0]), tensor(lambda torch: torch.tensor(True), [1.0]),
    ],
)  # fmt: skip
def test_scalars_and_lists(value, expect) -> None:
    value = made(value)
    assert_matches(Stat.of(value), np.array(expect))
    assert_matches(Stat.of(value, sketch=True), np.array(expect))


@pytest.mark.parametrize("dtype", [np.int8, np.float16, np.bool_, np.float32, np.float64, np.uint8])
@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 2)])
def test_numpy_arrays(dtype, shape) -> None:
    rng = np.random.default_rng(3)
    arr = (rng.standard_normal(shape) * 50).astype(dtype)
    assert_matches(Stat.of(arr), arr.astype(np.float64).ravel())


@pytest.mark.parametrize("kind", ["numpy", TORCH, "list", pytest.param("mixed", marks=pytest.mark.torch)])
def test_mask_and_weight_broadcast(kind) -> None:
    rng = np.random.default_rng(11)
    b, t = 4, 6
    values = rng.standard_normal((b, t))
    mask = rng.random((b, t)) > 0.3
    weight = rng.random((b, 1)) + 0.5
    expected_w = mask * weight
    if kind in ("numpy", "list"):
        args = (
            (values, mask, weight) if kind == "numpy" else (values.tolist(), mask.tolist(), weight.tolist())
        )
    else:
        torch = pytest.importorskip("torch")
        args = {
            "torch": (torch.from_numpy(values).float(), torch.from_numpy(mask), torch.from_numpy(weight)),
            "mixed": (torch.from_numpy(values), mask.astype(np.int8), torch.from_numpy(weight).float()),
        }[kind]
    x = values.astype(np.float32).astype(np.float64) if kind == "torch" else values
    w = mask * weight.astype(np.float32) if kind == "mixed" else expected_w
    assert_matches(Stat.of(*args), x, w, rel=1e-12)
    # broadcast along the other axis, and a scalar mask / weight
    per_token = rng.random((1, t))
    assert_matches(Stat.of(values, weight=per_token), values, np.broadcast_to(per_token, (b, t)), rel=1e-12)
    assert_matches(Stat.of(values, mask=1, weight=2.0), values, np.full_like(values, 2.0))
    assert Stat.of(values, mask=0).count == 0


# ---------------------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize(
    "values",
    [[1.0, NAN, 3.0], [NAN], [1.0, INF], [INF], [-INF, 2.0], [-INF, INF], [INF, INF], [NAN, INF]]
    + [[NAN, 1, -INF]],
)
@pytest.mark.parametrize("kind", ["scalar", "list", TORCH])
def test_propagate_matches_numpy(values, kind) -> None:
    if kind == "scalar" and len(values) > 1:
        stat = Stat()
        for v in values:
            stat = stat.merge(Stat.of(v))
    else:
        v = values[0] if kind == "scalar" else values
        if kind == "torch":
            torch = pytest.importorskip("torch")
            v = torch.tensor(v, dtype=torch.float64)
        stat = Stat.of(v)
    x = np.array(values)
    with np.errstate(invalid="ignore"):
        want = (float(x.size), np.sum(x), np.mean(x), np.var(x), np.min(x), np.max(x))
    got = (stat.count, stat.sum, stat.mean, stat.var, stat.min, stat.max)
    assert all(same(g, w) for g, w in zip(got, want, strict=True)), (got, want)


def test_propagate_masked_nan_does_not_reach_the_result() -> None:
    assert_matches(Stat.of([1.0, NAN, 3.0], mask=[1, 0, 1]), np.array([1.0, 3.0]))
    assert_matches(Stat.of([1.0, INF, 3.0], weight=[1.0, 0.0, 2.0]), np.array([1.0, 3.0]), np.array([1, 2]))


@pytest.mark.parametrize("kind", ["list", "numpy", TORCH, pytest.param("sketch", marks=pytest.mark.torch)])
def test_drop_equals_numpy_on_finite_values(kind) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal(50)
    x[rng.choice(50, 12, replace=False)] = rng.choice([NAN, INF, -INF], 12)
    mask = rng.random(50) > 0.2
    torch = pytest.importorskip("torch") if kind in ("torch", "sketch") else None
    arg = {"list": x.tolist(), "numpy": x, "torch": torch and torch.from_numpy(x), "sketch": x}[kind]
    stat = Stat.of(arg, mask=mask, nan_strategy="drop", sketch=kind == "sketch")
    keep = mask & np.isfinite(x)
    assert_matches(stat, x[keep])
    if kind == "sketch":
        assert stat.sketch.median() == torch.median(torch.from_numpy(x[keep])).item()
    for v in (NAN, INF, -INF):
        assert Stat.of(v, nan_strategy="drop") == Stat()
    assert Stat.of([NAN, INF], nan_strategy="drop").count == 0
    assert math.isnan(Stat.of([NAN, INF], nan_strategy="drop").mean)


@pytest.mark.parametrize(
    "value",
    [
        NAN,
        INF,
        -INF,
        [1.0, NAN],
        [[1.0], [INF]],
        np.array([2.0, -INF]),
        tensor(lambda t: t.tensor([1.0, NAN])),
    ],
)
@pytest.mark.parametrize("sketch", [False, True])
def test_error_strategy_names_the_metric(value, sketch) -> None:
    with pytest.raises(MetricValueError, match="actor/pg_loss"):
        Stat.of(made(value), nan_strategy="error", name="actor/pg_loss", sketch=sketch)


def test_error_strategy_ignores_masked_non_finite() -> None:
    assert Stat.of([1.0, NAN, 2.0], mask=[1, 0, 1], nan_strategy="error").mean == 1.5


def test_unknown_nan_strategy() -> None:
    with pytest.raises(ValueError, match="nan_strategy"):
        Stat.of([1.0], nan_strategy="ignore")


# ---------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kind", ["list", TORCH])
@pytest.mark.parametrize("weight", [[1.0, -1.0], [1.0, NAN], [INF, 1.0]])
@pytest.mark.parametrize("sketch", [False, True])
def test_invalid_weights_name_the_metric(kind, weight, sketch) -> None:
    values, w = [1.0, 2.0], weight
    if kind == "torch":
        torch = pytest.importorskip("torch")
        values, w = torch.tensor(values), torch.tensor(weight)
    with pytest.raises(MetricValueError, match="critic/vf_loss"):
        Stat.of(values, weight=w, name="critic/vf_loss", sketch=sketch)


def test_masked_out_weights_are_ignored() -> None:
    # e.g. weight = 1 / n_tokens, inf (or nan) on padded rows that the mask removes
    assert Stat.of([1.0, 2.0, 3.0], mask=[1, 1, 0], weight=[1.0, 3.0, INF]).mean == 1.75
    assert Stat.of([1.0, 2.0], mask=[1, 0], weight=[1.0, -1.0]).count == 1.0


@pytest.mark.parametrize(
    "value",
    [
        "abc", b"12", None, [1.0, None], [None], [[1.0, 2.0], [3.0]], ["a", "b"], ["1.5", "2"], [1.0, "2"],
        np.array("x"), np.array(["1.0"]), np.array([1 + 2j]), [1 + 2j], {"a": 1.0}, object(),
    ],
)  # fmt: skip
def test_non_numbers_name_the_metric(value) -> None:
    with pytest.raises(MetricValueError, match="response/length"):
        Stat.of(value, name="response/length")
    if value is not None:  # weight=None means unweighted
        with pytest.raises(MetricValueError, match="response/length"):
            Stat.of([1.0, 2.0], weight=value, name="response/length")


@pytest.mark.parametrize(
    "values, mask",
    [
        (np.ones(3), np.ones(4)), (np.ones((2, 3)), np.ones((3, 2))), (np.ones(3), np.ones((2, 3))),
        tensor(lambda t: (t.ones(3), t.ones(4)), None), tensor(lambda t: (t.ones(2, 3), t.ones(3, 2)), None),
        tensor(lambda t: (t.ones(3), t.ones(2, 1, 3)), None),
        tensor(lambda t: (t.ones(3), np.ones(4)), None), (2.0, [1, 1]),
    ],
)  # fmt: skip
def test_mask_or_weight_of_wrong_shape(values, mask) -> None:
    if mask is None:  # both made together
        values, mask = made(values)
    with pytest.raises(MetricValueError, match="timing_s/gen"):
        Stat.of(values, mask=mask, name="timing_s/gen")
    with pytest.raises(MetricValueError, match="timing_s/gen"):
        Stat.of(values, weight=mask, name="timing_s/gen")


# ---------------------------------------------------------------------------------------- wire, repr, empty


@given(stats)
def test_array_round_trip(stat: Stat) -> None:
    arr = stat.to_array()
    assert arr.shape == (5,) and arr.dtype == np.float64
    assert Stat.from_array(arr) == stat
    assert Stat.from_array(arr.tolist()).to_array().tolist() == arr.tolist()


def test_from_array_keeps_the_sketch() -> None:
    s = Stat.of([3.0, 1.0, 2.0], sketch=True)
    back = Stat.from_array(s.to_array(), sketch=Sketch.from_array(s.sketch.to_array()))
    assert back == s and back.sketch.median() == 2.0


def test_repr() -> None:
    assert repr(Stat.of([1.0, 2.0])) == "Stat(count=2, mean=1.5, std=0.5, min=1, max=2)"
    assert repr(Stat()) == "Stat(count=0, mean=nan, std=nan, min=inf, max=-inf)"
    assert repr(Stat.of([1.0], sketch=True)).endswith(", sketch)")


@pytest.mark.parametrize(
    "values, kwargs",
    [
        ([], {}), ([[]], {}), (np.empty((0, 3)), {}), tensor(lambda t: (t.empty(0), {}), None),
        tensor(lambda t: (t.empty(2, 0), {}), None), ([1.0, 2.0], {"mask": [0, 0]}),
        tensor(lambda t: (t.ones(2, 3), {"mask": t.zeros(2, 3, dtype=t.bool)}), None),
        ([1.0, 2.0], {"weight": [0.0, 0.0]}), ([NAN, INF], {"nan_strategy": "drop"}), ([], {"sketch": True}),
    ],
)  # fmt: skip
def test_empty_input(values, kwargs) -> None:
    if kwargs is None:  # both made together
        values, kwargs = made(values)
    stat = Stat.of(values, **kwargs)
    assert stat.count == 0 and stat.sum == 0
    assert math.isnan(stat.mean) and math.isnan(stat.var) and math.isnan(stat.std)
    assert (stat.min, stat.max) == (INF, -INF)
    assert Stat.of([5.0]).merge(stat) == Stat.of([5.0])
    if kwargs.get("sketch"):
        assert stat.sketch is not None and stat.sketch.count == 0
