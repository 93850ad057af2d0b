"""The validation estimators users asked for next (issue 33 point 4), each against an independent
computation: ``pass^k`` (all ``k`` correct) against the enumeration of all ``k``-subsets; maj@k with
``tie="none"`` (a tie is no majority) against all ordered ``k``-subsets, all ``n**k`` rows with
replacement and the bootstrap's own rows; ``missing=`` (``count_as_zero | drop | error``) against the
inputs rewritten by hand; samples split over ranks and merged against one process; the global numpy
RNG untouched; the new names through every tracker's rules."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlmetrics
from rlmetrics.core.values import MetricValueError
from rlmetrics.metrics.validation import (
    bootstrap_indices,
    bootstrap_sizes,
    encode_samples,
    merge_samples,
    process_samples,
    process_validation_metrics,
)


def strict_winner(row, preds):
    """The position whose value maj@k reports for a row of sample indices when a tie is no majority:
    the first position of the pred with the most votes, None when two or more preds share the top."""
    count, first = {}, {}
    for j in row:
        count[preds[j]] = count.get(preds[j], 0) + 1
        first.setdefault(preds[j], j)
    top = max(count.values())
    tops = [p for p in count if count[p] == top]
    return first[tops[0]] if len(tops) == 1 else None


def strict_value(row, vals, preds):
    j = strict_winner(row, preds)
    return 0.0 if j is None else vals[j]


def brute_force(vals, preds, k):
    """pass^k over every k-subset; strict maj over every ordered k-subset and every row of k draws
    with replacement (mean and population std)."""
    n = len(vals)
    subsets = list(itertools.combinations(range(n), k))
    ordered = list(itertools.permutations(range(n), k))
    out = {
        f"pass^{k}": np.mean([all(vals[j] == 1.0 for j in s) for s in subsets]),
        f"maj_strict@{k}/unbiased": np.mean([strict_value(r, vals, preds) for r in ordered]),
    }
    if n**k <= 5**5:  # all rows of k draws with replacement
        rows = [strict_value(r, vals, preds) for r in itertools.product(range(n), repeat=k)]
        out[f"maj_strict@{k}/exact_mean"], out[f"maj_strict@{k}/exact_var"] = np.mean(rows), np.var(rows)
    return out


def cases(max_n: int = 6):
    return st.integers(1, max_n).flatmap(
        lambda n: st.tuples(
            st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n),
            st.lists(st.sampled_from("abc"), min_size=n, max_size=n),
        )
    )


@settings(max_examples=60, deadline=None)
@given(cases())
def test_pass_hat_k_and_strict_majority_equal_the_enumeration(case):
    vals, preds = case
    n = len(vals)
    m = process_validation_metrics(["s"] * n, ["p"] * n, {"acc": vals, "pred": preds}, exact=True, tie="none")
    assert m["val-aux/s/acc/pass^1"] == pytest.approx(np.mean(vals), rel=1e-12, abs=1e-12)
    for k in bootstrap_sizes(n):
        for name, want in brute_force(vals, preds, k).items():
            if name.endswith("/exact_var"):  # the std is sqrt(E[x**2] - E[x]**2): compare its square
                got = m[f"val-aux/s/acc/{name[:-4]}_std"] ** 2
            else:
                got = m[f"val-aux/s/acc/{name}"]
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (k, name)
    assert not any("/maj@" in key for key in m)  # tie="none" names its keys maj_strict@k


@settings(max_examples=25, deadline=None)
@given(cases(8), st.integers(0, 2**32 - 1))
def test_strict_bootstrap_equals_its_rows_written_out(case, seed):
    """maj_strict@k/mean|std: the mean and population std over the seed's 1000 bootstrap rows of
    the strict rule, row by row."""
    vals, preds = case
    n = len(vals)
    m = process_validation_metrics(["s"] * n, ["p"] * n, {"acc": vals, "pred": preds}, seed=seed, tie="none")
    for k in bootstrap_sizes(n):
        rows = [strict_value(r, vals, preds) for r in bootstrap_indices(n, k, 1000, seed).tolist()]
        core = "val-core" if k == n else "val-aux"
        assert m[f"{core}/s/acc/maj_strict@{k}/mean"] == pytest.approx(np.mean(rows), rel=1e-12, abs=1e-12)
        assert m[f"{core}/s/acc/maj_strict@{k}/std"] == pytest.approx(np.std(rows), rel=1e-9, abs=1e-12)


def test_default_tie_rule_is_the_seeds():
    """tie="first" (the default) keeps the seed's keys and numbers; "none" differs only on ties."""
    infos = {"acc": [1.0, 0.0, 1.0, 0.0], "pred": ["a", "b", "a", "b"]}  # every 4-subset ties 2:2
    default = process_validation_metrics(["s"] * 4, ["q"] * 4, infos, exact=True)
    assert process_validation_metrics(["s"] * 4, ["q"] * 4, infos, exact=True, tie="first") == default
    assert default["val-aux/s/acc/maj@4/unbiased"] == 0.5  # the first pred of a uniform order wins
    strict = process_validation_metrics(["s"] * 4, ["q"] * 4, infos, exact=True, tie="none")
    assert strict["val-aux/s/acc/maj_strict@4/unbiased"] == 0.0
    with pytest.raises(ValueError, match="tie must be one of"):
        process_validation_metrics(["s"], ["q"], {"acc": [1.0]}, tie="last")


