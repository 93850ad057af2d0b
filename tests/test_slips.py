"""A rank's step counter that slips (issue 45, point 2), in the user's loop.

A rank catches the ``MetricValueError`` of a bad value and carries on without ``wait_submit()``
(as trainers do with metrics code): its counter is one behind the others'. The step it slipped at
may lose its data (partial, naming the rank); no later step does, no step holds data of another
step, and the rank is told once, with the advice that fits. Values are compared with numpy on the
data every rank sent.
"""

from __future__ import annotations

import threading
import uuid
import warnings

import numpy as np
import pytest

import rlmetrics
from rlmetrics import MetricClient
from rlmetrics.backends import local
from rlmetrics.core.stat import MetricValueError

WORLD, STEPS, SLIP = 2, 5, 1
FINAL_TIMEOUT = 3.0  # what the slipped step costs: the deadline of the read that ends it


def values(rank: int, step: int) -> list[float]:
    """A rank's ``x`` values of one step (sizes differ across ranks and steps)."""
    rng = np.random.default_rng([rank, step])
    return list(rng.normal(step + rank, 1.0, size=1 + (rank + step) % 3))


def train_step(client, rank: int, step: int, slip_at: int | None) -> list[str]:
    """One rank's metrics calls of one iteration; at ``slip_at`` the bad value raises, the rank
    catches it and skips the close. The warnings it got, as text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = values(rank, step)
        client.submit_metric({"x/mean": x, "x/max": x, "x/min": x}, WORLD)
        try:
            if step == slip_at:
                client.submit_metric({"y": "oops"}, WORLD)  # raises: the rank catches it ...
            else:
                client.submit_metric({"y": float(rank)}, WORLD)
            client.wait_submit()
        except MetricValueError:
            pass  # ... and carries on with its next iteration, without wait_submit()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def expected(step: int, ranks: list[int]) -> dict[str, float]:
    x = np.concatenate([values(r, step) for r in ranks])
    return {"x/mean": float(x.mean()), "x/max": float(x.max()), "x/min": float(x.min())}


def check_run(results: list, rank_warnings: list[list[str]], slipped: int) -> None:
    """Each step's read is that step's numbers; only the slip step lacks the slipped rank, named;
    the slipped rank is told once, with the advice to close every step."""
    for step, res in enumerate(results):
        assert res.step == step, (step, res.step)
        ranks = list(range(WORLD))
        if step == SLIP:
            ranks = [r for r in ranks if r != slipped]
            assert res.meta.missing_ranks and all(f"rank{slipped}" in m for m in res.meta.missing_ranks), res.meta
        else:
            assert res.meta.complete and not res.meta.missing_ranks, (step, res.meta)
        got = {k: res[k] for k in ("x/mean", "x/max", "x/min")}
        assert got == pytest.approx(expected(step, ranks), rel=1e-9), step
    told = [w for w in rank_warnings[slipped] if "wait_submit" in w and "skipped" in w]
    assert len(told) == 1, rank_warnings[slipped]
    assert f"rank{slipped}" in told[0] and "step=" in told[0], told[0]
    assert not any("longer" in w for w in rank_warnings[slipped]), rank_warnings[slipped]
    others = [w for r, ws in enumerate(rank_warnings) if r != slipped for w in ws]
    assert not others, others


# --------------------------------------------------------------------------- in-process backend
def test_a_caught_error_that_skips_a_close_costs_only_that_step_in_process():
    name = f"slips-{uuid.uuid4().hex[:8]}"
    clients = [rlmetrics.connect("local", world_size=WORLD, name=name, label=f"rank{r}", final_timeout=FINAL_TIMEOUT) for r in range(WORLD)]
    reader = rlmetrics.connect("local", name=name)
    results, rank_warnings = [], [[] for _ in range(WORLD)]
    try:
        for step in range(STEPS):
            def run(rank: int) -> None:
                rank_warnings[rank] += train_step(clients[rank], rank, step, SLIP if rank == 1 else None)

            threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results.append(reader.wait_final_res())
    finally:
        local.drop_worker(name)
    check_run(results, rank_warnings, slipped=1)


# ---------------------------------------------------------------------------------------- Ray
def _rank_class(ray):
    @ray.remote(num_cpus=0)
    class Rank:
        """One rank per process, with the seed's ``MetricClient``."""

        def __init__(self, rank: int, worker) -> None:
            self.rank = rank
            self.client = MetricClient(worker, label=f"rank{rank}")

        def train_step(self, step: int, slip_at: int | None) -> list[str]:
            return train_step(self.client, self.rank, step, slip_at)

    return Rank


@pytest.mark.ray
@pytest.mark.slow
def test_a_caught_error_that_skips_a_close_costs_only_that_step_on_ray(ray_session):
    ray = ray_session
    worker = rlmetrics.MetricWorker.remote(final_timeout=FINAL_TIMEOUT)
    ranks = [_rank_class(ray).remote(r, worker) for r in range(WORLD)]
    driver = MetricClient(worker)
    results, rank_warnings = [], [[] for _ in range(WORLD)]
    try:
        for step in range(STEPS):
            told = ray.get([a.train_step.remote(step, SLIP if r == 1 else None) for r, a in enumerate(ranks)])
            for r, ws in enumerate(told):
                rank_warnings[r] += ws
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results.append(driver.wait_final_res())
    finally:
        for actor in (*ranks, worker):
            ray.kill(actor)
    check_run(results, rank_warnings, slipped=1)
