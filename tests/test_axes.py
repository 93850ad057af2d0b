"""Step axes in an asynchronous RL run (issue 20, point 2): rollout workers one or two policy versions
ahead of the trainer, one of them late for a train step. Every number of every step of every axis
(``train_step``, ``policy_version``, ``rollout_id``) must be numpy's on the concatenated data of the
submissions tagged with that step on that axis; the late data, dropped on its final train step, must
land on its policy version and rollout id. Then the results go through JSONL, W&B (offline) and
TensorBoard and are read back with their own readers: each axis on its own step metric, W&B steps
only going up, TensorBoard tags ``<axis>/<name>`` at that axis's steps.
"""

from __future__ import annotations

import importlib.util
import math
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from rlmetrics import axes as axes_mod
from rlmetrics.backends.local import drop_worker, get_worker
from rlmetrics.metrics.staleness import staleness_metrics
from rlmetrics.sinks import make_sinks, read_jsonl
from tests.trackers import one, read_tensorboard, wandb_records, wandb_rows

STEPS = 6
WORKERS = TRAINERS = 2
LATE = (1, 3)  # (worker, rollout): submitted after its train step was read at a deadline
AXES = ("policy_version", "rollout_id")


# ------------------------------------------------------------------------------------------------ data
def rollout(worker: int, r: int) -> dict:
    """Worker ``worker``'s rollout ``r``: made with the weights of version ``r - 1`` or ``r - 2``
    (never going back), its samples' versions (a partial rollout spans two) and token counts."""
    rng = np.random.default_rng([worker, r])
    version = max(0, r - 1 - (worker + r) % 2)
    n = 2 + (worker * 5 + r * 3) % 5
    min_version = np.maximum(version - rng.integers(0, 2, n), 0)
    return {
        "version": version,
        "rewards": rng.normal(size=n),
        "tokens": rng.integers(1, 40, n).astype(float),
        "min_version": min_version,
        "max_version": np.full(n, version),
    }


def submissions() -> list[tuple[str, int, int, dict, dict]]:
    """Every submission of the run: ``(role, rank, train step, {axis: value}, metrics)``."""
    out = []
    for t in range(STEPS):
        for k in range(WORKERS):
            b = rollout(k, t)
            metrics = {
                "reward/mean": b["rewards"],
                "reward/max": b["rewards"],
                "reward/min": b["rewards"],
                "response_length/mean": b["tokens"],
            }
            out.append(("worker", k, t, {"policy_version": b["version"], "rollout_id": t}, metrics))
        for j in range(TRAINERS):  # trainer rank j trains on worker j's rollout t with version t
            b = rollout(j, t)
            loss = float(np.random.default_rng([99, j, t]).normal())
            metrics = {
                "actor/loss": loss,
                **staleness_metrics(t, b["min_version"], b["max_version"], tokens=b["tokens"], bins=2),
            }
            out.append(("trainer", j, t, {"policy_version": t, "rollout_id": t}, metrics))
    return out


def expected(items: list[dict]) -> dict[str, float]:
    """numpy on the concatenated values of ``items`` per name: max/min, else the weighted mean."""
    values: dict[str, list] = {}
    for metrics in items:
        for name, v in metrics.items():
            x, w = v if isinstance(v, tuple) else (v, np.ones_like(np.atleast_1d(v), dtype=float))
            values.setdefault(name, []).append((np.atleast_1d(np.asarray(x, float)), np.atleast_1d(w)))
    out = {}
    for name, parts in values.items():
        x = np.concatenate([p[0] for p in parts])
        w = np.concatenate([p[1] for p in parts])
        last = name.rsplit("/", 1)[-1]
        out[name] = float(
            x.max() if last == "max" else x.min() if last == "min" else np.average(x, weights=w)
        )
    return out


def reference() -> dict[str, dict[int, dict[str, float]]]:
    """``{axis: {step: {name: value}}}`` of the run; the late rollout is on its policy version and
    rollout id, not on its train step."""
    groups: dict[str, dict[int, list]] = {}
    for role, rank, t, at, metrics in submissions():
        for axis, step in {"train_step": t, **at}.items():
            if axis == "train_step" and (role, (rank, t)) == ("worker", LATE):
                continue
            groups.setdefault(axis, {}).setdefault(step, []).append(metrics)
    return {axis: {s: expected(items) for s, items in steps.items()} for axis, steps in groups.items()}