# ------------------------------------------------------------------------------- missing samples
SOURCES = ["math"] * 6 + ["code"] * 4
PROMPTS = ["p", "p", "p", "q", "q", "q", "r", "r", "r", "r"]
ACC = [1.0, None, 0.0, float("nan"), 1.0, 1.0, 0.0, 1.0, None, 1.0]
REWARD = [1.0, None, 0.0, float("nan"), 1.0, 1.0, 0.0, 1.0, None, 1.0]
PRED = ["4", None, "5", None, "7", "7", "x", "y", "z", "y"]
TURNS = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]


def renamed(m: dict, choice: str) -> dict:
    """Keys as ``missing=choice`` names them: ``<var>:<choice>`` and ``val/test_score:<choice>``."""
    out = {}
    for key, v in m.items():
        parts = key.split("/")
        if key.startswith("val/test_score/"):
            parts[1] += f":{choice}"
        elif len(parts) > 3 and parts[0] in ("val-core", "val-aux"):
            parts[2] += f":{choice}"
        out["/".join(parts)] = v
    return out


def failed_by_hand(infos: dict, choice: str) -> dict[str, float]:
    """``val-aux/<source>/<var>:<choice>/failed``: the None and NaN scores counted one by one."""
    out: dict[str, float] = {}
    for var in ("acc", "reward"):
        for src in sorted(set(SOURCES)):
            gone = [x is None or math.isnan(x) for x, s in zip(infos[var], SOURCES) if s == src]
            out[f"val-aux/{src}/{var}:{choice}/failed"] = float(sum(gone))
    return out


def split_failed(got: dict) -> tuple[dict, dict]:
    failed = {k: v for k, v in got.items() if k.endswith("/failed")}
    return {k: v for k, v in got.items() if k not in failed}, failed


def test_count_as_zero_equals_the_inputs_with_zeros():
    infos = {"acc": ACC, "reward": REWARD, "pred": PRED}
    got = process_validation_metrics(SOURCES, PROMPTS, infos, TURNS, exact=True, missing="count_as_zero")
    zeros = {v: [0.0 if x is None or math.isnan(x) else x for x in infos[v]] for v in ("acc", "reward")}
    want = process_validation_metrics(SOURCES, PROMPTS, {**zeros, "pred": PRED}, TURNS, exact=True)
    got, failed = split_failed(got)
    assert got == renamed(want, "count_as_zero")
    assert failed == failed_by_hand(infos, "count_as_zero") and sum(failed.values()) > 0
    assert got["val-core/math/acc:count_as_zero/mean@3"] == pytest.approx((1 / 3 + 2 / 3) / 2)


