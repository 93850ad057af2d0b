"""The ``exact=True`` validation estimators without bootstrap noise: best@k / worst@k / maj@k over all
k-subsets (``.../unbiased``) against brute-force enumeration of the subsets, their confidence
intervals across prompts against numpy on the per-prompt values, and verl PR #7240's case."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics.metrics.validation import bootstrap_sizes, pass_at_k, process_validation_metrics

Z95 = 1.959963984540054  # scipy.stats.norm.ppf(0.975): the documented 95 % interval


def row_majority(row, preds):
    """Index of the value maj reports for a row of sample indices: the most frequent pred, ties to
    the pred seen first, its first position (the bootstrap's rule, written out)."""
    count, first = {}, {}
    for j in row:
        count[preds[j]] = count.get(preds[j], 0) + 1
        first.setdefault(preds[j], j)
    top = max(count.values())
    return first[next(p for p in count if count[p] == top)]


def brute_force(vals, preds, k):
    """best/worst over every k-subset, maj over every ordered k-subset (a uniform order), averaged."""
    subsets = list(itertools.combinations(range(len(vals)), k))
    rows = list(itertools.permutations(range(len(vals)), k))
    return {
        f"best@{k}/unbiased": np.mean([max(vals[j] for j in s) for s in subsets]),
        f"worst@{k}/unbiased": np.mean([min(vals[j] for j in s) for s in subsets]),
        f"maj@{k}/unbiased": np.mean([vals[row_majority(r, preds)] for r in rows]),
    }


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(st.sampled_from([0.0, 1.0, 0.5, -2.0, 3.25]), min_size=n, max_size=n),
            st.lists(st.sampled_from("abc"), min_size=n, max_size=n),
        )
    )
)
def test_unbiased_estimators_equal_the_enumeration_of_all_k_subsets(case):
    vals, preds = case
    n = len(vals)
    m = process_validation_metrics(["s"] * n, ["p"] * n, {"reward": vals, "pred": preds}, exact=True)
    for k in bootstrap_sizes(n):
        for name, want in brute_force(vals, preds, k).items():
            assert m[f"val-aux/s/reward/{name}"] == pytest.approx(want, rel=1e-12, abs=1e-12), (k, name)
    if n == 1:
        assert not any("unbiased" in key for key in m)  # no k >= 2: nothing to estimate


def test_best_of_k_over_subsets_is_pass_at_k_for_correctness():
    rng = np.random.default_rng(3)
    acc = rng.integers(0, 2, size=8 * 12).astype(float).tolist()
    prompts = [f"q{i // 8}" for i in range(len(acc))]
    m = process_validation_metrics(["s"] * len(acc), prompts, {"acc": acc}, exact=True)
    for k in bootstrap_sizes(8):
        assert m[f"val-aux/s/acc/best@{k}/unbiased"] == pytest.approx(m[f"val-aux/s/acc/pass@{k}"], rel=1e-12)


def test_verl_pr_7240_one_correct_of_four():
    """1 correct answer of 4: the bootstrap's best@4 (with replacement) misses it in (3/4)**4 of its
    rows and reads about 0.684; over the one 4-subset, best@4 is 1.0 (= pass@4)."""
    m = process_validation_metrics(["math"] * 4, ["q"] * 4, {"acc": [1.0, 0.0, 0.0, 0.0]}, exact=True)
    assert m["val-core/math/acc/best@4/mean"] == pytest.approx(1 - 0.75**4, abs=0.03)  # 1000 draws
    assert m["val-aux/math/acc/best@4/exact_mean"] == pytest.approx(1 - 0.75**4, rel=1e-12)
    assert m["val-aux/math/acc/best@4/unbiased"] == 1.0
    assert m["val-aux/math/acc/pass@4"] == 1.0
    assert m["val-aux/math/acc/worst@4/unbiased"] == 0.0


def test_confidence_intervals_across_prompts_equal_numpy():
    """Per prompt, pass@k and best@k by enumeration; the interval is their mean over the data source's
    prompts plus or minus Z95 standard errors (numpy, ddof=1)."""
    rng = np.random.default_rng(11)
    n, n_prompts = 6, 9
    acc = rng.integers(0, 2, size=(n_prompts, n)).astype(float)
    reward = np.round(rng.normal(size=(n_prompts, n)), 2)
    preds = rng.choice(list("xyz"), size=(n_prompts, n))
    prompts = [f"q{i}" for i in range(n_prompts) for _ in range(n)]
    infos = {"acc": acc.ravel().tolist(), "reward": reward.ravel().tolist(), "pred": preds.ravel().tolist()}
    m = process_validation_metrics(["s"] * len(prompts), prompts, infos, exact=True)
    checked = 0
    for k in bootstrap_sizes(n):
        per_prompt = {
            f"acc/pass@{k}": [pass_at_k(n, int(row.sum()), k) for row in acc],
            **{
                f"reward/{name}": [
                    brute_force(r.tolist(), p.tolist(), k)[name] for r, p in zip(reward, preds)
                ]
                for name in (f"best@{k}/unbiased", f"worst@{k}/unbiased", f"maj@{k}/unbiased")
            },
        }
        for name, values in per_prompt.items():
            values = np.asarray(values, dtype=np.float64)
            half = Z95 * values.std(ddof=1) / math.sqrt(n_prompts)
            assert m[f"val-aux/s/{name}"] == pytest.approx(values.mean(), rel=1e-12)
            assert m[f"val-aux/s/{name}/ci_low"] == pytest.approx(values.mean() - half, rel=1e-9, abs=1e-12)
            assert m[f"val-aux/s/{name}/ci_high"] == pytest.approx(values.mean() + half, rel=1e-9, abs=1e-12)
            checked += 1
    assert checked == 4 * len(bootstrap_sizes(n))
    one = process_validation_metrics(["s"] * n, ["q"] * n, {"acc": acc[0].tolist()}, exact=True)
    assert not any(key.endswith("/ci_low") for key in one)  # one prompt: no interval
    from rlmetrics.metrics.validation.compute import Z95 as ours

    assert ours == Z95