# ------------------------------------------------------------------------------------------ the ranks
def run_rank(client, role: str, rank: int, taken: threading.Event) -> None:
    """What one rank does: its submissions in train-step order, each with its axes. The late worker
    first waits until its train step is final: a reader took it at a deadline (``taken``; not a read
    of its own, whose warning filter would be the whole process's, the reader's too)."""
    for t, at, metrics in ((t, at, m) for r, k, t, at, m in submissions() if (r, k) == (role, rank)):
        if (role, (rank, t)) == ("worker", LATE):
            assert taken.wait(120)
        client.submit_metric(metrics, world_size=2, step=t, axes=at)
        client.wait_submit(step=t)
    client.stop()


def run(backend: str, name: str) -> dict[str, dict[int, dict]]:
    """The run, one thread per rank (all connected, hence registered, before any starts); the late
    worker is held back until the others are done and a reader took its train step at a deadline.
    The results of every axis, checked."""
    ranks = [("worker", k) for k in range(WORKERS)] + [("trainer", j) for j in range(TRAINERS)]
    clients = {
        rk: axes_mod.connect(backend, axes=AXES, world_size=4, name=name, label=f"{rk[0]}{rk[1]}")
        for rk in ranks
    }
    taken = threading.Event()
    threads = {
        rk: threading.Thread(target=run_rank, args=(c, *rk, taken), daemon=True) for rk, c in clients.items()
    }
    for thread in threads.values():
        thread.start()
    for rk, thread in threads.items():
        if rk != ("worker", LATE[0]):
            thread.join(120)
    reader = axes_mod.connect(backend, axes=AXES, name=name)
    with pytest.warns(RuntimeWarning, match="partial"):
        partial = reader.result(LATE[1], timeout=0.5, finalize=True)
    taken.set()
    threads["worker", LATE[0]].join(120)
    return check_run(
        lambda step, axis, timeout: (
            partial if (axis, step) == ("train_step", LATE[1]) else reader.result(step, timeout, axis=axis)
        )
    )


def check_run(read) -> dict[str, dict[int, dict]]:
    """Every step of every axis, read with ``read(step, axis, timeout)``, against :func:`reference`."""
    ref = reference()
    got: dict[str, dict[int, dict]] = {}
    for axis, steps in ref.items():
        got[axis] = {}
        for step, want in sorted(steps.items()):
            res = read(step, axis, 60)
            assert res.meta.complete == (axis != "train_step" or step != LATE[1]), (axis, step, res.meta)
            assert sorted(res) == sorted(want), (axis, step)
            for name, value in want.items():
                assert math.isclose(res[name], value, rel_tol=1e-12, abs_tol=1e-12), (axis, step, name)
            got[axis][step] = res
    assert got["train_step"][LATE[1] + 1].meta.late == 1  # dropped there, counted on the next one
    return got


# -------------------------------------------------------------------------------------- local threads
@pytest.fixture(scope="module")
def local_run():
    """The run on the in-process backend, one thread per rank; the results of every axis."""
    name = f"axes-{uuid.uuid4().hex[:8]}"
    got = run("local", name)
    late_engine = get_worker(name).server.stats()["late"]
    for agg in (name, *(axes_mod.axis_aggregator(name, a) for a in AXES)):
        drop_worker(agg)
    return got, late_engine


def test_async_run_every_axis_local(local_run):
    got, late = local_run
    assert late == 1
    assert sorted(got["policy_version"]) == sorted(reference()["policy_version"])


def test_values_only_go_up_on_an_axis():
    name = f"axes-{uuid.uuid4().hex[:8]}"
    client = axes_mod.connect("local", axes=("policy_version",), world_size=1, name=name)
    client.submit_metric({"x": 1.0}, axes={"policy_version": 3})
    client.wait_submit()  # closes the versions below 3
    with pytest.raises(ValueError, match="policy_version 2 is below 3"):
        client.submit_metric({"x": 1.0}, axes={"policy_version": 2})
    with pytest.raises(ValueError, match="not axes of this client"):
        client.submit_metric({"x": 1.0}, axes={"rollout_id": 2})
    client.submit_metric({"x": 5.0})  # the newest value: version 3
    client.advance("policy_version", 4)
    assert client.result(3, timeout=5, axis="policy_version") == {"x": 3.0}
    client.stop()
    for agg in (name, axes_mod.axis_aggregator(name, "policy_version")):
        drop_worker(agg)


