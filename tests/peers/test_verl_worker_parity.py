"""verl's worker-metric API: ``Metric``, ``AggregationType`` and ``reduce_metrics`` of
rlmetrics.integrations.verl against verl 0.9.1's ``verl.utils.metric``, and what ours accepts of verl's
own objects. The intended differences are asserted with both behaviours."""

import numpy as np
import pytest

pytest.importorskip("verl.utils.metric")
torch = pytest.importorskip("torch")

import verl.utils.metric as verl_metric  # noqa: E402

from rlmetrics.integrations import verl as ours  # noqa: E402

pytestmark = pytest.mark.torch

KINDS = ("mean", "sum", "min", "max")


def both(kind, values):
    """The same Metric in verl and here, built with append, extend and a tensor value."""
    made = []
    for module in (verl_metric, ours):
        m = module.Metric(aggregation=kind, value=values[0])
        m.append(torch.tensor(values[1]))
        m.extend(values[2:])
        made.append(m)
    return made


@pytest.mark.parametrize("kind", KINDS)
def test_metric_aggregate_matches_verl(kind):
    """append (numbers, one-element tensors), extend, aggregate, init_list, from_dict."""
    values = np.random.default_rng(KINDS.index(kind)).normal(size=7).tolist()
    theirs, mine = both(kind, values)
    assert mine.aggregation.value == theirs.aggregation.value == kind
    assert mine.values == pytest.approx(theirs.values)
    assert mine.aggregate() == pytest.approx(float(theirs.aggregate()), rel=1e-12)
    assert mine.init_list().values == [] and mine.init_list().aggregation is ours.AggregationType(kind)
    d = {"a": 1.0, "b": 2.5}
    assert {k: m.aggregate() for k, m in ours.Metric.from_dict(d, kind).items()} == {
        k: float(m.aggregate()) for k, m in verl_metric.Metric.from_dict(d, kind).items()
    }


@pytest.mark.parametrize("kind", KINDS)
def test_aggregate_dp_matches_verl(kind):
    """verl's dp aggregation over 4 ranks of 3 micro-batches: mean over ranks per micro-batch, then
    the aggregation (SUM: a sum of means); min/max over all values. Ours also takes verl's Metrics."""
    rng = np.random.default_rng(10 + KINDS.index(kind))
    table = rng.normal(size=(4, 3))
    theirs = [verl_metric.Metric(kind) for _ in range(4)]
    mine = [ours.Metric(kind) for _ in range(4)]
    for r in range(4):
        theirs[r].extend(table[r].tolist())
        mine[r].extend(table[r].tolist())
    expected = float(verl_metric.Metric.aggregate_dp(theirs))
    assert ours.Metric.aggregate_dp(mine) == pytest.approx(expected, rel=1e-12)
    assert ours.Metric.aggregate_dp(theirs) == pytest.approx(expected, rel=1e-12)
    reference = {
        "mean": table.mean(0).mean(),
        "sum": table.mean(0).sum(),
        "min": table.min(),
        "max": table.max(),
    }
    assert expected == pytest.approx(reference[kind], rel=1e-12)


def test_errors_match_verl():
    """The same ValueErrors: unknown aggregation, non-scalar tensor, unsupported value, mismatched
    aggregation in extend, unequal micro-batch counts and no metrics in aggregate_dp."""
    for module in (verl_metric, ours):
        with pytest.raises(ValueError):
            module.Metric("median")
        with pytest.raises(ValueError, match="scalar"):
            module.Metric("mean", torch.ones(2))
        with pytest.raises(ValueError, match="Unsupported value type"):
            module.Metric("mean", "1.0")
        with pytest.raises(ValueError, match="mismatch"):
            module.Metric("mean", 1.0).extend(module.Metric("max", 2.0))
        with pytest.raises(ValueError, match="same number of values"):
            module.Metric.aggregate_dp([module.Metric("mean", 1.0), module.Metric("mean")])
        with pytest.raises(ValueError, match="empty list"):
            module.Metric.aggregate_dp([])


def test_reduce_metrics_matches_verl():
    """Lists reduced by name (max / min / mean) and Metrics aggregated, ours taking verl's too."""
    rng = np.random.default_rng(3)
    lists = {
        name: rng.normal(size=5).tolist()
        for name in ("actor/pg_loss", "actor/pg_clipfrac", "perf/max_memory_allocated_gb",
                     "training/rollout_probs_diff_max", "training/rollout_probs_diff_min", "rollout_is_std")
    }  # fmt: skip
    metrics = {**lists, "actor/grad_norm": np.float64(1.5), "critic/vf_loss": verl_metric.Metric("sum", 2.0)}
    theirs = verl_metric.reduce_metrics(dict(metrics))
    mine = ours.reduce_metrics(metrics)
    assert mine.keys() == theirs.keys()
    assert mine == pytest.approx({k: float(v) for k, v in theirs.items()}, rel=1e-12)


def test_reduce_metrics_substring_verl_takes_min_we_take_the_mean():
    """Intended difference: verl picks min/max by substring, so ``actor/minibatch_loss`` and any
    name with ``minerva`` or ``admin`` report their minimum; we decide by whole tokens of the name
    and report the mean (``min`` / ``max`` as tokens still decide, as for verl)."""
    metrics = {
        "actor/minibatch_loss": [1.0, 2.0, 6.0],
        "val/minerva_math/score": [0.0, 1.0],
        "x/grad_max": [1.0, 4.0],
    }
    theirs = verl_metric.reduce_metrics(dict(metrics))
    mine = ours.reduce_metrics(metrics)
    assert theirs["actor/minibatch_loss"] == 1.0 and mine["actor/minibatch_loss"] == 3.0
    assert theirs["val/minerva_math/score"] == 0.0 and mine["val/minerva_math/score"] == 0.5
    assert theirs["x/grad_max"] == mine["x/grad_max"] == 4.0


def test_reduce_metrics_verl_writes_into_its_argument_we_do_not():
    """Intended difference: verl's ``reduce_metrics`` replaces the lists of the dict it is given and
    returns that dict; ours returns a new dict and leaves the argument as it was."""
    theirs_in, mine_in = {"loss": [1.0, 3.0]}, {"loss": [1.0, 3.0]}
    theirs = verl_metric.reduce_metrics(theirs_in)
    mine = ours.reduce_metrics(mine_in)
    assert theirs is theirs_in and theirs_in == {"loss": 2.0}
    assert mine is not mine_in and mine_in == {"loss": [1.0, 3.0]} and mine == {"loss": 2.0}


@pytest.mark.parametrize("kind", ["min", "max"])
def test_empty_min_max_verl_raises_we_report_nan(kind):
    """Intended difference: a min/max Metric without values raises in verl (numpy's empty
    reduction); ours aggregates to NaN, as an empty mean does in both."""
    with pytest.raises(ValueError):
        verl_metric.Metric(kind).aggregate()
    assert np.isnan(ours.Metric(kind).aggregate())
    assert np.isnan(ours.Metric("mean").aggregate())


def test_numpy_scalars_verl_refuses_we_take():
    """Intended difference: verl's ``Metric.append`` takes int, float, tensors and arrays only, so a
    numpy scalar such as ``np.float32`` or ``np.int64`` (what ``array.min()`` returns) raises; ours
    takes any real number."""
    for value in (np.float32(1.5), np.int64(2)):
        with pytest.raises(ValueError, match="Unsupported value type"):
            verl_metric.Metric("max", value)
        assert ours.Metric("max", value).aggregate() == float(value)
