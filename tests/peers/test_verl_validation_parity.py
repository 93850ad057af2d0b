"""``process_validation_metrics``: rlmetrics.integrations.verl against verl 0.9.1 (1e-9).

verl reseeds ``np.random.seed(seed)`` before every ``np.random.choice`` as siiRL does, so the
bootstrap keys agree to float rounding; its nested return, ``None`` values dropped per prompt and
``expected_acc_counts`` are compared key by key.
"""

import math

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.metric_utils")

from verl.trainer.ppo.metric_utils import process_validation_metrics as verl_validation  # noqa: E402

from rlmetrics.integrations.verl import process_validation_metrics  # noqa: E402

pytestmark = pytest.mark.torch

REL = 1e-9


def assert_nested_same(ours, theirs):
    assert set(ours) == set(theirs)
    for source, by_var in theirs.items():
        assert set(ours[source]) == set(by_var), source
        for var, metrics in by_var.items():
            assert set(ours[source][var]) == set(metrics), (source, var)
            for name, value in metrics.items():
                mine = ours[source][var][name]
                same = (
                    math.isclose(mine, value, rel_tol=REL, abs_tol=REL)
                    or math.isnan(mine)
                    and math.isnan(value)
                )
                assert same, (source, var, name, mine, value)


def random_validation(seed: int, *, none_rate: float = 0.0, pred_none_rate: float = 0.0):
    """Data sources (one named ``minerva_math``), prompts with 1 to 16 samples, interleaved; ``acc``
    0/1, a float ``reward``, a string ``pred`` with few classes (ties in votes), a string variable;
    ``None`` in acc and reward at ``none_rate``, in pred at ``pred_none_rate``."""
    rng = np.random.default_rng(seed)
    sources, uids = [], []
    for s, source in enumerate(["gsm8k", "minerva_math", "aime"][: 2 + seed % 2]):
        for q in range(int(rng.integers(2, 6))):
            n = 16 if q == 0 else int(rng.choice([1, 2, 3, 5, 8, 16]))
            sources += [source] * n
            uids += [f"{source}-{q}-{s}"] * n
    order = rng.permutation(len(sources))
    sources = np.asarray(sources, dtype=object)[order]  # verl's trainer concatenates numpy arrays
    uids = [uids[i] for i in order]
    size = len(uids)
    acc = rng.integers(0, 2, size).astype(float).tolist()
    reward = rng.normal(size=size).round(2).tolist()
    pred = [str(v) for v in rng.integers(0, 3, size)]
    for values, rate in ((acc, none_rate), (reward, none_rate), (pred, pred_none_rate)):
        for i in np.flatnonzero(rng.random(size) < rate):
            values[i] = None
    infos = {"acc": acc, "reward": reward, "pred": pred, "text": [f"answer {i}" for i in range(size)]}
    return sources, uids, infos


@pytest.mark.parametrize("seed", range(3))
def test_every_key_matches_verl(seed):
    """Every ``{source: {var: {metric}}}`` value: mean/std@n, best/worst/maj@k over prompts of up to
    16 samples."""
    sources, uids, infos = random_validation(seed)
    assert_nested_same(
        process_validation_metrics(sources, uids, infos), verl_validation(sources, uids, infos)
    )


@pytest.mark.parametrize("seed", range(2))
def test_none_values_dropped_per_prompt_as_verl(seed):
    """``None`` values leave their prompt (its ``n`` is the count of the others, per variable: keys
    like ``mean@14`` next to ``mean@16``); a prompt with a ``None`` pred, or a variable that lost a
    value, has no ``maj@k``; with the 4th positional argument (the seed) and another seed."""
    sources, uids, infos = random_validation(seed, none_rate=0.15, pred_none_rate=0.05)
    theirs = verl_validation(sources, uids, infos, 7)
    ours = process_validation_metrics(sources, uids, infos, 7)
    assert_nested_same(ours, theirs)
    sizes = {
        int(name[5:])
        for by_var in ours.values()
        for m in by_var.values()
        for name in m
        if name.startswith("mean@")
    }
    assert sizes - {1, 2, 3, 5, 8, 16}  # prompts that lost values


def test_none_values_are_not_nan():
    """The issue's example: ``None`` in acc made rlmetrics' ``mean@8`` NaN; verl drops them."""
    infos = {"acc": [1.0, None, 0.0, 1.0, None, 1.0, 1.0, 0.0]}
    theirs = verl_validation(["a"] * 8, ["p"] * 8, infos)
    ours = process_validation_metrics(["a"] * 8, ["p"] * 8, infos)
    assert set(theirs["a"]["acc"]) == set(ours["a"]["acc"]) and "mean@6" in ours["a"]["acc"]
    assert ours["a"]["acc"]["mean@6"] == pytest.approx(4 / 6)
    assert_nested_same(ours, theirs)


@pytest.mark.parametrize("seed", range(2))
def test_expected_acc_counts_match_verl(seed):
    """``expected_acc_counts`` pads ``acc`` with zeros up to the expected sessions (a prompt without
    samples gets one), adds ``acc_success_only``, and leaves data sources without ``acc`` alone."""
    sources, uids, infos = random_validation(seed, none_rate=0.1)
    rng = np.random.default_rng(seed + 100)
    expected = {(s, u): int(rng.integers(0, 20)) for s, u in sorted(set(zip(sources.tolist(), uids)))}
    expected[("gsm8k", "never-sampled")] = 4
    expected[("no-such-source", "x")] = 3
    theirs = verl_validation(sources, uids, infos, expected_acc_counts=expected)
    ours = process_validation_metrics(sources, uids, infos, expected_acc_counts=expected)
    assert "acc_success_only" in ours["gsm8k"] and "no-such-source" not in ours
    assert_nested_same(ours, theirs)


def test_reward_only_sources_keep_their_variables_with_expected_counts():
    """A data source whose ``acc`` is all None is not padded (verl: only sources that define acc)."""
    infos = {"acc": [1.0, 0.0, None, None], "reward": [0.5, 0.25, 1.0, 0.0]}
    sources, uids = ["a", "a", "b", "b"], ["p", "p", "q", "q"]
    expected = {("a", "p"): 4, ("b", "q"): 4}
    theirs = verl_validation(sources, uids, infos, expected_acc_counts=expected)
    assert_nested_same(process_validation_metrics(sources, uids, infos, expected_acc_counts=expected), theirs)
    assert "acc" not in theirs["b"]


def test_string_inside_a_numeric_prompt_verl_raises_we_count_nan():
    """Intended difference: a string after a number in a prompt's values makes verl's ``np.mean``
    raise; we count it as NaN (with a warning), so the prompt's metrics are NaN and the others stay."""
    infos = {"acc": [1.0, "n/a", 0.0, 1.0]}
    with pytest.raises(TypeError):
        verl_validation(["a"] * 4, ["p", "p", "q", "q"], infos)
    ours = process_validation_metrics(["a"] * 4, ["p", "p", "q", "q"], infos)
    assert math.isnan(ours["a"]["acc"]["mean@2"])
    with_nan = process_validation_metrics(["a"] * 4, ["p", "p", "q", "q"], {"acc": [1.0, math.nan, 0.0, 1.0]})
    assert_nested_same(ours, with_nan)
