"""The step-keyed engine: exact merging, completion, partial results, idempotence, bad input."""

import dataclasses
import json
import logging
import math
import pickle

import numpy as np
import pytest

from rlmetrics import Stat, ValueWarning, register_reduction
from rlmetrics.core.stat import stats_of_rows
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.messages import StepMeta, SubmissionError, TorchFacts
from rlmetrics.packing import Packed, Schema, pack


def _feed(agg, step, parts, names=("x/mean", "x/max", "x/min", "x/std", "x/sum", "x/observations")):
    for r, values in enumerate(parts):
        agg.submit(f"r{r}", step, 0, len(parts), pack({n: values for n in names}))
        agg.close(f"r{r}", step)


@pytest.mark.parametrize("n_ranks", [1, 3, 8, 130])  # 130 > one fold of stacked contributions
def test_step_equals_numpy_on_concatenation(n_ranks):
    rng = np.random.default_rng(n_ranks)
    parts = [rng.normal(5, 3, size=rng.integers(0, 40)).tolist() for _ in range(n_ranks)]
    parts[0] = parts[0] or [1.0]
    register_reduction("x/observations", "count")
    agg = Aggregator()
    _feed(agg, 7, parts)
    assert agg.is_complete(7)
    res = agg.finalize(7)
    allv = np.concatenate([np.asarray(p, float) for p in parts])
    assert res.meta.complete and res.step == 7
    assert res["x/mean"] == pytest.approx(allv.mean(), rel=1e-12)
    assert res["x/std"] == pytest.approx(allv.std(), rel=1e-9)
    assert res["x/max"] == allv.max() and res["x/min"] == allv.min()
    assert res["x/sum"] == pytest.approx(allv.sum(), rel=1e-12, abs=1e-12)
    assert res["x/observations"] == len(allv)


def test_steps_never_mix_and_are_freed():
    agg = Aggregator()
    for step in range(5):
        for r in range(2):
            agg.submit(f"r{r}", step, 0, 2, pack({"a": float(step * 10 + r)}))
    for step in range(5):
        for r in range(2):
            agg.close(f"r{r}", step)
    assert [agg.finalize(s)["a"] for s in range(5)] == [s * 10 + 0.5 for s in range(5)]
    assert agg.pending_steps() == []
    assert not agg._steps and len(agg._finalized) == 0  # state of finalized steps is freed


def test_completion_waits_for_world_size_and_for_every_registered_client():
    agg = Aggregator()
    agg.submit("r0", 0, 0, 2, pack({"a": 1.0}))
    agg.close("r0", 0)
    assert not agg.is_complete(0)  # 'a' has 1 of 2 contributions
    agg.submit("r1", 0, 0, 2, pack({"a": 3.0}))
    assert not agg.is_complete(0)  # r1 has not closed the step: it may still send more
    agg.submit("r1", 0, 1, 1, pack({"only_r1": 3.0}))
    agg.close("r1", 0)
    assert agg.is_complete(0)
    assert dict(agg.finalize(0)) == {"a": 2.0, "only_r1": 3.0}


def test_partial_result_names_missing_ranks_and_metrics_and_logs_once_at_info(caplog):
    agg = Aggregator()
    for r in range(3):
        agg.submit(f"r{r}", 0, 0, 4, pack({"a": float(r), "b/max": float(r)}))
        agg.close(f"r{r}", 0)
    agg.submit("r3", 1, 0, 4, pack({"a": 1.0}))  # r3 registered, but never closes step 0
    with caplog.at_level(logging.INFO, logger="rlmetrics.engine.aggregator"):
        res = agg.finalize(0)
    # the reader's client warns; the engine (in the user's process, in-process) logs it below WARNING
    assert [r.levelno for r in caplog.records if "partial" in r.getMessage()] == [logging.INFO]
    assert res == {"a": 1.0, "b/max": 2.0}
    assert res.meta.complete is False
    assert res.meta.missing_ranks == ["r3"]
    assert res.meta.missing_metrics == {"a": [3, 4], "b/max": [3, 4]}
    assert res.meta.contributors == ["r0", "r1", "r2"]
    assert "r3" not in agg.clients  # missing at a deadline: not waited for until it submits again


