"""The differential harness's "slips" layout: the users' loops on Ray rank actors (one client each)
with the slips of issue 45, every step compared with the single-process computation on the data
that was sent (``tests/harness.py``'s families and references):

- verl's loop: the trainer's 1-based ``global_steps`` passed to every call, the driver reading
  ``result(global_steps, timeout, finalize=True)`` and logging each result through ``make_sinks``,
  one step twice (a retried iteration); one rank killed (``ray.kill``) without ``set_world_size``;
- the seed's loop: the clients' own counters and ``wait_final_res()``, one rank that catches a
  ``MetricValueError`` and skips its ``wait_submit()``;
- a driver whose step base is off by one from the ranks' (it reads step 1 while the ranks close 0).
"""

from __future__ import annotations

import math
import time
import uuid
import warnings

import pytest

import rlmetrics
from rlmetrics.sinks import make_sinks, read_jsonl

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.ray, pytest.mark.slow]

from tests.harness import check, draw_scenarios, expected, ray_ranks, run_rank  # noqa: E402

SLIP_STEPS = 4
DEADLINE_S = 60.0  # the driver's deadline: a read that waits for it failed to know better


def no_validation(sc: dict) -> dict:
    """Validation names depend on which ranks hold samples: a lost rank's share would change them."""
    for spec in sc["steps"]:
        spec["val"] = [0] * sc["world"]
    return sc


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_verl_loop_a_killed_rank_and_a_step_logged_twice_equal_the_data_sent(ray_session, tmp_path, caplog):
    """Trainer steps 1-4; rank 2 is killed before its calls of step 3. Step 3 is final soon after
    (not at the 60 s deadline), partial, naming rank2, and equals the survivors' concatenation; step 4
    is complete over the survivors without ``set_world_size``. Step 2 is logged twice: the JSONL file
    holds each step once, with the values read."""
    ray = ray_session
    (sc,) = draw_scenarios(1, world=3, n_steps=SLIP_STEPS)
    no_validation(sc)
    actors = ray_ranks(ray, 3)
    name = f"slips-{uuid.uuid4().hex[:8]}"
    worker = rlmetrics.get_metric_worker(name=name)
    driver = rlmetrics.connect("ray", name=name)
    got = {}
    try:
        ray.get([a.client.remote(name, sc) for a in actors])
        with make_sinks(["jsonl"], tmp_path, health=False) as tracking:
            for step in range(SLIP_STEPS):
                at = step + 1  # verl's global_steps
                if step == 2:
                    ray.kill(actors[2])
                alive = actors[:2] if step >= 2 else actors
                ray.get([a.run.remote(name, run_rank, sc, r, step, 1) for r, a in enumerate(alive)])
                start = time.monotonic()
                got[at] = driver.result(at, timeout=DEADLINE_S, finalize=True)
                waited = time.monotonic() - start
                if step < 2:
                    check(sc, step, got[at], at=at)
                else:
                    assert waited < DEADLINE_S / 2, (at, waited)  # the lost rank was known, not waited for
                    check(sc, step, got[at], ranks=[0, 1], at=at, whole=step > 2)
                caplog.clear()
                tracking.log(got[at], at)
                if at == 2:  # a retried iteration logs its step again: skipped, said once
                    tracking.log(got[at], at)
                    said = [r for r in caplog.records if "step 2 is logged already" in r.getMessage()]
                    assert len(said) == 1, caplog.records
        assert [r.split("@")[0] for r in got[3].meta.missing_ranks] == ["rank2"], got[3].meta
    finally:
        ray.kill(worker)
        for a in actors[:2]:
            ray.kill(a)
    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.steps == [1, 2, 3, 4]
    for record in run.records:
        at = record["step"]
        want = expected(sc, at - 1, ranks=None if at < 3 else [0, 1])
        logged = record["metrics"]
        bad = {
            k: (logged.get(k), v)
            for k, v in want.items()
            if not (math.isclose(logged.get(k, math.nan), v, rel_tol=1e-5, abs_tol=1e-8) or
                    (math.isnan(v) and math.isnan(logged.get(k, 0.0))))
        }  # fmt: skip
        assert not bad, (at, bad)


def slipped_rank(client, sc: dict, rank: int, step: int) -> None:
    """The seed's calls of ``step`` on the client's own counter, then a bad value whose
    ``MetricValueError`` the rank catches, and no ``wait_submit()`` (as trainers guard metrics code)."""
    try:
        from tests.harness import METRICS, rank_step, shard

        common = rank_step(sc, rank, step)
        for metric in METRICS:
            if metric.when(sc["steps"][step]):
                metric.submit(client, shard(metric, sc, rank, step, common), sc["world"], None)
        client.submit_metric({"actor/bad": "not a number"}, sc["world"])
        client.wait_submit()
    except rlmetrics.MetricValueError:
        pass


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_seed_loop_a_rank_that_skips_a_close_loses_no_later_step(ray_session):
    """The seed's loop (counters, ``wait_final_res()``); rank 1 skips its close of step 1 after a
    caught error. Step 1 ends at the reader's deadline without rank 1 (the survivors'
    concatenation); steps 2 and 3 are complete and equal every rank's data: rank 1 was realigned."""
    ray = ray_session
    (sc,) = draw_scenarios(1, world=3, n_steps=SLIP_STEPS)
    no_validation(sc)
    actors = ray_ranks(ray, 3)
    name = f"slips-{uuid.uuid4().hex[:8]}"
    worker = rlmetrics.get_metric_worker(name=name, final_timeout=5.0)
    driver = rlmetrics.MetricClient(worker)
    try:
        ray.get([a.client.remote(name, sc) for a in actors])
        for step in range(SLIP_STEPS):
            calls = [
                a.run.remote(name, slipped_rank if (step, r) == (1, 1) else run_rank, sc, r, step,
                             *(() if (step, r) == (1, 1) else (None,)))
                for r, a in enumerate(actors)
            ]  # fmt: skip
            ray.get(calls)
            res = driver.wait_final_res()
            if step == 1:
                check(sc, step, res, ranks=[0, 2])
            else:
                check(sc, step, res)
    finally:
        ray.kill(worker)
        for a in actors:
            ray.kill(a)


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_a_driver_one_step_ahead_of_the_ranks_loses_nothing(ray_session):
    """The ranks count from 0, the driver reads verl's 1-based step with ``finalize=True``: a read of
    a step nothing arrived for finalizes nothing and says where the ranks are, and every step the
    ranks closed is still whole when read at its own number."""
    ray = ray_session
    (sc,) = draw_scenarios(1, world=2, n_steps=2)
    actors = ray_ranks(ray, 2)
    name = f"slips-{uuid.uuid4().hex[:8]}"
    worker = rlmetrics.get_metric_worker(name=name)
    driver = rlmetrics.connect("ray", name=name)
    try:
        ray.get([a.client.remote(name, sc) for a in actors])
        ray.get([a.run.remote(name, run_rank, sc, r, 0, None) for r, a in enumerate(actors)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ahead = driver.result(1, timeout=1.0, finalize=True)  # verl's first global_steps
        assert not ahead and not ahead.meta.complete and ahead.meta.provisional, ahead.meta
        assert any("step 0" in str(w.message) for w in caught), [str(w.message) for w in caught]
        ray.get([a.run.remote(name, run_rank, sc, r, 1, None) for r, a in enumerate(actors)])
        check(sc, 0, driver.result(0, timeout=DEADLINE_S, finalize=True))
        check(sc, 1, driver.result(1, timeout=DEADLINE_S, finalize=True))  # not late, not empty
    finally:
        ray.kill(worker)
        for a in actors:
            ray.kill(a)