def test_drop_equals_the_inputs_without_the_failed_samples():
    infos = {"acc": ACC, "reward": REWARD, "pred": PRED}
    got = process_validation_metrics(SOURCES, PROMPTS, infos, TURNS, exact=True, missing="drop")
    keep = [i for i, x in enumerate(ACC) if not (x is None or math.isnan(x))]
    want = process_validation_metrics(
        [SOURCES[i] for i in keep], [PROMPTS[i] for i in keep],
        {v: [col[i] for i in keep] for v, col in infos.items()}, [TURNS[i] for i in keep], exact=True,
    )  # fmt: skip
    got, failed = split_failed(got)
    assert got == renamed(want, "drop")
    assert failed == failed_by_hand(infos, "drop") and sum(failed.values()) > 0
    assert got["val-core/math/acc:drop/mean@2"] == pytest.approx((1 / 2 + 1) / 2)


def test_error_names_the_variable_the_prompt_and_the_sample():
    with pytest.raises(MetricValueError, match=r"'acc': sample 1 \(data source 'math', prompt 'p'\)"):
        process_validation_metrics(SOURCES, PROMPTS, {"acc": ACC}, missing="error")
    with pytest.raises(ValueError, match="missing must be one of"):
        process_validation_metrics(SOURCES, PROMPTS, {"acc": ACC}, missing="zero")
    clean = process_validation_metrics(["s"] * 2, ["q"] * 2, {"acc": [1.0, 0.0]}, missing="error")
    assert clean["val-core/s/acc:error/mean@2"] == 0.5


def test_default_missing_rule_keeps_the_seeds_numbers_and_keys():
    infos = {"acc": ACC, "pred": PRED}
    default = process_validation_metrics(SOURCES, PROMPTS, infos, TURNS)
    got = process_validation_metrics(SOURCES, PROMPTS, infos, TURNS, missing=None)
    assert got.keys() == default.keys() and not any(":" in key for key in got)
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got.values(), default.values()))
    assert math.isnan(got["val-core/math/acc/mean@3"])  # a None further in a prompt is NaN (as before)


def test_records_of_different_rules_do_not_merge():
    a = encode_samples(["s"], ["p"], {"acc": [1.0]}, missing="drop")
    plain, strict = ({"missing": None}, {"missing": "drop", "tie": "none"})
    for other in (encode_samples(["s"], ["p"], {"acc": [1.0]}, **o) for o in (plain, strict)):
        with pytest.raises(ValueError, match="different tie or missing rules"):
            merge_samples([a, other])


# -------------------------------------------------------------------------------- over ranks
def split_case(draw_cuts: list[int], n: int):
    cuts = sorted({0, n, *(c % (n + 1) for c in draw_cuts)})
    return list(zip(cuts, cuts[1:]))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 14).flatmap(
        lambda n: st.tuples(
            st.lists(st.sampled_from([0.0, 1.0, None, float("nan")]), min_size=n, max_size=n),
            st.lists(st.sampled_from("ab"), min_size=n, max_size=n),
            st.lists(st.integers(0, 2), min_size=n, max_size=n),
            st.lists(st.integers(0, 20), max_size=4),
        )
    ),
    st.sampled_from(["count_as_zero", "drop"]),
    st.sampled_from(["first", "none"]),
)
def test_samples_split_over_ranks_give_the_single_process_result(case, missing, tie):
    acc, preds, prompt_ids, cuts = case
    n = len(acc)
    sources, prompts = ["s"] * n, [f"q{i}" for i in prompt_ids]
    infos = {"acc": acc, "pred": preds}
    options = {"exact": True, "tie": tie, "missing": missing}
    whole = process_validation_metrics(sources, prompts, infos, **options)
    parts = [
        encode_samples(sources[a:b], prompts[a:b], {k: v[a:b] for k, v in infos.items()}, **options)
        for a, b in split_case(cuts, n)
    ]
    merged = merge_samples(parts)
    assert process_samples(merged, exact=merged.exact) == whole


