"""The differential harness: every merged number equals the single-process computation on the
concatenated batch of all ranks, on every backend and with both read patterns.

A *scenario* (drawn by hypothesis) is W ranks and two steps. In every step each rank has its own
batch (unequal sizes, empty shards too; single- or multi-turn; float32 or float64; a NaN or an
infinity in the rewards where the scenario says so; data sources, missing or of mixed types, for
``group_by``), its own phase timings and GPUs, its share of a validation round and a few plain
metrics. Each rank runs the seed's calls on its shard: ``compute_local_data_metric`` (with
``group_by="data_source"``), ``compute_local_timing_metrics``, ``compute_local_throughout_metrics``,
``process_local_validation_metrics`` and ``submit_metric``, then ``wait_submit()``. The driver reads
with ``wait_final_res()`` after the ranks (the seed's loop), or with ``result(step)``.

The reference is one process on the concatenation: ``compute_data_metric`` (with ``group_by``),
``compute_timing_metrics`` (each stage's seconds averaged over ranks, as every rank times the same
step), ``compute_throughput_metrics`` (the ranks' GPUs summed), ``process_validation_metrics`` (the
samples in rank order) and numpy for the plain metrics. Tolerance: 1e-9 relative for float64 data;
for float32 tensors ``1e-5`` relative (a row's float32 sum may differ from the concatenation's in
its last bits, ~ width * 2**-24).

Backends: in-process threads (hypothesis, many scenarios), Ray actors (a few scenarios, one actor
per rank) and torch.distributed gloo processes (3 ranks). ``test_a_mean_of_means_is_caught`` runs
the harness with one merge replaced by a mean of means and checks it fails.

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
import time
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.sinks import make_sinks, read_jsonl

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

from rlmetrics.metrics.data import compute_data_metric  # noqa: E402
from rlmetrics.metrics.timing import compute_throughput_metrics, compute_timing_metrics  # noqa: E402
from rlmetrics.metrics.validation import process_validation_metrics  # noqa: E402

STEPS = 2
STAGES = ("gen", "ref", "update_actor", "step")
UNCHECKABLE = {"perf/process_cpu_mem_used_gb"}  # each process's own memory: no concatenation of it
CHECKED: list[int] = []  # how many names each checked step compared
SOURCES = ("gsm8k", "math")
LABELS = ("gsm8k", "openai/gsm8k", None, float("nan"), "", 3)  # per-sequence data sources: missing, mixed


# ------------------------------------------------------------------------------------------- scenarios
@st.composite
def scenarios(draw, world=None):
    """A JSON-able description; the tensors are built from it (:func:`rank_step`)."""
    w = world or draw(st.integers(1, 4))
    steps = []
    for _ in range(STEPS):
        steps.append(
            {
                "sizes": draw(st.lists(st.integers(0, 5), min_size=w, max_size=w)),
                "prompt": draw(st.integers(1, 4)),
                "response": draw(st.integers(1, 6)),
                "multi_turn": draw(st.booleans()),
                "float64": draw(st.booleans()),
                "bad": draw(st.sampled_from([None, math.nan, math.inf])),
                "val": draw(st.lists(st.integers(0, 4), min_size=w, max_size=w)),
            }
        )
    return {
        "world": w,
        "nan_strategy": draw(st.sampled_from(["propagate", "drop"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "steps": steps,
    }


def draw_scenarios(n: int, world: int | None = None) -> list[dict]:
    """``n`` scenarios drawn by hypothesis (for the backends that run them all in one go): the last
    of ``5 n`` draws, past the simplest ones hypothesis starts with."""
    out: list[dict] = []

    @settings(max_examples=5 * n, database=None, derandomize=True, phases=[Phase.generate])
    @given(scenarios(world))
    def collect(sc):
        out.append(sc)

    collect()
    return out[-n:]


def rank_step(sc: dict, rank: int, step: int) -> dict:
    """One rank's inputs of one step: batch, timing, GPUs, validation share and plain metrics."""
    spec = sc["steps"][step]
    g = torch.Generator().manual_seed(sc["seed"] * 7919 + step * 101 + rank)
    rng = np.random.default_rng([sc["seed"], step, rank])
    b, p, r = spec["sizes"][rank], spec["prompt"], spec["response"]
    dtype = torch.float64 if spec["float64"] else torch.float32
    lengths = torch.randint(0, r + 1, (b,), generator=g)  # 0: an aborted (empty) response
    mask = (torch.arange(r)[None, :] < lengths[:, None]).long()
    prompt_len = torch.randint(1, p + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()  # left-padded
    scores = torch.zeros(b, r, dtype=dtype)
    ends = (lengths - 1).clamp(min=0)
    scores[torch.arange(b), ends] = torch.randint(0, 2, (b,), generator=g).to(dtype) * (lengths > 0)
    rewards = scores - 0.05 * mask.to(dtype)
    if spec["bad"] is not None and b and rank == (step % sc["world"]):
        rewards[0, 0] = spec["bad"]
    batch = {
        "responses": torch.randint(0, 9, (b, r), generator=g),
        "prompts": torch.randint(0, 9, (b, p), generator=g),
        "attention_mask": torch.cat([prompt_mask, mask], 1),
        "response_mask": mask,
        "token_level_scores": scores,
        "token_level_rewards": rewards,
        "advantages": torch.randn(b, r, generator=g, dtype=dtype) * mask,
        "returns": torch.randn(b, r, generator=g, dtype=dtype) * mask,
        "values": torch.randn(b, r, generator=g, dtype=dtype) * mask,
    }
    if spec["multi_turn"]:
        batch["__num_turns__"] = torch.randint(1, 4, (b,), generator=g)
    batch["data_source"] = [LABELS[i] for i in rng.integers(0, len(LABELS), b)]  # group_by's labels
    n_val = spec["val"][rank]
    infos = {"acc": rng.integers(0, 2, n_val).astype(float).tolist()}
    infos["pred"] = [str(v) for v in rng.integers(0, 3, n_val)]
    val = (
        [SOURCES[i % 2] for i in range(n_val)],
        [f"q{(rank + i) % 3}" for i in range(n_val)],  # a prompt's samples sit on several ranks
        infos,
        rng.integers(1, 3, n_val).tolist(),
    )
    return {
        "batch": batch,
        "timing": {s: float(rng.uniform(0.1, 2.0)) for s in STAGES},
        "gpus": int(rng.integers(1, 3)),
        "val": val,
        "plain": {"x": rng.normal(size=int(rng.integers(1, 5))), "w": rng.uniform(0.5, 2.0), "n": 1.0 + rank},
    }


def run_rank(client, sc: dict, rank: int, step: int) -> None:
    """The seed's calls of one rank for one step."""
    d = rank_step(sc, rank, step)
    w = sc["world"]
    client.compute_local_data_metric(d["batch"], w, step, group_by="data_source")
    client.compute_local_timing_metrics(d["batch"], d["timing"], w, step)
    client.compute_local_throughout_metrics(d["batch"], d["timing"], d["gpus"], w, step)
    if sum(sc["steps"][step]["val"]):
        client.process_local_validation_metrics(*d["val"], world_size=w, step=step)
    x = d["plain"]["x"]
    client.submit_metric(
        {"x/mean": x.tolist(), "x/max": torch.as_tensor(x), "x/std": x, "x/p90": x.tolist(),
         "wx/mean": (x, d["plain"]["w"]), "n/total": d["plain"]["n"]},
        w, step,
    )  # fmt: skip
    client.wait_submit(step=step)


# ------------------------------------------------------------------------------------------- reference
def expected(sc: dict, step: int, ranks: list[int] | None = None) -> dict[str, float]:
    """The single-process computation on the concatenation of the inputs of ``step`` of all ranks
    (or of ``ranks``)."""
    parts = [rank_step(sc, r, step) for r in (range(sc["world"]) if ranks is None else ranks)]
    batch = {k: torch.cat([p["batch"][k] for p in parts]) for k in parts[0]["batch"] if k != "data_source"}
    batch["data_source"] = sum((p["batch"]["data_source"] for p in parts), [])
    ns = sc["nan_strategy"]
    want = dict(compute_data_metric(batch, nan_strategy=ns, group_by="data_source"))
    timing = {s: float(np.mean([p["timing"][s] for p in parts])) for s in STAGES}
    want.update({k.replace("timing_s/", "perf/delta_time/"): v
                 for k, v in compute_timing_metrics(batch, timing, nan_strategy=ns).items()})  # fmt: skip
    want.update(compute_throughput_metrics(batch, timing, sum(p["gpus"] for p in parts), nan_strategy=ns))
    if sum(sc["steps"][step]["val"]):
        cat = [sum((list(p["val"][i]) for p in parts), []) for i in (0, 1, 3)]
        infos = {k: sum((p["val"][2][k] for p in parts), []) for k in parts[0]["val"][2]}
        want.update(process_validation_metrics(cat[0], cat[1], infos, cat[2], nan_strategy=ns))
    x = np.concatenate([p["plain"]["x"] for p in parts])
    wx = np.concatenate([np.full(p["plain"]["x"].size, p["plain"]["w"]) for p in parts])
    want.update({
        "x/mean": x.mean(), "x/max": x.max(), "x/std": x.std(), "x/p90": float(np.quantile(x, 0.9)),
        "wx/mean": float(np.average(x, weights=wx)), "n/total": sum(p["plain"]["n"] for p in parts),
    })  # fmt: skip
    return {k: float(v) for k, v in want.items() if k not in UNCHECKABLE}


def check(sc: dict, step: int, got, ranks: list[int] | None = None) -> None:
    """``got`` is ``step`` of ``sc``: complete and equal to the reference, or with ``ranks`` final,
    partial and equal to the reference over those ranks alone."""
    assert got.step == step, (got.step, step)
    assert got.meta.complete == (ranks is None) and not got.meta.provisional, got.meta
    want = expected(sc, step, ranks)
    names = set(got) - UNCHECKABLE - {"meta/coverage", "meta/late"}
    assert names == set(want), ("names differ", sorted(names ^ set(want)))
    CHECKED.append(len(want))
    rel = 1e-9 if sc["steps"][step]["float64"] else 1e-5
    bad = {}
    for k, v in want.items():
        g = got[k]
        if math.isnan(v) or math.isnan(g):
            ok = math.isnan(v) and math.isnan(g)
        else:
            ok = math.isclose(g, v, rel_tol=rel, abs_tol=rel * 1e-3) or g == v
        if not ok:
            bad[k] = (g, v)
    assert not bad, bad


# ------------------------------------------------------------------------------------------- local
def run_local(sc: dict, read: str) -> None:
    name = f"diff-{uuid.uuid4().hex[:8]}"
    w = sc["world"]
    opts = {"nan_strategy": sc["nan_strategy"], "blocking": read == "final", "name": name}
    clients = [rlmetrics.connect("local", world_size=w, label=f"rank{r}", rank=r, **opts) for r in range(w)]
    driver = rlmetrics.connect("local", name=name)
    try:
        for step in range(STEPS):
            threads = [
                threading.Thread(target=run_rank, args=(c, sc, r, step)) for r, c in enumerate(clients)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            got = driver.wait_final_res() if read == "final" else driver.result(step, timeout=30)
            check(sc, step, got)
    finally:
        local.drop_worker(name)


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
@pytest.mark.parametrize("read", ["final", "result"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_local_threads_equal_the_concatenated_batch(sc, read):
    run_local(sc, read)


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
    run_local(sc, "final")  # the real merge passes
    monkeypatch.setattr(steps, "reduce_parts", mean_of_means)
    with pytest.raises(AssertionError):
        run_local(sc, "final")


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
    task = np.array(sum((p["task"] for p in parts), []))
    want = {"loss": float(np.mean([p["loss"] for p in parts]))}
    subsets = [("", np.ones(len(task), bool))] + [(f"group/task/{t}/", task == t) for t in set(task)]
    for prefix, keep in subsets:
        if keep.any():
            r, q = reward[keep], np.quantile(length[keep], 0.9)
            want |= {f"{prefix}reward/mean": r.mean(), f"{prefix}reward/max": r.max(),
                     f"{prefix}reward/std": r.std(), f"{prefix}length/p90": q}  # fmt: skip
    return {k: float(v) for k, v in want.items()}


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
SLOW_RANK_S = 0.5  # the last rank's delay at every step
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


def slow_last_rank(client, sc: dict, rank: int, step: int) -> None:
    if rank == sc["world"] - 1:
        time.sleep(SLOW_RANK_S)
    run_rank(client, sc, rank, step)


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
def ray_ranks(ray, n: int) -> list:
    """``n`` rank actors; each connects once per aggregator name, as the options of its first step say."""

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, rank):
            self.rank = rank
            self.clients = {}

        def client(self, name, sc, blocking=True, hierarchy=None):
            if name not in self.clients:
                self.clients[name] = rlmetrics.connect(
                    "ray", name=name, world_size=sc["world"], label=f"rank{self.rank}", rank=self.rank,
                    nan_strategy=sc["nan_strategy"], blocking=blocking, hierarchy=hierarchy,
                )  # fmt: skip
            return self.clients[name].client_id

        def step(self, name, sc, step, blocking=True, slow=False):
            (slow_last_rank if slow else run_rank)(self.clients[name], sc, self.rank, step)

    return [Rank.remote(r) for r in range(n)]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_ray_actors_equal_the_concatenated_batch(ray_session):
    ray = ray_session
    actors = ray_ranks(ray, 4)
    for i, sc in enumerate(draw_scenarios(4)):
        read = ("final", "result")[i % 2]
        name = f"diff-{uuid.uuid4().hex[:8]}"
        worker = rlmetrics.get_metric_worker(name=name)
        driver = rlmetrics.MetricClient(worker)
        ranks = actors[: sc["world"]]
        try:
            ray.get([a.client.remote(name, sc, read == "final") for a in ranks])
            for step in range(STEPS):
                ray.get([a.step.remote(name, sc, step) for a in ranks])
                check(
                    sc, step, driver.wait_final_res() if read == "final" else driver.result(step, timeout=60)
                )
        finally:
            ray.kill(worker)
    for a in actors:
        ray.kill(a)


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
from tests.test_differential import STEPS  # noqa: E402

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
        from tests.test_differential import run_rank

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


# ------------------------------------------------------------------------------------------- torch
TORCH_WORLD = 3


def _torch_rank(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    scs = pickle.loads((Path(out_dir) / "scenarios.pkl").read_bytes())
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=TORCH_WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    results = []
    try:
        for sc in scs:
            client = rlmetrics.connect("torch", nan_strategy=sc["nan_strategy"])
            for step in range(STEPS):
                run_rank(client, sc, rank, step)
                results.append(client.wait_final_res() if step % 2 else client.result(step))
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_torch_gloo_ranks_equal_the_concatenated_batch(tmp_path):
    scs = draw_scenarios(4, world=TORCH_WORLD)
    (tmp_path / "scenarios.pkl").write_bytes(pickle.dumps(scs))
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    for rank in range(TORCH_WORLD):
        results = iter(pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes()))
        for sc in scs:
            for step in range(STEPS):
                check(sc, step, next(results))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_torch_rank, args=(sys.argv[1],), nprocs=TORCH_WORLD, join=True)
