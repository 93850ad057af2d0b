"""Tests of rlmetrics.core.sketch: exactness against torch, error bounds, merging, serialisation, edge
cases."""

from __future__ import annotations

import ast
import doctest
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlmetrics.core.sketch as sketch_module
from rlmetrics.core.sketch import BucketWindow, Sketch

QS = (0.0, 0.05, 0.25, 0.5, 0.95, 0.99, 0.999, 1.0)
N_BIG = 1_000_000
HEADER = 15

finite_floats = st.floats(min_value=-1e100, max_value=1e100, allow_nan=False, allow_infinity=False)
float_lists = st.lists(finite_floats, min_size=1, max_size=200)


def _random_merge(sketches: list[Sketch], rng: np.random.Generator) -> Sketch:
    """Merge in a random tree: pick two at random, merge in random order, put the result back anywhere."""
    items = list(sketches)
    while len(items) > 1:
        i, j = sorted(rng.choice(len(items), size=2, replace=False).tolist())
        b, a = items.pop(j), items.pop(i)
        merged = a.merge(b) if rng.random() < 0.5 else b.merge(a)
        items.insert(int(rng.integers(0, len(items) + 1)), merged)
    return items[0]


def _split(values: np.ndarray, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    cuts = np.sort(rng.integers(0, values.size + 1, size=n_parts - 1))
    return np.split(values, cuts)


def _rel_err(est: float, true: float) -> float:
    if true == 0.0:
        return 0.0 if est == 0.0 else math.inf
    return abs(est - true) / abs(true)


def _bucket_rep(x: float, rel_err: float) -> float:
    gamma = (1 + rel_err) / (1 - rel_err)
    k = math.ceil(math.log(abs(x)) / math.log(gamma))
    return math.copysign(2 * gamma**k / (gamma + 1), x)


def _assert_torch_quantile(ours: float, torch, t, q: float) -> None:
    """Bit-exact where torch's vectorised lerp fuses multiply-add (AVX2/AVX512), else within ~1 ulp."""
    theirs = torch.quantile(t, q).item()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert ours == theirs, (q, ours, theirs)
    else:  # pragma: no cover - other CPUs may round a + t * (b - a) twice
        scale = float(t.abs().max())
        assert ours == pytest.approx(theirs, rel=4e-16, abs=4e-16 * scale), (q, ours, theirs)


# ---------------------------------------------------------------------------------------- exact mode


@pytest.mark.torch
@settings(max_examples=50, deadline=None)
@given(float_lists)
def test_exact_mode_matches_torch(values: list[float]) -> None:
    torch = pytest.importorskip("torch")
    s = Sketch.of(values)
    assert s.is_exact
    t = torch.tensor(values, dtype=torch.float64)
    assert s.median() == torch.median(t).item()
    for q in QS:
        _assert_torch_quantile(s.quantile(q), torch, t, q)
    assert s.count == len(values)


@pytest.mark.torch
@settings(max_examples=50, deadline=None)
@given(float_lists, st.data())
def test_exact_mode_after_random_merges_matches_torch(values: list[float], data: st.DataObject) -> None:
    torch = pytest.importorskip("torch")
    seed = data.draw(st.integers(0, 2**32 - 1))
    n_parts = data.draw(st.integers(1, 8))
    rng = np.random.default_rng(seed)
    parts = _split(np.array(values), n_parts, rng)
    merged = _random_merge([Sketch.of(p) for p in parts], rng)
    assert merged.is_exact
    t = torch.tensor(values, dtype=torch.float64)
    assert merged.median() == torch.median(t).item()
    for q in QS:
        _assert_torch_quantile(merged.quantile(q), torch, t, q)


@settings(max_examples=50, deadline=None)
@given(float_lists)
def test_exact_mode_matches_numpy_linear(values: list[float]) -> None:
    s = Sketch.of(values)
    scale = max(abs(v) for v in values)
    for q in QS:
        expect = np.quantile(np.array(values), q, method="linear")
        assert s.quantile(q) == pytest.approx(expect, rel=1e-12, abs=1e-12 * scale)


def test_exact_quantile_uses_fused_lerp() -> None:
    # torch.quantile([0.25, 5.0], 0.05) == 0.4875; unfused a + t * (b - a) gives 0.48750000000000004
    assert Sketch.of([5.0, 0.25]).quantile(0.05) == 0.4875
    assert Sketch.of([0.0] * 8 + [-7.0]).quantile(0.05) == -4.2


def test_exact_median_is_lower_middle() -> None:
    assert Sketch.of([4.0, 1.0, 3.0, 2.0]).median() == 2.0
    assert Sketch.of([4.0, 1.0, 3.0, 2.0]).quantile(0.5) == 2.5
    assert Sketch.of([7.0]).median() == 7.0


def test_exact_limit_switches_to_buckets() -> None:
    x = np.arange(1.0, 11.0)
    assert Sketch.of(x, exact_limit=10).is_exact
    assert not Sketch.of(x, exact_limit=9).is_exact
    a, b = Sketch.of(x[:5], exact_limit=10), Sketch.of(x[5:], exact_limit=10)
    assert a.merge(b).is_exact
    c = a.merge(b).merge(Sketch.of([11.0], exact_limit=10))
    assert not c.is_exact
    assert c.count == 11.0
    np.testing.assert_array_equal(c.to_array(), Sketch.of(np.arange(1.0, 12.0), exact_limit=10).to_array())
    # unit weights count as unweighted; any other weight forces buckets
    assert Sketch.of(x, weights=np.ones(10)).is_exact
    assert not Sketch.of(x, weights=np.full(10, 2.0)).is_exact


# ---------------------------------------------------------------------------------------- bucket accuracy

_DISTRIBUTIONS = {
    "lognormal": lambda rng: rng.lognormal(0.0, 1.5, N_BIG),
    "uniform01": lambda rng: rng.uniform(0.0, 1.0, N_BIG),
    "normal_mean3_std2": lambda rng: rng.normal(3.0, 2.0, N_BIG),
    "zeros20pct": lambda rng: np.where(
        rng.random(N_BIG) < 0.2, np.where(rng.random(N_BIG) < 0.5, 0.0, -0.0), rng.lognormal(0.0, 1.0, N_BIG)
    ),
}


@pytest.mark.parametrize("name", sorted(_DISTRIBUTIONS))
def test_bucket_relative_error_1e6(name: str) -> None:
    rng = np.random.default_rng(100 + sorted(_DISTRIBUTIONS).index(name))
    x = _DISTRIBUTIONS[name](rng)
    s = Sketch.of(x, exact_limit=4096)
    assert not s.is_exact
    assert s.count == N_BIG
    qs = (0.01, 0.1, 0.5, 0.95, 0.99)
    true = np.quantile(x, qs, method="linear")
    for q, t in zip(qs, true, strict=True):
        assert _rel_err(s.quantile(q), float(t)) <= 0.01, (name, q, s.quantile(q), t)
    assert _rel_err(s.median(), float(np.quantile(x, 0.5))) <= 0.01
    if name == "zeros20pct":
        assert s.quantile(0.1) == 0.0


def test_bucket_symmetric_normal_1e6() -> None:
    x = np.random.default_rng(7).normal(0.0, 1.0, N_BIG)
    s = Sketch.of(x)
    for q in (0.01, 0.05, 0.95, 0.99):
        t = float(np.quantile(x, q))
        assert abs(s.quantile(q) - t) <= 0.01 * abs(t), q
    assert abs(s.median() - float(np.quantile(x, 0.5))) <= 1e-3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=-1e300, max_value=1e300), min_size=1, max_size=300))
