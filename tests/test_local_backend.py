"""The in-process backend with threads as ranks, through the seed's MetricClient API."""

import math
import random
import statistics
import threading
import time
import warnings

import numpy as np
import pytest

import rlmetrics
from rlmetrics.backends import local


@pytest.fixture
def name(request):
    yield request.node.name
    local.drop_worker(request.node.name)


def _batch(rank, step):
    rng = np.random.default_rng(1000 * step + rank)
    n = int(rng.integers(1, 3 + 7 * rank))  # unequal batch sizes across ranks
    return rng.normal(step, 1 + rank, size=n)


def test_threads_at_different_speeds_give_numpy_on_the_concatenation(name):
    world, steps = 8, 50
    results, errors = {}, []

    def rank(r):
        try:
            client = rlmetrics.connect("local", world_size=world, name=name, label=f"rank{r}")
            pace = random.Random(r)
            for step in range(steps):
                data = _batch(r, step)
                time.sleep(pace.random() * 0.002 * r)
                client.submit_metric({"reward/mean": data, "reward/max": data, "reward/std": data})
                client.submit_metric({"timing_s/gen": float(r), "perf/total_num_tokens": float(len(data))})
                client.wait_submit()
                if r == 0:  # no barrier: rank 0 reads each step as soon as it is complete
                    results[step] = client.result(step, timeout=30)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for step in range(steps):
        allv = np.concatenate([_batch(r, step) for r in range(world)])
        res = results[step]
        assert res.meta.complete, res.meta
        assert res["reward/mean"] == pytest.approx(allv.mean(), rel=1e-12)
        assert res["reward/max"] == allv.max()
        assert res["reward/std"] == pytest.approx(allv.std(), rel=1e-9)
        assert res["perf/total_num_tokens"] == len(allv)
        assert res["perf/delta_time/gen"] == pytest.approx(np.mean(range(world)))


def test_equal_weight_scalars_give_the_seeds_numbers(name):
    """The seed: per name, collect one value per rank, reduce with mean/max/min/sum by name."""
    rng = random.Random(5)
    world = 4
    names = ["critic/score/mean", "critic/score/max", "critic/score/min", "perf/total_num_tokens", "loss"]
    submitted = {n: [rng.uniform(-5, 5) for _ in range(world)] for n in names}
    worker = rlmetrics.LocalMetricWorker()
    clients = [rlmetrics.MetricClient(worker) for _ in range(world)]
    for r, client in enumerate(clients):
        client.submit_metric({n: submitted[n][r] for n in names}, world)
        client.wait_submit()
    final = clients[0].wait_final_res()
    seed = {"mean": statistics.mean, "max": max, "min": min, "sum": sum}
    expected = {
        "critic/score/mean": seed["mean"](submitted["critic/score/mean"]),
        "critic/score/max": seed["max"](submitted["critic/score/max"]),
        "critic/score/min": seed["min"](submitted["critic/score/min"]),
        "perf/total_num_tokens": seed["sum"](submitted["perf/total_num_tokens"]),
        "loss": seed["mean"](submitted["loss"]),
    }
    assert final.keys() == expected.keys()
    for n, v in expected.items():
        assert final[n] == pytest.approx(v, rel=1e-14, abs=1e-14)


def test_seed_worker_api_direct_submissions():
    worker = rlmetrics.LocalMetricWorker()
    worker.start()
    worker.submit_metric({"a": 1.0, "b/max": 2.0}, 2)
    worker.submit_metric({"a": 3.0, "b/max": 5.0}, 2)
    worker.stop()
    assert worker.wait_final_res() == {"a": 2.0, "b/max": 5.0}


def test_result_times_out_with_a_partial_step(name):
    fast = rlmetrics.connect("local", world_size=2, name=name, label="fast")
    slow = rlmetrics.connect("local", world_size=2, name=name, label="slow")
    slow.submit_metric({"a": 1.0})
    slow.wait_submit()  # step 0 closed by slow; it never sends step 1
    fast.submit_metric({"a": 3.0})
    fast.wait_submit()
    assert fast.result(0, timeout=5) == {"a": 2.0}
    fast.submit_metric({"a": 5.0})
    fast.wait_submit()
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="partial"):
        res = fast.result(1, timeout=0.3, finalize=True)
    assert 0.25 < time.monotonic() - t0 < 5
    assert res == {"a": 5.0}
    assert res.meta.missing_ranks[0].startswith("slow@")
    assert res.meta.missing_metrics == {"a": [1, 2]}