def test_rlmetrics_connect_with_axes_is_the_axes_client():
    """One ``connect``: ``rlmetrics.connect(..., axes=...)`` is ``rlmetrics.axes.connect``."""
    import rlmetrics

    name = f"axes-{uuid.uuid4().hex[:8]}"
    client = rlmetrics.connect("local", axes=("policy_version",), world_size=1, name=name)
    assert isinstance(client, axes_mod.AxesClient)
    client.submit_metric({"x": [1.0, 3.0]}, axes={"policy_version": 5})
    client.wait_submit()
    client.advance("policy_version", 6)
    assert client.result(0, timeout=5) == {"x": 2.0}
    assert client.result(5, timeout=5, axis="policy_version") == {"x": 2.0}
    client.stop()
    for agg in (name, axes_mod.axis_aggregator(name, "policy_version")):
        drop_worker(agg)


# ------------------------------------------------------------------------------ the seed's calls
def seed_rank(rng: np.random.Generator, r: int, b: int) -> dict:
    """Rank ``r``'s inputs of the seed's calls: a batch with data sources (some missing), its
    timings, its validation samples and a per-sample value with its environments."""
    import torch

    from tests.test_metrics_data import make_batch

    batch = make_batch(rng, b, 3, 4, dtype=torch.float64)
    batch["data_source"] = np.array(["gsm8k", None, "math", "gsm8k", None][:b], dtype=object)
    return {
        "batch": batch,
        "timing": {"gen": 1.0 + r, "update_actor": 0.5 + 2 * r, "step": 4.0 + r},
        "val": (["gsm8k", "gsm8k", "math"], ["q0", "q1", f"q{r}"], {"acc": [1.0, float(r), 0.0]}),
        "x": rng.normal(size=4),
        "env": ["a", None, "a", "b"],
    }


def check_seed_calls(res, parts: list[dict]) -> None:
    """``res`` holds the seed's calls' metrics of ``parts`` (in rank order) concatenated: data
    metrics and each data source's by the loop reference, timings and throughput by numpy (two GPUs
    a rank), validation as one process, the per-sample value and each environment's by numpy."""
    from rlmetrics.metrics.validation import process_validation_metrics
    from tests.test_derived_metrics import reference as timing_reference
    from tests.test_groups import group_of, grouped, rows
    from tests.test_metrics_data import assert_matches, concatenate, reference

    assert res.meta.complete, res.meta
    batches = [p["batch"] for p in parts]
    sources = {"gsm8k": "gsm8k", "math": "math"}
    for g in ("gsm8k", "math", "--missing"):
        idx = [
            np.array([i for i, x in enumerate(b["data_source"]) if group_of(x, sources) == g], int)
            for b in batches
        ]
        assert_matches(
            grouped(res, "data_source", g),
            reference(concatenate([rows(b, i) for b, i in zip(batches, idx) if len(i)])),
        )
    timing = [p["timing"] for p in parts]
    want = timing_reference(concatenate(batches), timing, 2 * len(parts))
    want.update({f"perf/delta_time/{s}": np.mean([t[s] for t in timing]) for s in timing[0]})
    val = [sum((list(p["val"][i]) for p in parts), []) for i in (0, 1)]
    want.update(process_validation_metrics(*val, {"acc": sum((p["val"][2]["acc"] for p in parts), [])}))
    x, env = np.concatenate([p["x"] for p in parts]), sum((p["env"] for p in parts), [])
    want.update({"x/mean": x.mean(), "x/max": x.max()})
    for g, label in (("a", "a"), ("b", "b"), ("--missing", None)):
        values = x[[e == label for e in env]]
        want.update({f"group/env/{g}/x/mean": values.mean(), f"group/env/{g}/x/max": values.max()})
    for name, value in want.items():
        assert res[name] == pytest.approx(value, rel=1e-12), name
    data = {
        n: v
        for n, v in res.items()
        if n not in want and not n.startswith(("group/data_source/", "perf/delta"))
    }
    assert_matches(data, reference(concatenate(batches)))