def test_bucket_quantile_within_rel_err_of_ranked_value(values: list[float]) -> None:
    s = Sketch.of(values, exact_limit=0, max_buckets=200_000)  # no folding over 1e-300..1e300
    xs = np.sort(np.array(values))
    for q in QS:
        x = float(xs[int(math.floor(q * (xs.size - 1)))])
        est = s.quantile(q)
        if abs(x) < 1e-300:
            assert est == 0.0
        else:
            assert abs(est - x) <= 0.005 * abs(x) * (1 + 1e-9), (q, x, est)


@pytest.mark.parametrize("x", [1.0, 0.3, 2.5e-7, 123456.789, 1e300, -1.0, -4.2, -7e-200, 1.7e308])
def test_bucket_representative_formula(x: float) -> None:
    est = Sketch.of([x], exact_limit=0).median()
    expect = _bucket_rep(x, 0.005) if abs(x) < 1e307 else None
    if expect is not None:
        assert est == pytest.approx(expect, rel=1e-12)
    assert abs(est - x) <= 0.005 * abs(x) * (1 + 1e-9)


# ---------------------------------------------------------------------------------------- merging


def test_merge_256_parts_equals_one_shot() -> None:
    rng = np.random.default_rng(2024)
    x = np.concatenate(
        [
            rng.normal(3.0, 2.0, 400_000),
            rng.lognormal(1.0, 2.0, 400_000),
            np.zeros(100_000),
            -rng.pareto(2.0, 100_000),
        ]
    )
    rng.shuffle(x)
    parts = _split(x, 256, rng)
    sizes = [p.size for p in parts]
    assert min(sizes) <= 4096 < max(sizes)  # a mix of exact and bucket parts
    one_shot = Sketch.of(x)
    merged = _random_merge([Sketch.of(p) for p in parts], rng)
    arr = one_shot.to_array()
    assert arr[12] < 4096 and arr[14] < 4096  # no store was folded
    np.testing.assert_array_equal(merged.to_array(), arr)  # same global bucket indices, same counts
    for q in (0.01, 0.5, 0.95, 0.99):
        t = float(np.quantile(x, q))
        assert merged.quantile(q) == one_shot.quantile(q)
        assert _rel_err(merged.quantile(q), t) <= 0.01


