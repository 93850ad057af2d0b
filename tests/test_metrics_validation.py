"""Validation metrics: the vectorised implementation against a straightforward per-prompt loop."""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmetrics.metrics import validation
from rlmetrics.metrics.validation import (
    aggregate_validation_metrics,
    bootstrap,
    bootstrap_metric,
    calc_maj_val,
    encode_samples,
    merge_samples,
    pass_at_k,
    process_samples,
    process_validation_metrics,
)


# ------------------------------------------------------------------------------ the loop reference
def _sizes(n):
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return [*out, n] if n > 1 else []


def _row_majority(row, preds):
    """Index (into the prompt) of the value maj reports for one bootstrap row."""
    count, first = {}, {}
    for j in row:
        p = preds[j]
        if p not in count:
            count[p], first[p] = 0, j
        count[p] += 1
    top = max(count.values())
    return first[next(p for p in count if count[p] == top)]


def reference(data_sources, sample_inputs, infos_dict, sample_turns=(), seed=42, n_bootstrap=1000):
    """The issue's semantics, one prompt at a time (np.random.seed + np.random.choice per (prompt, k))."""
    tree = {}
    for i, (ds, prompt) in enumerate(zip(data_sources, sample_inputs)):
        by_var = tree.setdefault(ds, {}).setdefault(prompt, {})
        for var, col in infos_dict.items():
            by_var.setdefault(var, []).append(col[i])
    collected = {}  # ds -> var -> metric -> [per-prompt values]
    for ds, prompts in tree.items():
        for by_var in prompts.values():
            preds = by_var.get("pred")
            for var, vals in by_var.items():
                if isinstance(vals[0], str):
                    continue
                n = len(vals)
                x = np.asarray(vals, dtype=np.float64)
                m = {f"mean@{n}": np.mean(x)}
                if n > 1:
                    m[f"std@{n}"] = np.std(x)
                    for k in _sizes(n):
                        np.random.seed(seed)
                        idx = np.random.choice(n, size=(n_bootstrap, k), replace=True)
                        best, worst = np.max(x[idx], axis=1), np.min(x[idx], axis=1)
                        m[f"best@{k}/mean"], m[f"best@{k}/std"] = np.mean(best), np.std(best)
                        m[f"worst@{k}/mean"], m[f"worst@{k}/std"] = np.mean(worst), np.std(worst)
                        if preds is not None:
                            maj = np.array([x[_row_majority(row, preds)] for row in idx])
                            m[f"maj@{k}/mean"], m[f"maj@{k}/std"] = np.mean(maj), np.std(maj)
                for name, value in m.items():
                    collected.setdefault(ds, {}).setdefault(var, {}).setdefault(name, []).append(value)
    out = {}
    for ds, by_var in collected.items():
        core = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            n_max = max(int(name.split("@")[1].split("/")[0]) for name in metrics)
            for name, values in metrics.items():
                at = int(name.split("@")[1].split("/")[0])
                is_core = var == core and name.split("@")[0] in ("mean", "maj", "best") and at == n_max
                out[f"{'val-core' if is_core else 'val-aux'}/{ds}/{var}/{name}"] = np.mean(values)
    if len(sample_turns):
        turns = np.concatenate([np.atleast_1d(np.asarray(t, dtype=float)) for t in sample_turns])
        out["val-aux/num_turns/min"] = turns.min()
        out["val-aux/num_turns/max"] = turns.max()
        out["val-aux/num_turns/mean"] = turns.mean()
    if "reward" in infos_dict:
        rewards = {}
        for ds, r in zip(data_sources, infos_dict["reward"]):
            rewards.setdefault(ds, []).append(r)
        for ds, rs in rewards.items():
            out[f"val/test_score/{ds}"] = np.mean(rs)
    return out


def assert_same(ours, ref, tol=1e-12):
    assert set(ours) == set(ref), (sorted(set(ours) - set(ref))[:5], sorted(set(ref) - set(ours))[:5])
    for name, value in ref.items():
        if math.isnan(value):
            assert math.isnan(ours[name]), name
        else:
            assert ours[name] == pytest.approx(value, rel=tol, abs=tol), name