@pytest.mark.torch
def test_the_seed_calls_land_on_train_step_and_on_every_axis():
    """Issue 28.10: an async trainer calling the seed's ``compute_local_*`` or
    ``process_local_validation_metrics`` on an axes client got AttributeError, and ``submit_metric``
    took no ``group_by``. Two ranks of train step 0, with the weights of versions 0 and 1: train step
    0 holds both ranks' data, policy version ``v`` rank ``v``'s, each equal to the reference."""
    name = f"axes-seed-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(3)
    parts = [seed_rank(rng, 0, 5), seed_rank(rng, 1, 3)]
    clients = [
        axes_mod.connect("local", axes=("policy_version",), world_size=2, name=name, label=f"rank{r}", rank=r)
        for r in range(2)
    ]

    def rank(r: int) -> None:
        client, d, at = clients[r], parts[r], {"policy_version": r}
        client.compute_local_data_metric(d["batch"], group_by="data_source", axes=at)
        client.compute_local_timing_metrics(d["batch"], d["timing"], axes=at)
        client.compute_local_throughout_metrics(d["batch"], d["timing"], 2, axes=at)
        client.process_local_validation_metrics(*d["val"], axes=at)
        client.submit_metric({"x/mean": d["x"], "x/max": d["x"]}, group_by={"env": d["env"]}, axes=at)
        client.wait_submit()
        client.advance("policy_version", 2)

    reader = axes_mod.connect("local", axes=("policy_version",), name=name)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(rank, range(2)))  # re-raises a rank's error
        check_seed_calls(reader.wait_final_res(), parts)  # the seed's driver, on train_step
        for v in range(2):
            check_seed_calls(reader.result(v, timeout=10, axis="policy_version"), parts[v : v + 1])
    finally:
        for agg in (name, axes_mod.axis_aggregator(name, "policy_version")):
            drop_worker(agg)


def test_the_straggler_report_lands_on_train_step_and_on_every_axis():
    """An axes client had no ``rank``: its straggler call raised AttributeError."""
    name = f"axes-strag-{uuid.uuid4().hex[:8]}"
    seconds = [3.0, 8.0]
    clients = [
        axes_mod.connect("local", axes=("policy_version",), world_size=2, name=name, rank=r) for r in range(2)
    ]
    reader = axes_mod.connect("local", axes=("policy_version",), name=name)
    try:
        for r, client in enumerate(clients):
            client.compute_local_straggler_metrics({"gen": seconds[r]}, axes={"policy_version": 0})
            client.wait_submit()
        for res in (reader.result(0, timeout=10), reader.result(0, timeout=10, axis="policy_version")):
            assert res["perf/straggler/gen/p50"] == np.median(seconds)
            assert res["perf/straggler/gen/max"] == max(seconds)
            assert res.lists == {"perf/straggler/gen/slowest": ["rank1", "rank0"]}
    finally:
        for agg in (name, axes_mod.axis_aggregator(name, "policy_version")):
            drop_worker(agg)