def test_merge_with_folding_still_equals_one_shot() -> None:
    rng = np.random.default_rng(5)
    x = np.concatenate([np.logspace(-200, 200, 20_000), -np.logspace(-100, 250, 20_000)])
    rng.shuffle(x)
    parts = _split(x, 64, rng)
    one_shot = Sketch.of(x, max_buckets=100)
    merged = _random_merge([Sketch.of(p, max_buckets=100) for p in parts], rng)
    np.testing.assert_array_equal(merged.to_array(), one_shot.to_array())


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e6, max_value=1e6), max_size=60),
    st.lists(st.floats(min_value=-1e6, max_value=1e6), max_size=60),
    st.lists(st.floats(min_value=-1e6, max_value=1e6), max_size=60),
    st.integers(1, 40),
    st.integers(0, 50),
)
def test_merge_associative_commutative(
    a: list[float], b: list[float], c: list[float], max_buckets: int, exact_limit: int
) -> None:
    kw = {"max_buckets": max_buckets, "exact_limit": exact_limit}
    sa, sb, sc = Sketch.of(a, **kw), Sketch.of(b, **kw), Sketch.of(c, **kw)
    left = sa.merge(sb).merge(sc).to_array()
    right = sa.merge(sb.merge(sc)).to_array()
    swapped = sc.merge(sb.merge(sa)).to_array()
    whole = Sketch.of(a + b + c, **kw).to_array()
    for arr in (right, swapped, whole):
        np.testing.assert_array_equal(arr, left)


def test_merge_does_not_mutate_and_identity() -> None:
    rng = np.random.default_rng(1)
    a, b = Sketch.of(rng.normal(size=5000)), Sketch.of(rng.normal(size=100))
    before = (a.to_array(), b.to_array())
    m = a.merge(b)
    assert m is not a and m is not b
    np.testing.assert_array_equal(a.to_array(), before[0])
    np.testing.assert_array_equal(b.to_array(), before[1])
    np.testing.assert_array_equal(a.merge(Sketch()).to_array(), before[0])
    np.testing.assert_array_equal(Sketch().merge(b).to_array(), before[1])
    assert m.count == 5100


def test_of_copies_input() -> None:
    x = np.array([3.0, 1.0, 2.0])
    s = Sketch.of(x)
    x[:] = 100.0
    assert s.median() == 2.0


# ---------------------------------------------------------------------------------------- serialisation


def _sample_sketches() -> list[Sketch]:
    rng = np.random.default_rng(3)
    return [
        Sketch(),
        Sketch.of([2.0, -1.0, 0.0, 5.5]),
        Sketch.of([1.0, math.nan, math.inf, -math.inf]),
        Sketch.of(rng.normal(size=10_000)),
        Sketch.of(rng.lognormal(size=300), weights=rng.random(300), rel_err=0.01),
        Sketch.of([math.nan, -math.inf, 0.0, -0.0, 3.0, math.inf, -2.0], exact_limit=0, max_buckets=16),
    ]