def test_bad_value_raises_naming_the_metric_and_the_rest_is_merged(name):
    client = rlmetrics.connect("local", world_size=1, name=name)
    with pytest.raises(rlmetrics.MetricValueError, match="bad/metric"):
        client.submit_metric({"good": 1.0, "bad/metric": "oops"})
    client.wait_submit()
    assert client.result(0, timeout=5) == {"good": 1.0}


def test_stop_means_no_step_waits_for_the_client(name):
    a = rlmetrics.connect("local", world_size=1, name=name)
    b = rlmetrics.connect("local", world_size=1, name=name)
    a.submit_metric({"a": 1.0})
    b.submit_metric({"b": 1.0})
    b.wait_submit()
    b.stop()
    a.wait_submit()
    a.submit_metric({"a": 2.0})
    a.wait_submit()
    assert a.result(1, timeout=5).meta.complete


def test_unknown_backend_and_missing_world_size():
    with pytest.raises(ValueError, match="unknown backend"):
        rlmetrics.connect("nope")
    client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker())
    with pytest.raises(ValueError, match="world_size"):
        client.submit_metric({"a": 1.0})
    with pytest.raises(TypeError, match="MetricWorker actor handle"):
        rlmetrics.MetricClient(object())


@pytest.mark.torch
def test_custom_metric_functions_run_with_the_built_ins_and_a_failing_one_is_skipped(name, caplog):
    torch = pytest.importorskip("torch")
    from rlmetrics.metrics.custom import register_metric, unregister_metric

    def tokens_seen(batch):
        return {"custom/tokens/total": batch["response_mask"].sum()}

    def broken(batch):
        raise RuntimeError("boom")

    register_metric(tokens_seen)
    register_metric(broken)
    try:
        client = rlmetrics.connect("local", world_size=1, name=name)
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        client.compute_local_data_metric({"response_mask": mask, "responses": torch.zeros(2, 3)})
        client.wait_submit()
        res = client.result(0, timeout=10)
    finally:
        unregister_metric(tokens_seen)
        unregister_metric(broken)
    assert res["custom/tokens/total"] == 3.0 and res["response/length/max"] == 2.0
    assert "broken" in caplog.text and "boom" in caplog.text


