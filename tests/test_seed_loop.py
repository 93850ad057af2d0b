"""The seed's own loop, written as a siiRL user writes it, on every backend.

Every rank calls ``compute_local_data_metric`` / ``submit_metric`` / ``compute_local_timing_metrics``
and then ``wait_submit()`` for a step; the driver waits for the ranks (``ray.get`` of their step
calls, joining threads, or the collective itself) and reads with ``wait_final_res()`` only. Every
step must be that step's numbers: numpy on the concatenated batches of all ranks of that step.
The other tests are the ways a step used to be closed, emptied or lost by accident (issue 15).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import rlmetrics
from rlmetrics import LocalMetricWorker, MetricClient

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.ray, pytest.mark.slow]

STEPS = 10
PROMPT, RESPONSE = 5, 12


# ------------------------------------------------------------------------------------------------ data
def rank_batch(rank: int, step: int) -> dict:
    """One rank's batch of one step: its size differs across ranks and steps."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    b = 1 + (rank * 7 + step * 3) % 6
    lengths = torch.randint(1, RESPONSE + 1, (b,), generator=g)
    mask = (torch.arange(RESPONSE)[None, :] < lengths[:, None]).long()
    scores = torch.zeros(b, RESPONSE)
    scores[torch.arange(b), lengths - 1] = torch.randint(0, 2, (b,), generator=g).float()
    return {
        "responses": torch.zeros(b, RESPONSE, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(b, PROMPT, dtype=torch.long), mask], 1),
        "response_mask": mask,
        "token_level_scores": scores,
        "token_level_rewards": scores - 0.1 * mask,
        "advantages": torch.randn(b, RESPONSE, generator=g) * mask,
    }


def rank_scalars(rank: int, step: int) -> tuple[float, dict[str, float]]:
    """A rank's loss and its phase timings."""
    rng = np.random.default_rng([rank, step])
    return float(rng.normal()), {"gen": float(rng.uniform(0.1, 1.0)), "step": float(rng.uniform(1.0, 2.0))}


def run_rank_step(client, rank: int, step: int, world: int) -> None:
    """The seed's per-step calls of one rank."""
    batch = rank_batch(rank, step)
    loss, timing = rank_scalars(rank, step)
    client.compute_local_data_metric(batch, world)
    client.submit_metric({"actor/pg_loss": loss}, world)
    client.compute_local_timing_metrics(batch, timing, world)
    client.wait_submit()


def expected(step: int, world: int) -> dict[str, float]:
    """numpy on the concatenated batches (sequence- and token-weighted), and per-rank scalars."""
    batches = [rank_batch(r, step) for r in range(world)]
    mask = np.concatenate([b["response_mask"].numpy() for b in batches]).astype(bool)
    score = np.concatenate([b["token_level_scores"].numpy().sum(1) for b in batches])
    adv = np.concatenate([b["advantages"].numpy() for b in batches])[mask]
    length = mask.sum(1)
    scalars = [rank_scalars(r, step) for r in range(world)]
    return {
        "critic/score/mean": score.mean(),
        "critic/score/max": score.max(),
        "critic/advantages/mean": adv.mean(),
        "critic/advantages/min": adv.min(),
        "response/length/mean": length.mean(),
        "response/length/max": length.max(),
        "actor/pg_loss": np.mean([loss for loss, _ in scalars]),
        "perf/delta_time/gen": np.mean([t["gen"] for _, t in scalars]),
    }


def check_step(res, step: int, world: int) -> None:
    assert res.step == step, f"read step {res.step} after the ranks closed step {step}"
    assert res.meta.complete, res.meta
    exp = expected(step, world)
    got = {k: res[k] for k in exp}
    assert got == pytest.approx(exp, rel=1e-6, abs=1e-6), step  # float32 tensors


# ------------------------------------------------------------------------------------------------- Ray
def _rank_host_class(ray):
    @ray.remote(num_cpus=0)
    class RankHost:
        """One actor process holding several ranks, each with the seed's ``MetricClient``."""

        def __init__(self, ranks, world, worker):
            self.world = world
            self.clients = {r: MetricClient(worker, label=f"rank{r}") for r in ranks}

        def step(self, step):
            for rank, client in self.clients.items():
                run_rank_step(client, rank, step, self.world)

    return RankHost


def ray_seed_loop(ray, world: int, restart_at: int | None = None) -> None:
    worker = rlmetrics.MetricWorker.remote()
    ray.get(worker.start.remote())
    hosts = [_rank_host_class(ray).remote(list(range(h, world, 4)), world, worker) for h in range(4)]
    driver = MetricClient(worker)
    try:
        for step in range(STEPS):
            if step == restart_at:
                ray.kill(worker, no_restart=False)
            ray.get([h.step.remote(step) for h in hosts])  # siiRL's stand-in for the barrier
            check_step(driver.wait_final_res(), step, world)
    finally:
        for actor in (*hosts, worker):
            ray.kill(actor)


@pytest.mark.parametrize("world", [8, 64])
def test_ray_seed_loop_reads_each_steps_own_numbers(ray_session, world):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no partial step, no late step
        ray_seed_loop(ray_session, world)