@pytest.mark.parametrize("idx", range(6))
def test_to_array_round_trip(idx: int) -> None:
    s = _sample_sketches()[idx]
    arr = s.to_array()
    assert arr.dtype == np.float64 and arr.ndim == 1
    r = Sketch.from_array(arr)
    np.testing.assert_array_equal(r.to_array(), arr)
    assert r.is_exact == s.is_exact
    assert r.count == s.count or (math.isnan(r.count) and math.isnan(s.count))
    for q in np.linspace(0, 1, 41):
        np.testing.assert_array_equal(r.quantile(float(q)), s.quantile(float(q)))
    np.testing.assert_array_equal(r.median(), s.median())
    np.testing.assert_array_equal(r.merge(s).to_array(), s.merge(s).to_array())
    assert repr(r) == repr(s)


def test_to_array_layout() -> None:
    arr = Sketch.of([3.0, 1.0, 2.0]).to_array()
    assert arr.size == HEADER + 3
    assert arr[2] == 0.0 and arr[3] == 0.005 and arr[4] == 1_000_000 and arr[5] == 4096 and arr[10] == 3
    np.testing.assert_array_equal(arr[HEADER:], [1.0, 2.0, 3.0])
    b = Sketch.of([1.0, -1.0, 0.0, math.inf], exact_limit=0).to_array()
    assert b[2] == 1.0 and b[8] == 1.0 and b[9] == 1.0 and b[12] == 1 and b[14] == 1
    assert b[11] == 0 and b[13] == 0  # log(1) = 0: bucket index 0 on both sides
    np.testing.assert_array_equal(b[HEADER:], [1.0, 1.0])


def test_from_array_rejects_garbage() -> None:
    good = Sketch.of([1.0, 2.0]).to_array()
    with pytest.raises(ValueError, match="magic"):
        Sketch.from_array(np.zeros(20))
    with pytest.raises(ValueError, match="elements"):
        Sketch.from_array(good[:-1])
    with pytest.raises(ValueError):
        Sketch.from_array(good[:5])
    bad = good.copy()
    bad[1] = 99.0
    with pytest.raises(ValueError, match="version"):
        Sketch.from_array(bad)


def test_arrays_are_read_only() -> None:
    s = Sketch.of(np.arange(10_000.0))
    with pytest.raises(ValueError):
        s._pos[0] = 5.0
    arr = s.to_array()
    arr[HEADER] = 1e9  # the exported array is a copy
    assert Sketch.of(np.arange(10_000.0)).to_array()[HEADER] == s.to_array()[HEADER]


# ---------------------------------------------------------------------------------------- weights


def test_integer_weights_equal_repetition() -> None:
    rng = np.random.default_rng(11)
    v = rng.normal(1.0, 3.0, 500)
    w = rng.integers(0, 5, 500).astype(np.float64)
    weighted = Sketch.of(v, weights=w, exact_limit=0)
    repeated = Sketch.of(np.repeat(v, w.astype(int)), exact_limit=0)
    np.testing.assert_array_equal(weighted.to_array(), repeated.to_array())
    assert weighted.count == w.sum()


def test_fractional_weights_quantile() -> None:
    rng = np.random.default_rng(12)
    v = rng.lognormal(0.0, 1.0, 20_000)
    w = rng.random(20_000) * 3
    s = Sketch.of(v, weights=w)
    order = np.argsort(v)
    cum = np.cumsum(w[order])
    for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
        i = min(int(np.searchsorted(cum, q * (cum[-1] - 1), side="right")), v.size - 1)
        x = v[order][i]
        assert abs(s.quantile(q) - x) <= 0.005 * x * (1 + 1e-9), q
    assert s.count == pytest.approx(w.sum(), rel=1e-12)


