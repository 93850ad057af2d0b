"""A rank's step counter that slips (issue 45, point 2), in the user's loop.

A rank catches the ``MetricValueError`` of a bad value and carries on without ``wait_submit()``
(as trainers do with metrics code): its counter is one behind the others'. The step it slipped at
may lose its data (partial, naming the rank); no later step does, no step holds data of another
step, and the rank is told once, with the advice that fits. Values are compared with numpy on the
data every rank sent.
"""

from __future__ import annotations

import threading
import time
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
            assert res.meta.missing_ranks and all(f"rank{slipped}" in m for m in res.meta.missing_ranks), (
                res.meta
            )
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
def local_loop(rank_step) -> tuple[list, list[list[str]]]:
    """The seed's loop in-process: a thread per rank runs ``rank_step(client, rank, step)`` (its
    warnings as text), joined, then the driver reads with ``wait_final_res()``."""
    name = f"slips-{uuid.uuid4().hex[:8]}"
    clients = [
        rlmetrics.connect("local", world_size=WORLD, name=name, label=f"rank{r}", final_timeout=FINAL_TIMEOUT)
        for r in range(WORLD)
    ]
    reader = rlmetrics.connect("local", name=name)
    results, rank_warnings = [], [[] for _ in range(WORLD)]
    try:
        for step in range(STEPS):

            def run(rank: int, step: int = step) -> None:
                rank_warnings[rank] += rank_step(clients[rank], rank, step)

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
    return results, rank_warnings


def test_a_caught_error_that_skips_a_close_costs_only_that_step_in_process():
    results, rank_warnings = local_loop(lambda c, r, s: train_step(c, r, s, SLIP if r == 1 else None))
    check_run(results, rank_warnings, slipped=1)


def test_a_rank_that_closes_a_step_twice_is_told_and_no_step_mixes_two_iterations():
    """Rank 1 calls wait_submit() twice in iteration 1 (its counter is one ahead). The read of
    iteration 2 ends, at its deadline, the step rank 1 closed empty on its way (rank 0's data alone,
    partial); then every rank goes on at the same step: each later read is one iteration's data of
    both ranks, no step mixes two iterations, and each rank is told once what happened."""

    def rank_step(client, rank: int, step: int) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = values(rank, step)
            client.submit_metric({"x/mean": x, "x/max": x, "x/min": x}, WORLD)
            client.wait_submit()
            if rank == 1 and step == SLIP:
                client.wait_submit()  # a second close: its counter is one ahead of the others'
        return [f"{w.category.__name__}: {w.message}" for w in caught]

    results, rank_warnings = local_loop(rank_step)
    for it, res in enumerate(results):
        got = {k: res[k] for k in ("x/mean", "x/max", "x/min")}
        if it <= SLIP:
            assert res.step == it and res.meta.complete, (it, res.meta)
            assert got == pytest.approx(expected(it, [0, 1]), rel=1e-9), it
        elif it == SLIP + 1:  # the read that found it: rank 0's data of this iteration alone, partial
            assert res.step == it and not res.meta.complete, res.meta
            assert got == pytest.approx(expected(it, [0]), rel=1e-9), it
        else:  # every rank one step on: complete, that iteration's numbers
            assert res.step == it + 1 and res.meta.complete, (it, res.meta)
            assert got == pytest.approx(expected(it, [0, 1]), rel=1e-9), it
    [told0], [told1] = rank_warnings
    assert "rank(s) rank1 had closed step" in told0 and "twice" in told0, told0
    assert "before rank(s) rank0 did" in told1 and "twice" in told1, told1


def test_a_rank_that_passes_the_trainers_step_is_not_moved():
    """A rank that skips a close but passes the trainer's step has nothing to catch up: its later
    steps are whole; it is told once that its data of the step it did not close was dropped."""

    def rank_step(client, rank: int, step: int) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = values(rank, step)
            client.submit_metric({"x/mean": x, "x/max": x, "x/min": x}, WORLD, step=step)
            try:
                client.submit_metric({"y": "oops" if (rank, step) == (1, SLIP) else 1.0}, WORLD, step=step)
                client.wait_submit(step=step)
            except MetricValueError:
                pass
        return [f"{w.category.__name__}: {w.message}" for w in caught]

    results, rank_warnings = local_loop(rank_step)
    for step, res in enumerate(results):
        assert res.step == step and res.meta.complete == (step != SLIP), (step, res.meta)
        got = {k: res[k] for k in ("x/mean", "x/max", "x/min")}
        assert got == pytest.approx(expected(step, [0] if step == SLIP else [0, 1]), rel=1e-9), step
    assert rank_warnings[0] == [], rank_warnings
    [told] = rank_warnings[1]
    assert "data for step(s) [1] came after" in told and "wait_submit() was skipped" in told, told


def test_a_rank_slower_than_a_finalizing_reader_is_never_moved_to_another_step():
    """A free-running loop: the reader ends step 1 at its deadline (result(..., finalize=True))
    while rank 1 has not even submitted it. Rank 1's step-1 data is dropped as late, with the
    advice for a slow rank; its step 2 is step 2's data (nothing re-targeted: a wrong number)."""
    name = f"slips-{uuid.uuid4().hex[:8]}"
    clients = [
        rlmetrics.connect("local", world_size=WORLD, name=name, label=f"rank{r}") for r in range(WORLD)
    ]
    reader = rlmetrics.connect("local", name=name)
    try:
        for step in range(3):
            for rank in (0, 1):
                if (rank, step) == (1, 1):  # rank 1 is late for step 1: the reader ends it first
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        partial = reader.result(1, 0.2, finalize=True)
                x = values(rank, step)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    clients[rank].submit_metric({"x/mean": x}, WORLD)
                    clients[rank].wait_submit()
                told = [str(w.message) for w in caught]
                if (rank, step) == (1, 1):
                    assert len(told) == 1 and "A reader's deadline ended it first" in told[0], told
                else:
                    assert not told, told
        assert partial["x/mean"] == pytest.approx(expected(1, [0])["x/mean"])
        res = reader.result(2, 30)
        assert res.meta.complete and res["x/mean"] == pytest.approx(expected(2, [0, 1])["x/mean"], rel=1e-9)
    finally:
        local.drop_worker(name)


# ---------------------------------------------------------------------------------------- Ray
def _rank_class(ray):
    @ray.remote(num_cpus=0)
    class Rank:
        """One rank per process, with the seed's ``MetricClient``."""

        def __init__(self, rank: int, worker, slow_watcher: float = 0.0) -> None:
            self.rank = rank
            self.client = MetricClient(worker, label=f"rank{rank}")
            if slow_watcher:  # this process's watcher hands notices over late
                from rlmetrics.backends.ray import transport

                tell = transport._Watcher._tell

                def slow_tell(watcher, *args):
                    time.sleep(slow_watcher)
                    tell(watcher, *args)

                transport._Watcher._tell = slow_tell

        def train_step(self, step: int, slip_at: int | None) -> list[str]:
            return train_step(self.client, self.rank, step, slip_at)

    return Rank


@pytest.mark.ray
@pytest.mark.slow
def test_a_caught_error_that_skips_a_close_costs_only_that_step_on_ray(ray_session):
    """One rank actor per process. The slipped rank's watcher is slow to hand over the news: the
    driver's read returns only once it did, so the rank's next iteration goes to the right step
    (not a race between the watcher and the driver's next call)."""
    ray = ray_session
    worker = rlmetrics.MetricWorker.remote(final_timeout=FINAL_TIMEOUT)
    ranks = [_rank_class(ray).remote(r, worker, 1.0 if r == 1 else 0.0) for r in range(WORLD)]
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
