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
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import rlmetrics
from rlmetrics.backends import local

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
def expected(sc: dict, step: int) -> dict[str, float]:
    """The single-process computation on the concatenation of all ranks' inputs of ``step``."""
    parts = [rank_step(sc, r, step) for r in range(sc["world"])]
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


def check(sc: dict, step: int, got) -> None:
    assert got.step == step, (got.step, step)
    assert got.meta.complete, got.meta
    want = expected(sc, step)
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
    from rlmetrics import steps

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


# ------------------------------------------------------------------------------------------- Ray
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_ray_actors_equal_the_concatenated_batch(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, rank):
            self.rank = rank
            self.clients = {}

        def step(self, name, sc, step, blocking):
            if name not in self.clients:
                self.clients[name] = rlmetrics.connect(
                    "ray", name=name, world_size=sc["world"], label=f"rank{self.rank}", rank=self.rank,
                    nan_strategy=sc["nan_strategy"], blocking=blocking,
                )  # fmt: skip
            run_rank(self.clients[name], sc, self.rank, step)

    actors = [Rank.remote(r) for r in range(4)]
    for i, sc in enumerate(draw_scenarios(4)):
        read = ("final", "result")[i % 2]
        name = f"diff-{uuid.uuid4().hex[:8]}"
        worker = rlmetrics.get_metric_worker(name=name)
        driver = rlmetrics.MetricClient(worker)
        try:
            for step in range(STEPS):
                ray.get([a.step.remote(name, sc, step, read == "final") for a in actors[: sc["world"]]])
                check(
                    sc, step, driver.wait_final_res() if read == "final" else driver.result(step, timeout=60)
                )
        finally:
            ray.kill(worker)
    for a in actors:
        ray.kill(a)


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