def test_zero_weights_are_ignored() -> None:
    s = Sketch.of([1.0, 1000.0, math.nan], weights=[2.0, 0.0, 0.0])
    assert s.quantile(1.0) == pytest.approx(1.0, rel=0.005)
    assert not math.isnan(s.median())
    assert Sketch.of([5.0], weights=[0.0]).count == 0.0
    assert math.isnan(Sketch.of([5.0], weights=[0.0]).quantile(0.5))


# ---------------------------------------------------------------------------------------- NaN, inf, zero


@pytest.mark.parametrize("exact_limit", [4096, 0])
def test_nan_propagates(exact_limit: int) -> None:
    s = Sketch.of([1.0, math.nan, 2.0], exact_limit=exact_limit)
    assert s.count == 3.0
    assert math.isnan(s.median()) and math.isnan(s.quantile(0.0)) and math.isnan(s.quantile(1.0))
    clean = Sketch.of([5.0, 6.0], exact_limit=exact_limit)
    assert not math.isnan(clean.median())
    assert math.isnan(clean.merge(s).median()) and math.isnan(s.merge(clean).quantile(0.3))
    assert Sketch.from_array(s.to_array()).count == 3.0


@pytest.mark.torch
def test_nan_matches_torch_exact() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([1.0, math.nan, 2.0], dtype=torch.float64)
    assert math.isnan(torch.median(t).item()) and math.isnan(Sketch.of(t.numpy()).median())


def test_inf_exact_mode() -> None:
    s = Sketch.of([math.inf, 1.0, -math.inf, 2.0])
    assert s.is_exact
    assert s.quantile(0.0) == -math.inf and s.quantile(1.0) == math.inf
    assert s.median() == 1.0 and s.quantile(0.5) == 1.5
    assert s.quantile(0.1) == -math.inf and s.quantile(0.9) == math.inf


def test_inf_bucket_mode() -> None:
    x = [-math.inf] * 10 + list(np.arange(1.0, 81.0)) + [math.inf] * 10
    s = Sketch.of(x, exact_limit=0)
    assert s.count == 100.0
    assert s.quantile(0.0) == -math.inf and s.quantile(0.09) == -math.inf
    assert s.quantile(1.0) == math.inf and s.quantile(0.91) == math.inf
    assert abs(s.quantile(0.11) - 1.0) <= 0.005 and abs(s.quantile(0.9) - 80.0) <= 0.4
    assert abs(s.median() - 40.0) <= 0.2
    merged = Sketch.of(x[:50]).merge(Sketch.of(x[50:], exact_limit=4096))
    assert merged.quantile(0.0) == -math.inf and merged.quantile(1.0) == math.inf


def test_zero_and_tiny_values() -> None:
    s = Sketch.of([0.0, -0.0, 1e-301, -5e-310, 2.0, -3.0], exact_limit=0)
    arr = s.to_array()
    assert arr[9] == 4.0  # all four go to the zero counter
    assert s.quantile(0.5) == 0.0
    assert _rel_err(s.quantile(1.0), 2.0) <= 0.005 and _rel_err(s.quantile(0.0), -3.0) <= 0.005


def test_empty_sketch() -> None:
    for s in (Sketch(), Sketch.of([]), Sketch.of([], weights=[]), Sketch.of(np.zeros(0), exact_limit=0)):
        assert s.count == 0.0
        assert math.isnan(s.median()) and math.isnan(s.quantile(0.5)) and math.isnan(s.quantile(0.0))
    assert Sketch.of(np.zeros(0)).merge(Sketch()).count == 0.0


# ---------------------------------------------------------------------------------------- size bound


def test_max_buckets_bound_wide_range() -> None:
    x = np.logspace(-300, 300, 100_000)
    data = np.concatenate([x, -x, np.zeros(100)])
    s = Sketch.of(data, exact_limit=4096)
    arr = s.to_array()
    assert arr[12] <= 4096 and arr[14] <= 4096 and arr.size <= HEADER + 2 * 4096
    # the large magnitudes keep the error bound; the folded low magnitudes are overstated
    xs = np.sort(data)
    for q in (0.0, 0.005, 0.01, 0.99, 0.995, 1.0):
        x = float(xs[int(q * (xs.size - 1))])
        assert abs(s.quantile(q) - x) <= 0.005 * abs(x) * (1 + 1e-9), q
    x = float(xs[int(0.6 * (xs.size - 1))])  # a positive value around 1e-60, folded into the lowest bucket
    assert x < 1e-50 and s.quantile(0.6) > 1e250
    merged = s.merge(Sketch.of(np.logspace(-250, 301, 1000), exact_limit=4096))
    marr = merged.to_array()
    assert marr[12] <= 4096 and marr[14] <= 4096
    assert _rel_err(merged.quantile(1.0), 1e301) <= 0.005
    small = Sketch.of(data, exact_limit=4096, max_buckets=10)
    assert small.to_array().size <= HEADER + 20