def test_retries_are_merged_once_and_late_data_is_dropped():
    agg = Aggregator()
    p = pack({"a": 1.0})
    assert agg.submit("r0", 0, 0, 1, p) is True
    assert agg.submit("r0", 0, 0, 1, p) is False  # same (client, step, seq)
    assert agg.submit("r0", 0, 1, 1, pack({"a": 3.0})) is True
    agg.close("r0", 0)
    assert agg.finalize(0)["a"] == 2.0
    assert agg.submit("r0", 0, 2, 1, p) is False and agg.late == 1
    assert agg.finalize(0)["a"] == 2.0  # kept result, unchanged


def test_a_merged_contribution_of_several_clients_counts_every_client_once():
    agg = Aggregator()
    rows = np.array([[1.0, 10.0], [3.0, 30.0], [8.0, 80.0]])
    schema = pack({"a/mean": 0.0, "b/max": 0.0}).schema
    both = Packed(schema, stats_of_rows(rows[:2]), contributions=2)
    assert agg.submit_merged((("r0", 0), ("r1", 0)), 0, 3, both) is True
    assert agg.submit_merged((("r0", 0), ("r1", 0)), 0, 3, both) is False  # a retry
    with pytest.raises(SubmissionError, match="partly merged"):
        agg.submit_merged((("r1", 0), ("r2", 0)), 0, 3, both)
    assert agg.submit("r2", 0, 0, 3, Packed(schema, rows[2])) is True
    for r in ("r0", "r1", "r2"):
        agg.close(r, 0)
    assert agg.is_complete(0)
    assert agg.finalize(0) == {"a/mean": rows[:, 0].mean(), "b/max": 80.0}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("r", -1, 0, 1), "step"),
        (("r", 0, 0, 0), "world_size"),
        (("r", 0, 0, 1.5), "world_size"),
    ],
)
def test_bad_submissions_are_rejected_and_the_engine_keeps_serving(args, message):
    agg = Aggregator()
    with pytest.raises(SubmissionError, match=message):
        agg.submit(*args, pack({"a": 1.0}))
    agg.submit("r", 0, 0, 1, pack({"a": 2.0}))
    agg.close("r", 0)
    assert agg.finalize(0) == {"a": 2.0}


def test_malformed_packed_is_rejected():
    agg = Aggregator()
    schema = Schema.of(("a", "b"), ("mean", "mean"))
    with pytest.raises(SubmissionError, match="shape"):
        agg.submit("r", 0, 0, 1, Packed(schema, np.zeros((5, 3))))
    with pytest.raises(SubmissionError, match="repeats"):
        agg.submit("r", 0, 0, 1, Packed(Schema.of(("a", "a"), ("mean", "mean")), np.zeros((5, 2))))
    with pytest.raises(ValueError, match="unknown reduction"):
        agg.submit("r", 0, 0, 1, Packed(Schema.of(("a",), ("bogus",)), np.zeros((5, 1))))
    assert agg.pending_steps() == []


def test_pack_rejects_bad_values_by_name_and_keeps_the_rest():
    errors = {}
    p = pack(
        {"good": 1.0, "bad/str": "x", "bad/none": None, "bad/tuple": (1, 2, 3), "ok/list": [1, 2]},
        errors=errors,
    )
    assert p.schema.names == ("good", "ok/list")
    assert set(errors) == {"bad/str", "bad/none", "bad/tuple"}
    assert all(name in msg for name, msg in errors.items())
    with pytest.raises(ValueError, match="bad/str"):
        pack({"bad/str": "x"})