def choices_split():
    """Validation samples with failed sessions (None, NaN) and tied votes, as one process sees them
    and cut into 4 parts (a prompt's samples on several ranks)."""
    rng = np.random.default_rng(33)
    n = 32
    acc = rng.integers(0, 2, n).astype(float).tolist()
    for i in (3, 9, 17, 30):
        acc[i] = None if i % 2 else float("nan")
    infos = {"acc": acc, "pred": [str(v) for v in rng.integers(0, 3, n)]}
    prompts, turns = [f"p{i % 3}" for i in range(n)], rng.integers(1, 4, n).tolist()
    whole = (["gsm8k"] * 16 + ["math"] * 16, prompts, infos, turns)
    bounds = [0, 5, 13, 22, n]
    parts = [
        tuple({k: x[a:b] for k, x in v.items()} if isinstance(v, dict) else v[a:b] for v in whole)
        for a, b in zip(bounds, bounds[1:])
    ]
    return whole, parts


CHOICES = {"exact": True, "tie": "none", "missing": "count_as_zero"}


def test_local_backend_gives_the_single_process_result():
    whole, parts = choices_split()
    expected = process_validation_metrics(*whole, **CHOICES)
    assert "val-core/gsm8k/acc:count_as_zero/maj_strict@6/mean" in expected
    assert "val-aux/gsm8k/acc:count_as_zero/pass^6" in expected
    worker = rlmetrics.LocalMetricWorker()
    clients = [rlmetrics.MetricClient(worker, label=f"rank{r}") for r in range(4)]
    for r in (2, 0, 3, 1):
        clients[r].process_local_validation_metrics(*parts[r], world_size=4, **CHOICES)
        clients[r].wait_submit()
    assert clients[0].wait_final_res() == expected


# ---------------------------------------------------------------------------------- the RNG
def test_validation_leaves_the_global_numpy_rng_alone(monkeypatch):
    """verl reseeds numpy's global generator in validation (verl PR #7260); here every draw comes
    from a private RandomState: the global state is unchanged, and no global-state function runs."""
    np.random.seed(2026)
    np.random.random(7)  # mid-stream, so a reseed to any value shows
    before = np.random.get_state()
    for fn in ("seed", "choice", "randint", "random", "rand", "permutation", "shuffle"):
        monkeypatch.setattr(np.random, fn, lambda *a, _fn=fn, **k: pytest.fail(f"np.random.{_fn} called"))
    whole, _ = choices_split()
    for options in ({}, CHOICES, {"exact": True, "missing": "drop"}):
        process_validation_metrics(*whole, seed=7, **options)
    monkeypatch.undo()
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]


# ---------------------------------------------------------------------------------- the names
def test_new_names_through_every_tracker():
    """``^`` and ``:`` pass every tracker but MLflow and Prometheus unchanged; MLflow maps ``^`` to
    ``_`` (its set: letters, digits, ``_ - . space : /``), Prometheus every other character, and
    pass^k never meets pass@k there (``_at_``)."""
    from rlmetrics.sinks import TRACKERS, adapt_name

    for tracker in TRACKERS:
        hat = adapt_name("val-aux/math/acc:drop/pass^4", tracker)
        at = adapt_name("val-aux/math/acc:drop/pass@4", tracker)
        assert hat != at, tracker
        if tracker == "mlflow":
            assert (hat, at) == ("val-aux/math/acc:drop/pass_4", "val-aux/math/acc:drop/pass_at_4")
        elif tracker == "prometheus":  # [a-zA-Z0-9_] only
            assert (hat, at) == ("val_aux_math_acc_drop_pass_4", "val_aux_math_acc_drop_pass_at_4")
        else:
            assert hat == "val-aux/math/acc:drop/pass^4", tracker