# ---------------------------------------------------------------------------------------- validation


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        Sketch.of([1.0, 2.0], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="non-negative"):
        Sketch.of([1.0, 2.0], weights=[1.0, math.nan])
    with pytest.raises(ValueError, match="finite"):
        Sketch.of([1.0, 2.0], weights=[1.0, math.inf])
    with pytest.raises(ValueError, match="shape"):
        Sketch.of([1.0, 2.0], weights=[1.0])
    with pytest.raises(ValueError, match="1-D"):
        Sketch.of([[1.0, 2.0]])
    s = Sketch.of([1.0, 2.0])
    for q in (-0.01, 1.01, math.nan, "0.5", None):
        with pytest.raises(ValueError, match="q must be"):
            s.quantile(q)  # type: ignore[arg-type]
    for kw in (
        {"rel_err": 0.0},
        {"rel_err": 1.0},
        {"max_buckets": 0},
        {"exact_limit": -1},
        {"exact_limit": 1.5},
    ):
        with pytest.raises(ValueError):
            Sketch(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different parameters"):
        Sketch(rel_err=0.01).merge(Sketch())
    with pytest.raises(TypeError):
        Sketch().merge([1.0])  # type: ignore[arg-type]


def test_scalar_and_numpy_q() -> None:
    s = Sketch.of(5.0)
    assert s.count == 1.0 and s.median() == 5.0
    assert Sketch.of([1.0, 3.0]).quantile(np.float64(0.5)) == 2.0


# ------------------------------------------------------------------------ public window / fold API
def _parts(draw_values: list[list[float]], params: dict, weighted: list[bool], rng) -> list[Sketch]:
    out = []
    for values, w in zip(draw_values, weighted):
        weights = rng.integers(0, 4, size=len(values)).astype(float) if w else None  # integers: exact sums
        out.append(Sketch.of(values, weights, **params))
    return out


wide_floats = st.one_of(
    st.floats(min_value=-1e30, max_value=1e30),  # NaN and infinities included
    st.sampled_from([0.0, -0.0, 1e-300, -5e-301]),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(wide_floats, max_size=40), min_size=1, max_size=6),
    st.integers(0, 30),
    st.integers(1, 40),
    st.lists(st.booleans(), min_size=6, max_size=6),
    st.integers(0, 2**32 - 1),
)
def test_summed_folds_are_the_merge(values, exact_limit, max_buckets, weighted, seed) -> None:
    """Folding every sketch on the covering window and adding the vectors gives the counts of
    Sketch.merge (in any merge order), with the lower buckets folded exactly as merge folds them."""
    rng = np.random.default_rng(seed)
    params = {"rel_err": 0.02, "exact_limit": exact_limit, "max_buckets": max_buckets}
    parts = _parts(values, params, weighted, rng)
    merged = _random_merge(parts, rng)
    window = BucketWindow.of(parts)
    total = np.sum([p.fold(window) for p in parts], axis=0)
    assert total.shape == (window.size,)
    assert np.array_equal(total, merged.fold(window))
    unfolded = Sketch.from_folded(total, window, **params)
    assert not unfolded.is_exact and unfolded.params == merged.params
    assert unfolded.count == merged.count
    if not merged.is_exact:  # the very same sketch: same window, same counts, no empty end buckets
        assert BucketWindow.of([merged]) == window
        assert np.array_equal(unfolded.to_array(), merged.to_array(), equal_nan=True)


