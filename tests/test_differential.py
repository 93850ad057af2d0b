"""The differential harness's tests: every metric family of ``tests/harness.py``'s ``METRICS`` on
every backend of its ``BACKENDS``, with each backend's read patterns, equals the single-process
computation on the concatenated batch of all ranks (a new metric family or backend is one row there;
its docstring says how). ``test_a_mean_of_means_is_caught`` runs the harness with one merge replaced
by a mean of means and checks it fails.

The same scenarios and references under failures and other readers: a rank dead mid-step (the
survivors' concatenation, with or without node sub-aggregators), a second reader with a short
deadline, a run resumed on a detached aggregator after its driver was killed.

Churned names through the sinks: local ranks break their samples down by tasks that are new at every
step (``group/task/<task>/...``, each rank holding a few of them) and the driver logs each result
through ``make_sinks(["jsonl"])`` with the default health rules; every step read back from the JSONL
file equals numpy on the concatenated samples of all ranks, and no rule alerts.
"""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.sinks import make_sinks, read_jsonl

pytest.importorskip("torch")

pytestmark = pytest.mark.torch

from tests.harness import (  # noqa: E402
    EXAMPLES,
    FINAL,
    STEPS,
    backend,
    by_group,
    cases,
    check,
    check_run,
    draw_scenarios,
    ray_ranks,
    scenarios,
    slow_last_rank,
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
@pytest.mark.parametrize("backend, read", cases())
def test_every_backend_equals_the_concatenated_batch(backend, read, request):
    """Every family of ``METRICS`` on ``backend`` read with ``read``: hypothesis scenarios one at a
    time (``EXAMPLES`` of them), or ``backend.draws`` scenarios drawn up front and run in one go."""
    if backend.draws is not None:
        check_run(backend, request, draw_scenarios(backend.draws, backend.world), read)
        return

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(sc=scenarios(backend.world))
    def each(sc):
        check_run(backend, request, [sc], read)

    each()


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_a_mean_of_means_is_caught(monkeypatch):
    """The harness fails when the engine merges stat arrays as an equal-weight mean of the parts'
    means (what a per-rank-average system reports)."""
    from rlmetrics.engine import steps

    def mean_of_means(parts):
        counts, sums = parts[0], parts[1]
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(counts > 0, sums / np.where(counts > 0, counts, 1), np.nan)
        n = counts.sum(axis=0)
        out = np.stack(
            [n, np.nanmean(means, axis=0) * n, parts[2].sum(axis=0), parts[3].min(0), parts[4].max(0)]
        )
        return out

    sc = {"world": 3, "nan_strategy": "propagate", "seed": 5,
          "steps": [{"sizes": [1, 5, 2], "prompt": 3, "response": 5, "multi_turn": False, "float64": True,
                     "bad": None, "val": [0, 0, 0]}] * STEPS}  # fmt: skip
    check_run(backend("local"), None, [sc], FINAL)  # the real merge passes
    monkeypatch.setattr(steps, "reduce_parts", mean_of_means)
    with pytest.raises(AssertionError):
        check_run(backend("local"), None, [sc], FINAL)


# ------------------------------------------------------------------------ churned names, the sinks
CHURN_WORLD, CHURN_STEPS, CHURN_TASKS = 3, 30, 6


def churn_rank_step(rank: int, step: int) -> dict:
    """One rank's samples of ``step``: rewards and lengths, each sample's task (of CHURN_TASKS tasks
    new at this step; a rank draws a few of them, or has no sample at all), and a scalar loss."""
    rng = np.random.default_rng([step, rank, 29])
    n = int(rng.integers(0, 9))
    own = rng.choice(CHURN_TASKS, size=int(rng.integers(1, 4)), replace=False)
    return {
        "reward": rng.normal(size=n),
        "length": rng.integers(1, 60, n).astype(float),
        "task": [f"s{step}t{t}" for t in rng.choice(own, n)],
        "loss": float(rng.uniform()),
    }


def churn_metrics(d: dict) -> dict:
    return {"reward/mean": d["reward"], "reward/max": d["reward"], "reward/std": d["reward"],
            "length/p90": d["length"], "loss": d["loss"]}  # fmt: skip


def churn_expected(step: int) -> dict[str, float]:
    """numpy on the concatenation of all ranks' samples of ``step``; a name without samples is absent."""
    parts = [churn_rank_step(r, step) for r in range(CHURN_WORLD)]
    reward, length = (np.concatenate([p[k] for p in parts]) for k in ("reward", "length"))
    p90 = lambda v: np.quantile(v, 0.9)  # noqa: E731
    columns = {"reward/mean": (reward, np.mean), "reward/max": (reward, np.max),
               "reward/std": (reward, np.std), "length/p90": (length, p90)}  # fmt: skip
    want = by_group("task", sum((p["task"] for p in parts), []), columns)
    return {"loss": float(np.mean([p["loss"] for p in parts]))} | want


def test_churned_group_names_through_the_sinks_equal_numpy_and_raise_no_alert(tmp_path):
    name = f"diff-churn-{uuid.uuid4().hex[:8]}"
    clients = [
        rlmetrics.connect("local", world_size=CHURN_WORLD, label=f"rank{r}", rank=r, name=name)
        for r in range(CHURN_WORLD)
    ]
    driver = rlmetrics.connect("local", name=name)

    def rank(r: int, step: int) -> None:
        d = churn_rank_step(r, step)
        clients[r].submit_metric(churn_metrics(d), CHURN_WORLD, step, group_by={"task": d["task"]})
        clients[r].wait_submit(step=step)

    try:
        with make_sinks(["jsonl"], tmp_path) as tracking:
            for step in range(CHURN_STEPS):
                threads = [threading.Thread(target=rank, args=(r, step)) for r in range(CHURN_WORLD)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                tracking.log(driver.result(step, timeout=30), step)
    finally:
        local.drop_worker(name)
    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.steps == list(range(CHURN_STEPS))
    assert run.events == []
    grouped = set()
    for step, record in enumerate(run.records):
        got, want = dict(record["metrics"]), churn_expected(step)
        assert (got.pop("meta/coverage"), got.pop("meta/late")) == (1.0, 0.0), step
        assert got.keys() == want.keys(), (step, sorted(got.keys() ^ want.keys()))
        close = {k: math.isclose(got[k], v, rel_tol=1e-9, abs_tol=1e-12) for k, v in want.items()}
        assert all(close.values()), (step, {k: (got[k], want[k]) for k, ok in close.items() if not ok})
        grouped |= {k for k in got if k.startswith("group/")}
    assert len(grouped) > 10 * CHURN_STEPS  # every step brings new names


# -------------------------------------------------------------- two readers with different deadlines
DASHBOARD_TIMEOUT_S = 0.2  # the second reader's deadline: shorter than the slow rank's delay


def read_beside_a_dashboard(sc: dict, driver, dashboard, run_step) -> list:
    """Each step: ``run_step(step)`` starts the ranks (the last one late by ``SLOW_RANK_S``) and the
    driver reads it with ``finalize=True`` and a long deadline, while a dashboard thread reads the
    newest step again and again with a deadline shorter than the slow rank's delay. Every step the
    driver gets is checked against the reference; the dashboard's reads are returned."""
    newest, stop, seen = [0], threading.Event(), []

    def watch() -> None:
        while not stop.is_set():
            seen.append(dashboard.result(newest[0], timeout=DASHBOARD_TIMEOUT_S))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for step in range(STEPS):
            newest[0] = step
            finish = run_step(step)
            got = driver.result(step, timeout=60, finalize=True)
            finish()
            check(sc, step, got)
    finally:
        stop.set()
        watcher.join(30)
    return seen


def check_dashboard(seen: list) -> None:
    """The dashboard's reads ended at its own deadline (provisional) and finalized nothing."""
    assert any(r.meta.provisional for r in seen), [r.meta for r in seen]
    assert all(r.meta.complete or r.meta.provisional for r in seen), [
        r.meta for r in seen if not r.meta.provisional
    ]


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_local_a_second_readers_short_deadline_finalizes_nothing():
    """Before, the dashboard's deadline finalized the step for everyone: the driver got every step
    partial and the slow rank's data was dropped as late."""
    for sc in draw_scenarios(2, world=3):
        name = f"diff-{uuid.uuid4().hex[:8]}"
        opts = {"nan_strategy": sc["nan_strategy"], "name": name}
        clients = [
            rlmetrics.connect("local", world_size=3, label=f"rank{r}", rank=r, **opts) for r in range(3)
        ]

        def run_step(step: int, sc=sc, clients=clients):
            threads = [
                threading.Thread(target=slow_last_rank, args=(c, sc, r, step)) for r, c in enumerate(clients)
            ]
            for t in threads:
                t.start()
            return lambda: [t.join() for t in threads]

        try:
            driver, dashboard = (rlmetrics.connect("local", name=name) for _ in range(2))
            check_dashboard(read_beside_a_dashboard(sc, driver, dashboard, run_step))
        finally:
            local.drop_worker(name)


# ------------------------------------------------------------------------------------------- Ray
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_ray_a_second_readers_short_deadline_finalizes_nothing(ray_session):
    ray = ray_session
    (sc,) = draw_scenarios(1, world=3)
    actors = ray_ranks(ray, 3)
    name = f"diff-{uuid.uuid4().hex[:8]}"
    worker = rlmetrics.get_metric_worker(name=name)
    try:
        ray.get([a.client.remote(name, sc) for a in actors])

        def run_step(step: int):
            refs = [a.step.remote(name, sc, step, slow=True) for a in actors]
            return lambda: ray.get(refs)

        driver, dashboard = (rlmetrics.connect("ray", name=name) for _ in range(2))
        check_dashboard(read_beside_a_dashboard(sc, driver, dashboard, run_step))
    finally:
        ray.kill(worker)
        for a in actors:
            ray.kill(a)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
@pytest.mark.parametrize(
    "hierarchy, read",
    [(None, "result"), ("node", "result"), ("node", "final")],
    ids=["flat", "node", "node-seed"],
)
def test_ray_a_rank_dead_mid_step_gives_the_survivors_concatenation_in_both_layouts(
    ray_session, hierarchy, read
):
    """Three ranks, the last one dies before its calls of step 1; the driver's read ends at its
    deadline (``result(finalize=True)``, or the seed's ``wait_final_res``): step 1 equals the
    reference over the two survivors and names the dead rank, with or without node sub-aggregators."""
    ray = ray_session
    (sc,) = draw_scenarios(1, world=3)
    for spec in sc["steps"]:
        spec["val"] = [0, 0, 0]  # a validation round without the dead rank's share has other names
    actors = ray_ranks(ray, 3)
    name = f"diff-{uuid.uuid4().hex[:8]}"
    worker = rlmetrics.get_metric_worker(name=name, hierarchy=hierarchy)
    driver = rlmetrics.connect("ray", name=name)
    try:
        ids = ray.get([a.client.remote(name, sc, True, hierarchy) for a in actors])
        ray.get([a.step.remote(name, sc, 0) for a in actors])
        check(sc, 0, driver.result(0, timeout=60))
        ray.kill(actors[2])
        ray.get([a.step.remote(name, sc, 1) for a in actors[:2]])
        got = (
            driver.result(1, timeout=3, finalize=True)
            if read == "result"
            else driver.wait_final_res(timeout=3)
        )
        check(sc, 1, got, ranks=[0, 1])
        assert got.meta.missing_ranks == [ids[2]] and got.meta.contributors == sorted(ids[:2]), got.meta
    finally:
        ray.kill(worker)
        for a in actors[:2]:
            ray.kill(a)


RESUMED_DRIVER = """
import json, pickle, sys, time
import ray, rlmetrics

args = json.loads(sys.argv[1])
sys.path.insert(0, args["root"])
from tests.harness import STEPS  # noqa: E402

ray.init(address=args["address"], namespace=args["namespace"], logging_level="ERROR", log_to_driver=False)
sc = pickle.loads(open(args["scenario"], "rb").read())
name, namespace = args["name"], args["namespace"]
rlmetrics.get_metric_worker(name=name, namespace=namespace, lifetime="detached")


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank):
        sys.path.insert(0, args["root"])
        self.rank = rank
        self.client = rlmetrics.connect(
            "ray", name=name, namespace=namespace, world_size=sc["world"], label=f"rank{rank}", rank=rank,
            nan_strategy=sc["nan_strategy"],
        )

    def step(self, step):
        from tests.harness import run_rank

        run_rank(self.client, sc, self.rank, step)


ranks = [Rank.remote(r) for r in range(sc["world"])]
if args["killed"]:
    ray.get(ranks[0].step.remote(0))  # rank 0 closed step 0, the others did not: the driver is killed now
    print("READY", flush=True)
    time.sleep(600)
reader = rlmetrics.connect("ray", name=name, namespace=namespace)
results = []
for step in range(STEPS):  # the restarted run, from its checkpoint at step 0
    ray.get([a.step.remote(step) for a in ranks])
    results.append(reader.result(step, timeout=30, finalize=True))
open(args["out"], "wb").write(pickle.dumps(results))
"""


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_ray_a_run_resumed_on_a_detached_aggregator_never_merges_the_killed_runs_data(ray_session, tmp_path):
    """A driver with a detached aggregator is killed (SIGKILL) after its rank 0 closed step 0 and before
    the other ranks did; the run restarts from its checkpoint with new rank actors and other data.
    Every step equals the reference on the new run's data alone, and is complete: the killed run's
    half step is dropped and its ranks are not waited for. Before, step 0 merged the dead rank 0's
    data with the new ranks' (its ``meta.contributions`` still read whole) and step 1 waited for the
    dead rank until the deadline."""
    ray = ray_session
    killed_sc, resumed_sc = draw_scenarios(2, world=2)
    common = {
        "root": str(Path(__file__).resolve().parents[1]),
        "address": ray.get_runtime_context().gcs_address,
        "namespace": f"ns-{uuid.uuid4().hex[:8]}",
        "name": "resumed",
        "out": str(tmp_path / "out.pkl"),
    }
    script = tmp_path / "driver.py"
    script.write_text(RESUMED_DRIVER)

    def driver(sc: dict, killed: bool) -> subprocess.Popen:
        path = tmp_path / f"scenario-{killed}.pkl"
        path.write_bytes(pickle.dumps(sc))
        spec = json.dumps({**common, "scenario": str(path), "killed": killed})
        return subprocess.Popen([sys.executable, str(script), spec], stdout=subprocess.PIPE, text=True)

    first = driver(killed_sc, killed=True)
    try:
        assert first.stdout.readline().strip() == "READY", first.communicate(timeout=10)
    finally:
        first.kill()  # SIGKILL: Ray ends the run's rank actors with it, not the detached aggregator
        first.wait(30)
    second = driver(resumed_sc, killed=False)
    try:
        assert second.wait(240) == 0
        results = pickle.loads((tmp_path / "out.pkl").read_bytes())
        for step, res in enumerate(results):
            check(resumed_sc, step, res)
            received, expected_count = res.meta.contributions
            assert received == expected_count > 0 and len(res.meta.contributors) == 2, res.meta
    finally:
        second.kill()
        ray.kill(ray.get_actor("resumed", namespace=common["namespace"]))