# ---------------------------------------------------------------------------------------- the sinks
def test_jsonl_and_wandb_each_axis_on_its_own_step(local_run, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    got, _ = local_run
    order = []  # as a driver logs: each train step, then whatever became final on the other axes
    for t in range(STEPS):
        order.append(("train_step", t))
        order += [(a, s) for a in AXES for s in sorted(got[a]) if s <= t and (a, s) not in order]
    order += [(a, s) for a in AXES for s in sorted(got[a]) if (a, s) not in order]
    with make_sinks(["jsonl", "wandb", "tensorboard"], tmp_path, axes=True, health=None) as tracking:
        for axis, step in order:
            tracking.log_axis(got[axis][step], step, axis)
        assert not tracking.failed

    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.axes == sorted(AXES)
    for axis in ("train_step", *AXES):
        on = run if axis == "train_step" else run.on_axis(axis)
        assert on.steps == sorted(got[axis])
        for step, res in got[axis].items():
            record = next(r["metrics"] for r in on.records if r["step"] == step)
            assert {k: v for k, v in record.items() if not k.startswith("meta/")} == dict(res)
            assert record["meta/late"] == res.meta.late

    run_file = one(tmp_path, "wandb/offline-run-*/run-*.wandb")
    rows = wandb_rows([run_file])
    assert [s for s, _ in rows] == list(range(len(order)))  # one W&B step per logged step, never back
    step_metric = {
        r.metric.name: r.metric.step_metric
        for r in wandb_records(run_file)
        if r.WhichOneof("record_type") == "metric" and r.metric.name
    }
    seen: dict[str, list[int]] = {}
    for (axis, step), (_, row) in zip(order, rows):
        assert row[axis] == step
        assert not ({"train_step", *AXES} - {axis}) & set(row)
        seen.setdefault(axis, []).append(step)
        prefix = "" if axis == "train_step" else f"{axis}/"
        for name, value in got[axis][step].items():
            assert row[prefix + name] == pytest.approx(value, rel=1e-12, abs=1e-12)
            assert step_metric[prefix + name] == axis
    assert all(s == sorted(set(s)) for s in seen.values())  # each axis only goes up

    tensorboard = read_tensorboard(tmp_path / "tensorboard")  # its reader drops a tag's steps that go back
    for axis in ("train_step", *AXES):
        prefix = "" if axis == "train_step" else f"{axis}/"
        for step, res in got[axis].items():
            for name, value in res.items():
                assert tensorboard[prefix + name][step] == pytest.approx(value, rel=1e-6, abs=1e-6)


def test_resumed_run_logs_each_step_of_each_axis_once(tmp_path, monkeypatch):
    """A driver restarted from an older checkpoint logs steps 2..5 again on both axes: JSONL skips,
    per axis, the steps it holds; the W&B run, rebuilt from it, gets each step of each axis once."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for steps, resume in ((range(4), False), (range(2, 6), True)):
        with make_sinks(["jsonl", "wandb"], tmp_path, axes=True, health=None, resume=resume) as tracking:
            for s in steps:
                tracking.log({"a": s}, s)
                tracking.log_axis({"b": 2 * s}, s, "policy_version")
    run = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.steps == run.on_axis("policy_version").steps == list(range(6))
    rows = wandb_rows(sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb")))
    assert [s for s, _ in rows] == list(range(12))
    after = [(r.get("train_step"), r.get("policy_version/b")) for _, r in rows[8:]]
    assert after == [(4, None), (None, 8), (5, None), (None, 10)]


# ------------------------------------------------------------------------------------------------ Ray
@pytest.mark.ray
@pytest.mark.slow
def test_async_run_every_axis_ray(ray_session):
    run("ray", f"axes-{uuid.uuid4().hex[:8]}")


# ------------------------------------------------------------------------------------ docs, example
ROOT = Path(__file__).resolve().parents[1]


def test_example_logs_every_step_of_every_axis(tmp_path):
    spec = importlib.util.spec_from_file_location("async_axes", ROOT / "examples" / "async_axes.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main([str(tmp_path), "--steps", "8", "--sinks", "jsonl"]) == dict.fromkeys(
        ("train_step", *AXES), 8
    )
    run = read_jsonl(tmp_path / "metrics.jsonl")
    for on in (run, *(run.on_axis(a) for a in AXES)):
        assert on.steps == list(range(8))
        assert all(r["metrics"]["meta/coverage"] == 1.0 for r in on.records)  # every step complete


def test_wandb_axes_rows_hold_a_steps_histograms_and_slowest_ranks(tmp_path, monkeypatch):
    """With axes=True a train step's row keeps what a plain run's row holds besides its floats: the
    histogram of the ranks' data (numpy's of the concatenation, as W&B's nested keys) and the
    straggler report's slowest ranks (a string), both declared on the train_step axis."""
    from rlmetrics.core.histogram import Histogram
    from rlmetrics.core.stat import Stat
    from rlmetrics.messages import StepResult

    monkeypatch.setenv("WANDB_SILENT", "true")
    rng = np.random.default_rng(3)
    shards = [rng.integers(0, 300, size=50 * (r + 1)).astype(float) for r in range(2)]
    merged = Histogram.of(Stat.of(shards[0], sketch=True).merge(Stat.of(shards[1], sketch=True)))
    result = StepResult(
        {"critic/score/mean": 0.5}, 0, histograms={"response/length/hist": merged},
        lists={"perf/straggler/gen/slowest": ["rank1", "rank0"]},
    )  # fmt: skip
    with make_sinks(["wandb"], tmp_path, axes=True, health=None) as tracking:
        tracking.log(result, 0)
        tracking.log_axis({"reward": 1.0}, 3, "policy_version")
        assert not tracking.failed
    run_file = one(tmp_path, "wandb/offline-run-*/run-*.wandb")
    (_, row), _ = wandb_rows([run_file])
    counts, edges = np.histogram(np.concatenate(shards), 64)
    assert row["train_step"] == 0 and row["critic/score/mean"] == 0.5
    assert row["response/length/hist/values"] == counts.tolist()
    assert row["response/length/hist/bins"] == edges.tolist()
    assert row["perf/straggler/gen/slowest"] == "rank1, rank0"
    step_metric = {r.metric.name: r.metric.step_metric for r in wandb_records(run_file) if r.metric.name}
    assert step_metric["response/length/hist"] == step_metric["perf/straggler/gen/slowest"] == "train_step"