def test_nan_strategies(caplog):
    agg = Aggregator()
    agg.submit("r", 0, 0, 1, pack({"a": [1.0, math.nan], "b": 2.0}))
    agg.close("r", 0)
    with caplog.at_level(logging.DEBUG, logger="rlmetrics.engine.aggregator"):
        res = agg.finalize(0)
    assert [r.levelno for r in caplog.records if "non-finite value in metric(s) ['a']" in r.getMessage()] == [
        logging.DEBUG
    ]
    assert math.isnan(res["a"]) and res["b"] == 2.0
    assert pack({"a": [1.0, math.nan, 3.0], "b": math.nan}, "drop").stats[:, 0].tolist() == [
        2.0,
        4.0,
        2.0,
        1.0,
        3.0,
    ]
    assert pack({"b": math.nan}, "drop").stats[0].tolist() == [0.0]  # dropped: no observation
    with pytest.raises(ValueError, match="'a'"):
        pack({"a": [1.0, math.inf]}, "error")


def test_weighted_contributions_and_timing_rename():
    agg = Aggregator()
    agg.submit("r0", 0, 0, 2, pack({"timing_s/gen": 1.0, "adv/mean": Stat.of([1.0, 2.0, 3.0])}))
    agg.submit("r1", 0, 0, 2, pack({"timing_s/gen": 3.0, "adv/mean": (10.0, 3.0)}))
    agg.close("r0", 0), agg.close("r1", 0)
    res = agg.finalize(0)
    assert res["perf/delta_time/gen"] == 2.0
    assert res["adv/mean"] == pytest.approx((1 + 2 + 3 + 30) / 6)
    agg2 = Aggregator(renames={})  # renames can be turned off
    agg2.submit("r", 0, 0, 1, pack({"timing_s/gen": 1.0}))
    agg2.close("r", 0)
    assert "timing_s/gen" in agg2.finalize(0)


@pytest.mark.torch
def test_quantile_names_use_the_sketch_exactly_while_small():
    torch = pytest.importorskip("torch")

    rng = np.random.default_rng(3)
    parts = [rng.normal(size=rng.integers(1, 30)) for _ in range(5)]
    agg = Aggregator()
    for r, v in enumerate(parts):
        agg.submit(f"r{r}", 0, 0, 5, pack({"lat/median": v, "lat/p95": v, "lat/p99.9": v}))
        agg.close(f"r{r}", 0)
    res = agg.finalize(0)
    t = torch.tensor(np.concatenate(parts), dtype=torch.float64)
    assert res["lat/median"] == torch.median(t).item()
    assert res["lat/p95"] == pytest.approx(torch.quantile(t, 0.95).item(), rel=1e-12)
    assert res["lat/p99.9"] == pytest.approx(torch.quantile(t, 0.999).item(), rel=1e-12)


def test_empty_names_are_left_out_and_listed():
    agg = Aggregator()
    agg.submit("r", 0, 0, 1, pack({"a": [], "b": 1.0}))
    agg.close("r", 0)
    res = agg.finalize(0)
    assert res == {"b": 1.0} and res.meta.empty == ["a"]


def test_departed_client_is_not_waited_for():
    agg = Aggregator()
    agg.submit("r0", 0, 0, 1, pack({"a": 1.0}))
    agg.submit("r1", 0, 0, 1, pack({"b": 1.0}))
    agg.close("r0", 0)
    assert not agg.is_complete(0)
    agg.close("r1", 0)
    agg.depart("r1")
    agg.submit("r0", 1, 1, 1, pack({"a": 1.0}))
    agg.close("r0", 1)
    assert agg.is_complete(1)


def test_scalar_fast_path_and_mixed_schemas_over_many_blocks():
    """600 ranks: scalar contributions (1-D), data contributions (5-row) and two schemas in one step."""
    rng = np.random.default_rng(11)
    cache, agg = {}, Aggregator()
    per_name = {"s/mean": [], "s/max": [], "s/min": [], "extra/min": []}
    for r in range(600):
        if r % 3:
            v = float(rng.normal())
            p = pack({"s/mean": v, "s/max": v, "s/min": v}, schemas=cache)
            assert p.stats.ndim == 1 or r < 3  # steady state: one float per metric
            got = [v]
        else:
            got = rng.normal(size=rng.integers(1, 5)).tolist()
            p = pack({"s/mean": got, "s/max": got, "s/min": got, "extra/min": got}, schemas=cache)
            per_name["extra/min"] += got
        for n in ("s/mean", "s/max", "s/min"):
            per_name[n] += got
        agg.submit(f"r{r}", 0, 0, 600, p, register=False)
    res = agg.finalize(0)
    allv = np.asarray(per_name["s/mean"])
    assert res["s/mean"] == pytest.approx(allv.mean(), rel=1e-12, abs=1e-15)
    assert res["s/max"] == allv.max() and res["s/min"] == allv.min()
    assert res["extra/min"] == min(per_name["extra/min"])
    assert res.meta.missing_metrics == {"extra/min": [200, 600]}