def test_ray_seed_loop_survives_an_aggregator_restart_mid_run(ray_session):
    ray_seed_loop(ray_session, 8, restart_at=STEPS // 2)


def test_ray_direct_worker_rounds_start_a_new_round_after_each_read(ray_session):
    worker = rlmetrics.MetricWorker.remote()
    try:
        for r in range(3):
            ray_session.get(worker.submit_metric.remote({"loss": float(r), "x/max": [r, 2 * r]}, 1))
            ray_session.get(worker.submit_metric.remote({"extra": 10.0 + r}, 1))  # same round
            res = ray_session.get(worker.wait_final_res.remote())
            assert dict(res) == {"loss": float(r), "x/max": 2.0 * r, "extra": 10.0 + r}
    finally:
        ray_session.kill(worker)


@pytest.mark.parametrize("scenario", ["submit_ahead", "read_ahead"])
def test_ray_submit_ahead_and_read_ahead_close_nothing_early(ray_session, scenario):
    worker = rlmetrics.get_metric_worker(name=f"ahead-{uuid.uuid4().hex[:8]}")
    try:
        globals()[scenario](lambda r: MetricClient(worker, label=f"rank{r}"), MetricClient(worker))
    finally:
        ray_session.kill(worker)


# ----------------------------------------------------------------------------------------------- local
def test_local_seed_loop_reads_each_steps_own_numbers():
    world = 8
    worker = LocalMetricWorker()
    clients = [MetricClient(worker, label=f"rank{r}") for r in range(world)]
    driver = MetricClient(worker)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for step in range(STEPS):
            args = [(c, r, step, world) for r, c in enumerate(clients)]
            threads = [threading.Thread(target=run_rank_step, args=a) for a in args]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            check_step(driver.wait_final_res(), step, world)


def test_local_direct_worker_rounds_start_a_new_round_after_each_read():
    worker = LocalMetricWorker()
    for r in range(3):
        worker.submit_metric({"loss": float(r), "x/max": [r, 2 * r]}, 1)
        worker.submit_metric({"extra": 10.0 + r}, 1)  # the same round
        assert dict(worker.wait_final_res()) == {"loss": float(r), "x/max": 2.0 * r, "extra": 10.0 + r}


def submit_ahead(new_rank, reader) -> None:
    """Two ranks at step 0 also submit for step 1: step 1 is closed only by the ranks' own
    ``wait_submit`` for it, and holds both the metric sent ahead and the ranks' own."""
    ranks = [new_rank(r) for r in range(2)]
    for step in range(2):
        for r, c in enumerate(ranks):
            c.submit_metric({"own/mean": [float(r + step)]}, 2)
            if step == 0:
                c.submit_metric({"ahead/mean": 10.0 + r}, 2, step=1)
            c.wait_submit()
        res = reader.wait_final_res()
        want = {"own/mean": 0.5 + step} | ({"ahead/mean": 10.5} if step == 1 else {})
        assert res.step == step and res.meta.complete and dict(res) == want, (step, res, res.meta)


def read_ahead(new_rank, reader) -> None:
    """Ranks at step 1 (step 0 read), a reader looks at step 4 with a short deadline (provisional,
    nothing finalized), then reads it with ``finalize=True``: nothing reached step 4, so that ends
    nothing either (issue 45: it says where the ranks are); steps 1-4 come complete and exact."""
    ranks = [new_rank(r) for r in range(2)]
    for r, c in enumerate(ranks):
        c.submit_metric({"own/mean": [float(r)]}, 2)
        c.wait_submit()
    assert reader.result(0, timeout=30) == {"own/mean": 0.5}
    look = reader.result(4, timeout=0.3)
    assert look.step == 4 and look.meta.provisional and not look.meta.complete
    with pytest.warns(RuntimeWarning, match="no rank has submitted anything for step 4"):
        early = reader.result(4, timeout=0.3, finalize=True)
    assert early.step == 4 and not early.meta.complete and early.meta.provisional
    for step in (1, 2, 3, 4):
        for r, c in enumerate(ranks):
            c.submit_metric({"own/mean": [float(r + step)]}, 2)
            c.wait_submit()
        res = reader.result(step, timeout=30)
        assert res.step == step and res.meta.complete and dict(res) == {"own/mean": 0.5 + step}, res.meta


@pytest.mark.parametrize("scenario", [submit_ahead, read_ahead])
def test_local_submit_ahead_and_read_ahead_close_nothing_early(scenario):
    worker = LocalMetricWorker()
    scenario(lambda r: MetricClient(worker, label=f"rank{r}"), MetricClient(worker))


def test_wait_submit_warns_when_all_its_data_is_for_a_later_step():
    client = MetricClient(LocalMetricWorker(), world_size=1)
    client.submit_metric({"x": 1.0}, step=1)  # a verl-style global step starting at 1
    with pytest.warns(RuntimeWarning, match=r"closes step 0, but .* step\(s\) \[1\]"):
        client.wait_submit()
    client.wait_submit(step=1)  # the explicit form closes the step the data is for
    assert dict(client.wait_final_res(timeout=5)) == {"x": 1.0}


def test_a_lagging_reader_is_warned_that_a_result_is_no_longer_kept():
    worker = LocalMetricWorker(keep_results=3)
    rank, reader = MetricClient(worker, world_size=1), MetricClient(worker)
    for step in range(6):
        rank.submit_metric({"x": float(step)})
        rank.wait_submit()
    assert dict(reader.result(5)) == {"x": 5.0}  # finalized when complete, read or not
    with pytest.warns(RuntimeWarning, match="step 1 is no longer kept"):
        lost = reader.result(1)
    assert lost == {} and lost.meta.evicted


# ----------------------------------------------------------------------------------------------- torch
TORCH_WORLD = 4


def _torch_rank(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=TORCH_WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        client = rlmetrics.connect("torch")
        results = []
        for step in range(STEPS):
            run_rank_step(client, rank, step, TORCH_WORLD)  # wait_submit: the collective
            if rank == 0:
                results.append(client.wait_final_res())
    finally:
        dist.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


def test_torch_seed_loop_reads_each_steps_own_numbers(tmp_path):
    cmd = [sys.executable, __file__, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert len(results) == STEPS
    for step, res in enumerate(results):
        check_step(res, step, TORCH_WORLD)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_torch_rank, args=(sys.argv[1],), nprocs=TORCH_WORLD, join=True)