def test_window_of_spans_folds_like_merge_at_the_limit() -> None:
    """Three stores 30 buckets apart, max_buckets=16: the window ends at the top bucket, 16 wide."""
    params = {"rel_err": 0.1, "exact_limit": 0, "max_buckets": 16}
    gamma = 1.1 / 0.9
    parts = [Sketch.of([gamma**k * 0.99], **params) for k in (0, 30, 60)]
    (_, (lo0, hi0)), (_, (lo2, hi2)) = parts[0].bucket_span(), parts[2].bucket_span()
    assert lo0 == hi0 and lo2 == hi2 == hi0 + 60
    window = BucketWindow.of(parts)
    assert window == BucketWindow.covering(None, (lo0, hi2), 16) == BucketWindow(0, 0, hi2 - 15, 16)
    folded = np.sum([p.fold(window) for p in parts], axis=0)
    assert folded[4:].tolist() == [2.0] + [0.0] * 14 + [1.0]  # the two lower values share the first bucket
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert np.array_equal(Sketch.from_folded(folded, window, **params).to_array(), merged.to_array())


def test_exact_sketch_spans_and_folds_as_its_bucket_form() -> None:
    v = np.array([-2.0, -0.5, 0.0, 1.0, 3.0, np.inf, np.nan])
    exact, buckets = Sketch.of(v), Sketch.of(v, exact_limit=0)
    assert exact.is_exact and not buckets.is_exact
    assert exact.bucket_span() == buckets.bucket_span()
    window = BucketWindow.of([exact])
    assert np.array_equal(exact.fold(window), buckets.fold(window))
    assert exact.fold(window)[:4].tolist() == [1.0, 0.0, 1.0, 1.0]  # NaN, -inf, +inf, zero
    assert Sketch().bucket_span() == (None, None) and BucketWindow.of([Sketch()]).size == 4
    assert BucketWindow.of([]) == BucketWindow()


def test_public_parameters_values_and_nan_count() -> None:
    s = Sketch.of([3.0, np.nan, 1.0], rel_err=0.01, exact_limit=10, max_buckets=7)
    assert s.params == {"rel_err": 0.01, "exact_limit": 10, "max_buckets": 7}
    assert (s.exact_limit, s.max_buckets, s.nan_count) == (10, 7, 1.0)
    assert s.values.tolist() == [1.0, 3.0] and not s.values.flags.writeable
    assert Sketch.of(s.values, **s.params).merge(s).count == 5.0
    with pytest.raises(ValueError, match="bucket-mode"):
        _ = Sketch.of([1.0], weights=[2.0]).values


def test_fold_and_from_folded_refuse_what_does_not_fit() -> None:
    s = Sketch.of([1.0, 100.0], exact_limit=0)
    (_, (lo, hi)) = s.bucket_span()
    with pytest.raises(ValueError, match="does not cover"):
        s.fold(BucketWindow(pos_lo=lo, pos_width=hi - lo))  # one short of the top bucket
    assert s.fold(BucketWindow(pos_lo=hi, pos_width=1))[4:].tolist() == [2.0]  # all folded into the top
    window = BucketWindow.of([s])
    with pytest.raises(ValueError, match="shape"):
        Sketch.from_folded(np.zeros(window.size + 1), window)
    with pytest.raises(ValueError, match="max_buckets"):
        Sketch.from_folded(np.zeros(20), BucketWindow(pos_width=16), max_buckets=8)
    with pytest.raises(ValueError, match="lowest above highest"):
        BucketWindow.covering(None, (3, 2), 8)


# ---------------------------------------------------------------------------------------- docs, deps


def test_doctests() -> None:
    result = doctest.testmod(sketch_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10
    assert result.failed == 0


def test_module_does_not_import_torch() -> None:
    tree = ast.parse(Path(sketch_module.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert "torch" not in names
    assert names <= {"__future__", "collections", "dataclasses", "fractions", "math", "numpy", "os", "typing"}


def test_reducing_a_sketch_leaves_the_callers_stat_as_it_was():
    """The state protocol's reduce reads the column's Stat; it must not attach the sketch to it (the
    engine's Stat of a column is read again, e.g. for its histogram)."""
    from rlmetrics.core.reduce import resolve
    from rlmetrics.core.stat import Stat

    stat = Stat.of([1.0, 2.0, 3.0])
    got = Sketch.of([1.0, 2.0, 3.0]).reduce("lat/p50", resolve("lat/p50"), stat)
    assert got == {"lat/p50": 2.0} and stat.sketch is None