def test_std_names_pool_data_but_average_per_rank_numbers():
    rng = np.random.default_rng(2)
    data = [rng.normal(size=n) for n in (3, 10, 40)]
    agg = Aggregator()
    for r, d in enumerate(data):
        agg.submit(f"r{r}", 0, 0, 3, pack({"loss/std": d}), register=False)
        with pytest.warns(ValueWarning, match="rank's std"):
            p = pack({"scalar/std": float(d.std())})
        agg.submit(f"r{r}", 0, 1, 3, p, register=False)
    res = agg.finalize(0)
    assert res["loss/std"] == pytest.approx(np.concatenate(data).std(), rel=1e-12)
    assert res["scalar/std"] == pytest.approx(np.mean([d.std() for d in data]), rel=1e-12)


def test_a_finalized_result_is_built_whole_and_never_patched():
    """Every fact of a step is in its meta from the start (StepMeta.of), and nobody changes a
    finalized result after: every reader of the step, and the saved state, get the same one."""
    engine = Aggregator(max_pending=1)
    engine.register("a")
    engine.register("b")
    engine.submit("a", 0, 0, 2, pack({"x/mean": 1.0}))
    engine.submit("a", 1, 0, 2, pack({"x/mean": 2.0}))  # step 0 is finalized stale
    res = engine.result(0)
    assert res.meta.stale and not res.meta.complete and res.meta.missing_metrics == {"x/mean": [1, 2]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.meta.stale = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.meta.contributions = [1, 2]
    with pytest.raises(TypeError, match="read-only"):
        res["x/mean"] = 5.0
    with pytest.raises(TypeError, match="read-only"):
        res.update({"y": 1.0})
    with pytest.raises(AttributeError, match="read-only"):
        res.step = 3
    assert engine.finalize(0) is res and dict(res) == {"x/mean": 1.0}
    again = pickle.loads(pickle.dumps(res))  # results travel pickled (Ray)
    assert dict(again) == dict(res) and again.step == 0 and again.meta == res.meta
    # facts the caller knows (a server's contributions and late) go in at finalization
    done = engine.finalize(1, contributions=(1, 2), late=3)
    assert done.meta.contributions == [1, 2] and done.meta.late == 3 and not done.meta.provisional
    assert engine.finalize(1, late=9).meta.late == 3  # a finalized step's result stays as it was
    peeked = Aggregator().peek(5, contributions=(0, 0))
    assert peeked.meta.provisional and peeked.meta.contributions == [0, 0]


def test_meta_of_an_older_file_reads_the_torch_facts():
    """The torch.distributed facts are one field (meta.torch) read as before (meta.exchange, ...),
    written as the keys they always were: a resumed run reads what an older run saved."""
    saved = {"contributors": [0, 1], "ranks": 2, "relayout": True, "exchange": "gather", "result_on": 0}
    meta = StepMeta.from_dict(saved)
    assert meta.torch == TorchFacts(ranks=2, relayout=True, exchange="gather", result_on=0)
    assert (meta.ranks, meta.relayout, meta.exchange, meta.result_on) == (2, True, "gather", 0)
    assert meta.complete and meta.to_dict() == saved
    assert json.dumps(meta.to_dict()) == json.dumps(saved)
    plain = StepMeta.from_dict({"complete": False, "missing_ranks": ["r1"]})
    assert plain.torch is None and plain.exchange is None and not plain.relayout
    assert "torch" not in plain.to_dict() and "ranks" not in plain.to_dict()