# ------------------------------------------------------------------------------------ random inputs
SOURCES = ("gsm8k", "minerva_math", "aime")


def random_batch(rng, n_prompts=14, max_n=64, pred="str", nan_rate=0.0, n_sources=3, interleave=True):
    """Samples of several prompts (sizes 1..max_n), interleaved, with acc / reward / score / pred."""
    sizes = rng.integers(1, max_n + 1, size=n_prompts)
    sizes[: min(4, n_prompts)] = rng.choice([1, 2, 3, max_n], size=min(4, n_prompts))  # edge sizes
    prompt_of = np.repeat(np.arange(n_prompts), sizes)
    if interleave:
        prompt_of = rng.permutation(prompt_of)
    source = rng.integers(0, n_sources, size=n_prompts)
    n = len(prompt_of)
    data_sources = [SOURCES[source[p]] for p in prompt_of]
    prompts = [f"question {p}?" for p in prompt_of]
    n_answers = rng.integers(1, 9, size=n_prompts)
    answer = rng.integers(0, n_answers[prompt_of])
    if rng.random() < 0.5:  # some prompts with nearly all-distinct answers (ties late in long rows)
        wide = rng.random(n_prompts) < 0.3
        answer = np.where(wide[prompt_of], rng.integers(0, 40, size=n), answer)
    acc = (answer == 0).astype(np.float64)
    reward = acc + rng.normal(0, 0.3, size=n).round(2)
    if nan_rate:
        reward[rng.random(n) < nan_rate] = np.nan
    infos = {
        "acc": acc.tolist(),
        "reward": reward.tolist(),
        "score": rng.integers(-2, 3, size=n).tolist(),
    }
    if pred == "str":
        infos["pred"] = [f"ans{a}" for a in answer]
    elif pred == "int":
        infos["pred"] = answer.tolist()
    turns = [rng.integers(1, 5, size=m) for m in np.diff([0, n // 2, n])]
    return data_sources, prompts, infos, turns


CASES = {
    "str-pred": dict(pred="str"),
    "int-pred": dict(pred="int"),
    "no-pred": dict(pred=None),
    "nan-reward": dict(pred="str", nan_rate=0.05),
    "one-source-small": dict(pred="str", n_prompts=30, max_n=9, n_sources=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_loop_reference(case):
    rng = np.random.default_rng(sorted(CASES).index(case))
    ds, prompts, infos, turns = random_batch(rng, **CASES[case])
    assert_same(process_validation_metrics(ds, prompts, infos, turns), reference(ds, prompts, infos, turns))


def test_matches_reference_with_other_seed_and_bool_acc():
    rng = np.random.default_rng(11)
    ds, prompts, infos, _ = random_batch(rng, n_prompts=12, max_n=20)
    infos["acc"] = [bool(a) for a in infos["acc"]]
    ours = process_validation_metrics(ds, prompts, infos, seed=3, n_bootstrap=200)
    assert_same(ours, reference(ds, prompts, infos, seed=3, n_bootstrap=200))


def test_small_chunks_give_the_same_numbers(monkeypatch):
    rng = np.random.default_rng(5)
    ds, prompts, infos, turns = random_batch(rng, n_prompts=30, max_n=40)
    whole = process_validation_metrics(ds, prompts, infos, turns, exact=True)
    monkeypatch.setattr(validation, "CHUNK_BYTES", 1)  # one prompt per chunk everywhere
    assert process_validation_metrics(ds, prompts, infos, turns, exact=True) == pytest.approx(
        whole, rel=1e-12, nan_ok=True
    )


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    n_preds=st.integers(1, 4),
    pred_kind=st.sampled_from(["str", "int", None]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_hypothesis_small_batches(sizes, n_preds, pred_kind, seed, data):
    n = sum(sizes)
    order = data.draw(st.permutations(list(np.repeat(np.arange(len(sizes)), sizes))))
    vals = data.draw(st.lists(st.sampled_from([0.0, 1.0, 0.5, -2.0, math.nan]), min_size=n, max_size=n))
    preds = data.draw(st.lists(st.integers(0, n_preds - 1), min_size=n, max_size=n))
    ds = [SOURCES[p % 2] for p in order]
    prompts = [f"p{p}" for p in order]
    infos = {"reward": vals, "acc": [float(v == 1.0) for v in vals]}
    if pred_kind == "str":
        infos["pred"] = [str(p) for p in preds]
    elif pred_kind == "int":
        infos["pred"] = preds
    ours = process_validation_metrics(ds, prompts, infos, seed=seed, n_bootstrap=64)
    assert_same(ours, reference(ds, prompts, infos, seed=seed, n_bootstrap=64))


# --------------------------------------------------------------------------------- the seed's pieces
def test_bootstrap_metric_equals_the_seeds_per_iteration_loop():
    data = [0.3, 1.5, -2.0, 4.0, 0.0, 1.0, 7.5]

    def seed_loop(data, k, fns, n_bootstrap=1000, seed=42):
        np.random.seed(seed)
        lists = [[] for _ in fns]
        for _ in range(n_bootstrap):
            idx = np.random.choice(len(data), size=k, replace=True)
            sample = [data[i] for i in idx]
            for lst, fn in zip(lists, fns):
                lst.append(fn(sample))
        return [(np.mean(lst), np.std(lst)) for lst in lists]

    fns = [np.max, np.min, np.mean, np.median, lambda s: s[0] - s[-1]]
    for k in (1, 3, 7, 12):
        ours = bootstrap_metric(data, k, fns, seed=9)
        for (m, s), (rm, rs) in zip(ours, seed_loop(data, k, fns, seed=9)):
            assert (m, s) == pytest.approx((rm, rs), rel=1e-12, abs=1e-12)
    votes = [{"pred": p, "val": v} for p, v in zip("abacbca", data)]

    def maj(sample):
        return calc_maj_val(sample, "pred", "val")

    [(m, s)] = bootstrap_metric(votes, 4, [maj], n_bootstrap=300, seed=1)
    [(rm, rs)] = seed_loop(votes, 4, [maj], n_bootstrap=300, seed=1)
    assert (m, s) == pytest.approx((rm, rs), rel=1e-12)


def test_calc_maj_val_ties_go_to_the_vote_seen_first():
    rows = [{"p": "b", "v": 1}, {"p": "a", "v": 2}, {"p": "a", "v": 3}, {"p": "b", "v": 4}]
    assert calc_maj_val(rows, "p", "v") == 1
    assert calc_maj_val(rows[1:], "p", "v") == 2
    assert calc_maj_val([{"p": 1, "v": 5}, {"p": 1.0, "v": 6}, {"p": 2, "v": 7}], "p", "v") == 5  # 1 == 1.0


def test_the_global_random_state_is_left_alone():
    np.random.seed(123)
    expected = np.random.random(3)
    np.random.seed(123)
    process_validation_metrics(["a"] * 4, ["p"] * 4, {"acc": [1, 0, 0, 1]})
    bootstrap_metric([1, 2, 3], 2, [np.max])
    assert np.array_equal(np.random.random(3), expected)


# ----------------------------------------------------------------------------- names and edge cases
def test_sections_core_variable_and_largest_n():
    ds = ["a"] * 6 + ["b"] * 2
    prompts = ["p"] * 4 + ["q"] * 2 + ["r"] * 2
    infos = {"reward": [1, 0, 1, 1, 0, 0, 1, 1], "pred": list("xyxxyyzz")}
    m = process_validation_metrics(ds, prompts, infos)
    core_a = sorted(k for k in m if k.startswith("val-core/a/"))
    core_metrics = ("best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std", "mean@4")
    assert core_a == [f"val-core/a/reward/{x}" for x in core_metrics]
    assert "val-aux/a/reward/best@2/mean" in m and "val-aux/a/reward/mean@2" in m  # not the largest @N
    alone = reference(["a"] * 4, ["p"] * 4, {"reward": [1, 0, 1, 1]})["val-aux/a/reward/best@2/mean"]
    assert m["val-aux/a/reward/best@2/mean"] == pytest.approx((alone + 0.0) / 2)  # over both prompts of a
    assert m["val/test_score/a"] == 0.5 and m["val/test_score/b"] == 1.0
    assert not any("/pred/" in k for k in m)  # string preds are not a variable

    with_acc = process_validation_metrics(["a"] * 2, ["p"] * 2, {"reward": [1, 0], "acc": [1, 1]})
    assert "val-core/a/acc/mean@2" in with_acc and "val-aux/a/reward/mean@2" in with_acc


def test_no_reward_and_integer_turns_do_not_crash():
    m = process_validation_metrics(["a", "a"], ["p", "p"], {"acc": [1, 0]}, sample_turns=[3, 5])
    assert not any(k.startswith("val/test_score") for k in m)
    assert (m["val-aux/num_turns/min"], m["val-aux/num_turns/max"], m["val-aux/num_turns/mean"]) == (3, 5, 4)
    turns = [np.array([1, 2]), np.array([6])]
    arrays = process_validation_metrics(["a"], ["p"], {"acc": [1]}, sample_turns=turns)
    assert arrays["val-aux/num_turns/mean"] == 3.0
    assert process_validation_metrics([], [], {}) == {}


def test_non_numbers_per_prompt():
    ds, prompts = ["a"] * 5, ["p", "p", "q", "q", "r"]
    mixed = {"note": ["x", "y", 1.0, 3.0, None], "pred": ["1", "1", "2", "2", "3"], "acc": [1, 0, 1, 1, 0]}
    m = process_validation_metrics(ds, prompts, mixed)
    # prompt p starts with a string and r with None: skipped; q counts
    assert m["val-aux/a/note/mean@2"] == 2.0 and "val-aux/a/note/mean@1" not in m
    with_none_inside = process_validation_metrics(["a"] * 2, ["p"] * 2, {"acc": [1.0, None]})
    assert math.isnan(with_none_inside["val-core/a/acc/mean@2"])  # a non-number inside a prompt is NaN
    ints = process_validation_metrics(["a"] * 3, ["p"] * 3, {"acc": [1, 0, 1], "pred": [7, 8, 7]})
    assert ints["val-aux/a/pred/mean@3"] == pytest.approx(22 / 3) and "val-aux/a/pred/maj@2/mean" in ints


def test_nan_propagates_like_numpy():
    # prompt p has a NaN reward: its mean/std are NaN, and so are the means over bootstrap rows (some
    # rows draw the NaN), hence the data source's averages; maj is NaN only if a NaN is the chosen value
    infos = {"reward": [np.nan, 1.0, 0.0, 1.0], "pred": ["u", "v", "w", "w"]}
    m = process_validation_metrics(["a"] * 4, ["p", "p", "q", "q"], infos)
    for name in ("mean@2", "best@2/mean", "best@2/std", "maj@2/mean"):
        assert math.isnan(m[f"val-core/a/reward/{name}"]), name
    for name in ("std@2", "worst@2/mean"):
        assert math.isnan(m[f"val-aux/a/reward/{name}"]), name
    assert math.isnan(m["val/test_score/a"])
    infos = {"reward": [1.0, 1.0, np.nan], "pred": list("xxy")}
    single = process_validation_metrics(["a"] * 3, ["p"] * 3, infos)
    assert_same(single, reference(["a"] * 3, ["p"] * 3, infos))
    assert math.isnan(single["val-core/a/reward/best@3/mean"])


# ------------------------------------------------------------------------------------- distributed
def _split(ds, prompts, infos, turns, cuts):
    bounds = [0, *cuts, len(ds)]
    parts = []
    for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        parts.append(
            encode_samples(ds[lo:hi], prompts[lo:hi], {k: v[lo:hi] for k, v in infos.items()}, [turns[r]])
        )
    return parts


def test_one_prompt_split_over_three_ranks_equals_single_process():
    n = 48
    ds, prompts = ["math"] * n, ["the one prompt"] * n
    rng = np.random.default_rng(0)
    infos = {
        "acc": rng.integers(0, 2, n).astype(float).tolist(),
        "reward": rng.normal(size=n).tolist(),
        "pred": [f"a{i}" for i in rng.integers(0, 4, n)],
    }
    turns = [np.array([1, 2]), np.array([3]), np.array([4, 5])]
    records = _split(ds, prompts, infos, turns, [10, 30])
    merged = merge_samples(pickle.loads(pickle.dumps(records)))  # as if sent over the wire
    direct = process_validation_metrics(ds, prompts, infos, turns, exact=True)
    assert process_samples(merged, exact=True) == direct  # exactly, not approximately
    # why records and not results: averaging the ranks' own results is not the same number
    per_rank = [process_samples(r) for r in records]
    averaged = np.mean([next(v for k, v in m.items() if k.endswith("acc/best@8/mean")) for m in per_rank])
    assert averaged != pytest.approx(direct["val-aux/math/acc/best@8/mean"])


def test_random_splits_merge_exactly():
    rng = np.random.default_rng(42)
    ds, prompts, infos, _ = random_batch(rng, n_prompts=30, max_n=24)
    n = len(ds)
    turns = [np.arange(3), np.arange(2), np.zeros(0, int), np.arange(4)]
    cuts = sorted(rng.choice(np.arange(1, n), size=2, replace=False).tolist())
    records = _split(ds, prompts, infos, turns, [cuts[0], cuts[0], cuts[1]])  # rank 1 is empty
    assert records[1].n_samples == 0
    merged = merge_samples(records)
    direct = encode_samples(ds, prompts, infos, turns)
    for key in ("sources", "prompts", "pred_table"):
        assert getattr(merged, key) == getattr(direct, key)
    for key in ("group", "group_source", "pred", "turns"):
        assert np.array_equal(getattr(merged, key), getattr(direct, key))
    assert process_samples(merged, seed=7, exact=True) == process_validation_metrics(
        ds, prompts, infos, turns, seed=7, exact=True
    )
    digests = [encode_samples(ds[:cuts[0]], prompts[:cuts[0]], {k: v[:cuts[0]] for k, v in infos.items()},
                              digest_prompts=True),
               encode_samples(ds[cuts[0]:], prompts[cuts[0]:], {k: v[cuts[0]:] for k, v in infos.items()},
                              digest_prompts=True)]  # fmt: skip
    assert all(isinstance(p, bytes) and len(p) == 16 for p in digests[0].prompts)
    assert process_samples(merge_samples(digests)) == process_validation_metrics(ds, prompts, infos)


def test_merge_mixed_string_columns_and_mismatched_variables():
    a = encode_samples(["s"] * 2, ["p"] * 2, {"v": ["x", "y"], "acc": [1, 0]})
    b = encode_samples(["s"] * 2, ["q"] * 2, {"v": [1.0, 2.0], "acc": [1, 1]})
    merged = merge_samples([a, b])
    assert merged.numeric["v"].tolist() == [False, False, True, True]
    assert process_samples(merged) == process_validation_metrics(
        ["s"] * 4, ["p", "p", "q", "q"], {"v": ["x", "y", 1.0, 2.0], "acc": [1, 0, 1, 1]}
    )
    with pytest.raises(ValueError, match="different variables"):
        merge_samples([a, encode_samples(["s"], ["p"], {"acc": [1]})])
    with pytest.raises(ValueError, match="pred"):
        merge_samples([a, encode_samples(["s"], ["p"], {"v": [1], "acc": [1], "pred": ["x"]})])


def test_order_of_prompts_does_not_matter_but_order_within_a_prompt_does():
    rng = np.random.default_rng(8)
    ds, prompts, infos, _ = random_batch(rng, n_prompts=20, max_n=16, interleave=False)
    blocks = {}
    for i, p in enumerate(prompts):
        blocks.setdefault(p, []).append(i)
    perm = [i for p in rng.permutation(list(blocks)) for i in blocks[p]]  # prompts reordered, samples not

    def take(idx):
        return (
            [ds[i] for i in idx],
            [prompts[i] for i in idx],
            {k: [c[i] for i in idx] for k, c in infos.items()},
        )

    base = process_validation_metrics(ds, prompts, infos, exact=True)
    assert process_validation_metrics(*take(perm), exact=True) == pytest.approx(base, rel=1e-12, nan_ok=True)
    shuffled = rng.permutation(len(ds)).tolist()  # also reorders samples within prompts
    other = process_validation_metrics(*take(shuffled), exact=True)
    order_free = [
        k
        for k in base
        if "@" not in k or "exact" in k or k.rsplit("/", 1)[-1].startswith(("mean@", "std@", "pass@"))
    ]
    assert {k: other[k] for k in order_free} == pytest.approx({k: base[k] for k in order_free}, rel=1e-9)
    assert any(other[k] != pytest.approx(base[k], rel=1e-9) for k in base if "best@2/mean" in k)


# ------------------------------------------------------------------------------------- exact extras
def test_pass_at_k_against_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-14)
    big = 1.0 - math.comb(100, 100) / math.comb(200, 100)
    assert pass_at_k(200, np.array([1, 100]), 100) == pytest.approx([0.5, big])


def _enumerate_bootstrap(vals, preds, k):
    """Exact mean and std of best/worst/maj over all n**k equally likely rows."""
    n = len(vals)
    rows = list(itertools.product(range(n), repeat=k))
    out = {}
    series = {
        "best": [max(vals[j] for j in r) for r in rows],
        "worst": [min(vals[j] for j in r) for r in rows],
        "maj": [vals[_row_majority(r, preds)] for r in rows],
    }
    for name, xs in series.items():
        out[f"{name}@{k}/exact_mean"], out[f"{name}@{k}/exact_std"] = np.mean(xs), np.std(xs)
    return out


@pytest.mark.parametrize(
    "vals,preds",
    [
        ([0.0, 1.0, 1.0, 0.0, 1.0], list("aabbc")),
        ([0.2, -1.0, 3.0, 3.0], list("xyyx")),  # two classes of two: ties in every other row
        ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], list("abcdef")),
        ([1.0, 0.0, 0.5], list("zzz")),
    ],
)
def test_exact_expectations_against_enumeration(vals, preds):
    n = len(vals)
    m = process_validation_metrics(["s"] * n, ["p"] * n, {"reward": vals, "pred": preds}, exact=True)
    for k in _sizes(n):
        for name, value in _enumerate_bootstrap(vals, preds, k).items():
            assert m[f"val-aux/s/reward/{name}"] == pytest.approx(value, rel=1e-10, abs=1e-12), (k, name)
    assert "val-aux/s/reward/pass@2" not in m or set(vals) <= {0.0, 1.0}


def test_exact_majority_with_mixed_class_counts_in_one_chunk():
    """Prompts with 1..4 distinct preds share a chunk (padded classes); each its own data source."""
    cases = [
        ([0.5, 1.0, -1.0, 2.0], list("aaaa")),
        ([0.5, 1.0, -1.0, 2.0], list("abab")),
        ([3.0, 1.0, 0.0, 2.0], list("abca")),
        ([0.0, 1.0, 0.0, 1.0], list("dcba")),
    ]
    ds = [f"s{i}" for i, (vals, _) in enumerate(cases) for _ in vals]
    prompts = [f"p{i}" for i, (vals, _) in enumerate(cases) for _ in vals]
    infos = {
        "reward": [v for vals, _ in cases for v in vals],
        "pred": [p for _, preds in cases for p in preds],
    }
    m = process_validation_metrics(ds, prompts, infos, exact=True)
    for i, (vals, preds) in enumerate(cases):
        for k in (2, 4):
            for name, value in _enumerate_bootstrap(vals, preds, k).items():
                assert m[f"val-aux/s{i}/reward/{name}"] == pytest.approx(value, rel=1e-10, abs=1e-12), (
                    i,
                    name,
                )


def test_exact_expectations_are_the_limit_of_the_bootstrap():
    rng = np.random.default_rng(2)
    ds, prompts, infos, _ = random_batch(rng, n_prompts=6, max_n=40, n_sources=1)
    big = process_validation_metrics(ds, prompts, infos, n_bootstrap=20000)
    exact = process_validation_metrics(ds, prompts, infos, exact=True)
    checked = 0
    for name, value in exact.items():
        if name.endswith("/exact_mean"):
            seed_name = name.replace("/exact_mean", "/mean").replace("val-aux", "val-core")
            approx = big.get(seed_name, big.get(seed_name.replace("val-core", "val-aux")))
            assert value == pytest.approx(approx, abs=0.02), name
            checked += 1
    assert checked > 20


def test_exact_keys_and_pass_at_k_names():
    batch = (["s"] * 8, ["p"] * 4 + ["q"] * 4, {"acc": [1, 0, 0, 1, 1, 0, 0, 0], "reward": [0.5] * 8})
    m = process_validation_metrics(*batch, exact=True)
    plain = process_validation_metrics(*batch)
    assert {k: m[k] for k in plain} == plain  # the seed's keys are unchanged
    extra = sorted(set(m) - set(plain))
    assert all(k.startswith("val-aux/") for k in extra)
    assert m["val-aux/s/acc/pass@1"] == pytest.approx(3 / 8)
    assert m["val-aux/s/acc/pass@4"] == 1.0  # both prompts have a correct sample
    assert m["val-aux/s/acc/pass@2"] == pytest.approx((1 - 1 / 6 + 1 - 3 / 6) / 2)  # 1 - C(n-c,2)/C(4,2)
    assert "val-aux/s/reward/pass@2" not in m  # 0.5 is not a correctness value
    expected_best = ((1 - (1 / 2) ** 4) + (1 - (3 / 4) ** 4)) / 2  # 1 - (1 - c/n)**k, averaged
    assert m["val-aux/s/acc/best@4/exact_mean"] == pytest.approx(expected_best)


# -------------------------------------------------------------------------------------- aggregate
def test_aggregate_validation_metrics_nested_with_pooled_std():
    rng = np.random.default_rng(4)
    ds, prompts, infos, _ = random_batch(rng, n_prompts=10, max_n=12)
    nested = aggregate_validation_metrics(ds, prompts, infos)
    flat = process_validation_metrics(ds, prompts, infos)
    for src, by_var in nested.items():
        for var, metrics in by_var.items():
            for name, value in metrics.items():
                if name == "pooled_std":
                    continue
                key = f"val-core/{src}/{var}/{name}"
                key = key if key in flat else key.replace("val-core", "val-aux", 1)
                assert value == flat[key] or (math.isnan(value) and math.isnan(flat[key]))
    assert not any(name.startswith("std@") for v in nested.values() for m in v.values() for name in m)
    # pooled std of `score` per data source, straight from its definition
    for src in nested:
        groups = {}
        for d, p, x in zip(ds, prompts, infos["score"]):
            if d == src:
                groups.setdefault(p, []).append(x)
        multi = [np.asarray(g, float) for g in groups.values() if len(g) > 1]
        if multi:
            ss = sum(((g - g.mean()) ** 2).sum() for g in multi)
            expected = math.sqrt(ss / sum(len(g) - 1 for g in multi))
            assert nested[src]["score"]["pooled_std"] == pytest.approx(expected, rel=1e-12)
        else:
            assert "pooled_std" not in nested[src]["score"]


def test_majority_tie_words_beyond_32_positions():
    """Rows where the winning classes first appear after position 32 exercise the second tie word."""
    n = k = 64
    rng = np.random.default_rng(1)
    preds = rng.integers(0, 48, size=n)
    vals = rng.normal(size=n)
    idx = validation.bootstrap_indices(n, k)
    dense, n_classes = bootstrap.dense_codes(preds[None, :])
    words = bootstrap._tie_words(idx, n)
    assert len(words) == 2
    winners = bootstrap._majority_winners(dense, n_classes, words, idx)[0]
    expected = np.array([_row_majority(row, preds.tolist()) for row in idx])
    assert np.array_equal(winners, expected)
    first_pos = np.array([list(row).index(j) for row, j in zip(idx.tolist(), expected)])
    assert (first_pos >= 32).sum() >= 5  # the case is really exercised
    assert np.array_equal(vals[winners], vals[expected])


# ------------------------------------------------------------------ large prompts: bounded memory
def one_large_prompt(n, seed=0, answers=6):
    rng = np.random.default_rng(seed)
    preds = rng.integers(0, answers, size=n)
    infos = {"acc": (preds == 0).astype(float).tolist(), "reward": rng.normal(size=n).round(2).tolist()}
    infos["pred"] = [f"ans{p}" for p in preds]
    return ["math"] * n, ["the one prompt"] * n, infos


@pytest.mark.slow
def test_a_prompt_too_large_to_keep_its_bootstrap_rows_equals_the_loop_reference():
    """300 samples of one prompt: its largest k draw their bootstrap rows a chunk at a time (their
    indices and tie words would pass SHARED_MAX), and still equal the seed's loop."""
    assert bootstrap._shared_bytes(300, 256, 1000) > bootstrap.SHARED_MAX
    ds, prompts, infos = one_large_prompt(300)
    assert_same(process_validation_metrics(ds, prompts, infos), reference(ds, prompts, infos))


@pytest.mark.parametrize("tie", ["first", "none"])
def test_bootstrap_rows_give_the_vectorised_numbers(monkeypatch, tie):
    """Every prompt and k forced through the chunked rows (SHARED_MAX below every shape), in blocks of
    prompts and chunks of rows: the vectorised path's numbers (to float rounding), NaN, ties and
    one-class prompts included."""
    rng = np.random.default_rng(3)
    ds, prompts, infos, turns = random_batch(rng, n_prompts=20, max_n=40, nan_rate=0.05)
    whole = process_validation_metrics(ds, prompts, infos, turns, tie=tie)
    monkeypatch.setattr(bootstrap, "SHARED_MAX", -1)
    monkeypatch.setattr(bootstrap, "CHUNK_BYTES", 8 * 1024)  # several chunks of rows per k
    rows = process_validation_metrics(ds, prompts, infos, turns, tie=tie)
    assert_same(rows, whole)


def test_one_prompt_of_many_samples_costs_bounded_memory():
    """A record of 2,000 samples of one prompt with preds: the aggregator's computation peaks below
    256 MiB (the tie words of every k kept: 3 GB) and keeps less than 64 MiB (its caches) after."""
    import tracemalloc

    ds, prompts, infos = one_large_prompt(2000)
    tracemalloc.start()
    try:
        metrics = process_validation_metrics(ds, prompts, infos)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 2**20 and kept < 64 * 2**20 and "val-core/math/acc/maj@2000/mean" in metrics


def test_exact_majority_stops_at_its_largest_k():
    """exact=True on one prompt of 600 samples: maj@k's exact keys up to MAJ_MAX_K (256), the others
    (pass@k, best/worst exact and unbiased) for every k, and the bootstrap maj@600 as always."""
    from rlmetrics.metrics.validation.exact import MAJ_MAX_K

    ds, prompts, infos = one_large_prompt(600, answers=3)
    m = process_validation_metrics(ds, prompts, infos, exact=True)
    base = "val-aux/math/acc"
    assert f"{base}/maj@{MAJ_MAX_K}/exact_mean" in m and f"{base}/maj@512/exact_mean" not in m
    assert {f"{base}/pass@600", f"{base}/best@600/unbiased", "val-core/math/acc/maj@600/mean"} <= set(m)


def test_a_large_prompt_split_over_three_ranks_equals_one_process():
    """The seed's loop on 3 local ranks (process_local_validation_metrics, wait_submit, the reader's
    result): a 600-sample prompt split unevenly over them takes the rows path at the aggregator and
    equals process_validation_metrics on the concatenated samples."""
    import rlmetrics
    from rlmetrics.backends import local

    ds, prompts, infos = one_large_prompt(600, seed=4)
    cuts = [0, 150, 420, 600]
    ranks = [rlmetrics.connect("local", world_size=3, name="big-val", rank=r) for r in range(3)]
    reader = rlmetrics.connect("local", name="big-val")
    try:
        for r, client in reversed(list(enumerate(ranks))):  # arrival order does not matter
            lo, hi = cuts[r], cuts[r + 1]
            client.process_local_validation_metrics(
                ds[lo:hi], prompts[lo:hi], {k: v[lo:hi] for k, v in infos.items()}
            )
            client.wait_submit()
        merged = dict(reader.result(0, timeout=60, finalize=True))
    finally:
        local.drop_worker("big-val")
    assert bootstrap._shared_bytes(600, 512, 1000) > bootstrap.SHARED_MAX
    assert_same(merged, process_validation_metrics(ds, prompts, infos))