@pytest.mark.torch
def test_debug_metrics_reports_keys_and_warns_on_bad_values(name, monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    from rlmetrics.metrics.custom import debug_report

    monkeypatch.setenv("DEBUG_METRICS", "1")
    client = rlmetrics.connect("local", world_size=1, name=name)
    client.compute_local_data_metric({"response_mask": torch.ones(2, 3), "responses": torch.zeros(2, 3)})
    assert "DEBUG_METRICS data keys" in caplog.text and "response/length/mean" in caplog.text
    with pytest.warns(rlmetrics.NonFiniteWarning, match="not finite"):
        debug_report({}, {"x": float("nan")})
    with pytest.warns(rlmetrics.ValueWarning, match="invalid type"):
        debug_report({}, {"x": "text"})


def _validation_split():
    rng = np.random.default_rng(4)
    n = 24
    sources = ["gsm8k"] * 12 + ["math"] * 12
    prompts = [f"p{i % 3}" for i in range(n)]  # every prompt's samples end up on several ranks
    infos = {"acc": rng.integers(0, 2, n).astype(float).tolist(), "reward": rng.random(n).tolist(),
             "pred": [str(v) for v in rng.integers(0, 3, n)]}  # fmt: skip
    turns = rng.integers(1, 4, n).tolist()
    cuts = [0, 5, 13, n]
    parts = [
        ([sources[i] for i in range(a, b)], [prompts[i] for i in range(a, b)],
         {k: v[a:b] for k, v in infos.items()}, turns[a:b])
        for a, b in zip(cuts, cuts[1:])
    ]  # fmt: skip
    return (sources, prompts, infos, turns), parts


def test_validation_samples_split_over_ranks_give_the_single_process_result(name):
    from rlmetrics.metrics.validation import process_validation_metrics

    whole, parts = _validation_split()
    expected = process_validation_metrics(*whole)
    worker = rlmetrics.LocalMetricWorker()
    clients = [rlmetrics.MetricClient(worker, label=f"rank{r}") for r in range(3)]
    for r in (2, 0, 1):  # arrival order does not matter: ranks merge in label order
        clients[r].process_local_validation_metrics(*parts[r], world_size=3)
        clients[r].wait_submit()
    final = clients[0].wait_final_res()  # the seed's flow: submit, wait_submit, rank 0 wait_final_res
    assert final == expected
    assert any(k.startswith("val-core/gsm8k/acc/maj@") for k in final)


def test_a_step_read_at_a_deadline_wakes_its_other_readers():
    """A reader whose deadline finalizes a step wakes the readers of that step without one (as the
    Ray actor does): they return the same partial result instead of sleeping forever."""
    worker = local.LocalMetricWorker()
    rank = rlmetrics.MetricClient(worker, world_size=2)  # one of two contributions: never complete
    rank.submit_metric({"x": 1.0})
    rank.wait_submit()
    got = []
    waiter = threading.Thread(target=lambda: got.append(worker.result(0)), daemon=True)
    waiter.start()
    time.sleep(0.05)
    with pytest.warns(RuntimeWarning, match="partial"):
        partial = rlmetrics.MetricClient(worker).result(0, timeout=0.05, finalize=True)
    waiter.join(10)
    assert got == [partial] and got[0].meta.missing_metrics == {"x": [1, 2]}


def test_a_non_finite_value_warns_once_and_finite_values_whose_sum_overflows_do_not(name):
    """The reader's non-finite check: a NaN or inf value warns (once per name); values that are
    all finite never do, even where their sum overflows (the check's fast path sums them)."""
    client = rlmetrics.connect("local", world_size=1, name=name)
    client.submit_metric({"big/max": 1.5e308, "huge/max": 1.7e308, "x/mean": 1.0})
    client.wait_submit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert client.result(0)["huge/max"] == 1.7e308
    for step in (1, 2):
        client.submit_metric({"big/max": 1.5e308, "huge/max": 1.7e308, "x/mean": float("nan")})
        client.wait_submit()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert math.isnan(client.result(step)["x/mean"])
        warned = [str(w.message) for w in caught if "non-finite" in str(w.message)]
        assert warned == (["rlmetrics: non-finite value in metric(s) ['x/mean']"] if step == 1 else [])


def test_empty_dicts_and_tuple_keys_take_the_same_path_however_often_they_come(name):
    """The steady path for known names never queues an empty dict (no step, no late contribution)
    and never mistakes a dict with tuple keys for known names (it is refused, each time)."""
    client = rlmetrics.connect("local", world_size=1, name=name)
    for _ in range(3):
        client.submit_metric({}, step=7)
    client.flush()
    assert local._WORKERS[name].server.stats()["pending"] == []
    client.submit_metric({"a": 1.0})
    client.wait_submit()
    for _ in range(2):
        client.submit_metric({}, step=0)  # a step already final: nothing arrives late
        with pytest.raises(rlmetrics.MetricValueError, match="metric name must be a non-empty str"):
            client.submit_metric({("a",): 1.0, ("mean",): 2.0})
    client.submit_metric({"a": 3.0})
    client.wait_submit()
    res = client.result(1)
    assert res["a"] == 3.0 and res.meta.late == 0


def test_a_rank_closing_an_empty_round_ahead_of_the_reader_is_not_waited_for():
    """siiRL's rank 0 reads (``wait_final_res``) after the step's barrier, while the other ranks may
    already close the next round with nothing to send (a tp rank that never submits; an empty
    validation round). The read is about the step rank 0 closed, at once, not the empty one ahead at
    the deadline; once every rank closed the empty round, a read of it returns it, empty, at once."""
    worker = local.LocalMetricWorker(final_timeout=30)
    rank0, dp1, tp1 = (rlmetrics.MetricClient(worker) for _ in range(3))
    for client in (rank0, dp1):
        client.submit_metric({"x/mean": float(client is dp1)}, 2)
    for client in (rank0, dp1, tp1):  # every rank's wait_submit, then the barrier
        client.wait_submit()
    tp1.wait_submit()  # a non-submitting tp rank ran ahead into an empty round
    dp1.wait_submit()  # and so did a submitting rank
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = rank0.wait_final_res()
        assert (res.step, dict(res), res.meta.complete) == (0, {"x/mean": 0.5}, True)
        rank0.wait_submit()  # rank 0 closes the empty round too
        empty = rank0.wait_final_res()
    assert (empty.step, dict(empty), empty.meta.complete) == (1, {}, True)
    assert time.monotonic() - start < 5
