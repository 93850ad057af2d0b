"""A rank whose process is gone, on a real local Ray instance: one client per rank actor
(``connect("ray", ..., rank=r)``), the driver reads each step, a real ``ray.kill``.

Ray knows at once that an actor died; the aggregator asks it about its ranks while a step waits, so
the step the dead rank did not close ends partial naming ``rank2`` within seconds (not at the 60 s
deadline), later steps complete on the survivors without ``set_world_size``, and the default
``lost_rank`` health rule reports it once. A rank that is alive but hung still gets the deadline.
"""

import time
import uuid
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import rlmetrics  # noqa: E402
from rlmetrics.health import Monitor  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORLD = 4
DEADLINE = 60.0  # the aggregator's final_timeout, left at its default
FAST = 30.0  # a read that did not wait for the deadline returns well within this


@pytest.fixture(scope="module", autouse=True)
def ray_instance(ray_session):
    """Every test of this module runs on the module's Ray instance (tests/conftest.py)."""


@pytest.fixture
def name():
    name = f"lost-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        ray.kill(ray.get_actor(name))
    except ValueError:
        pass


def rank_data(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([rank, step])
    return step * 100.0 + rng.random(3 + 2 * rank)


@ray.remote(num_cpus=0)
class Rank:
    """A trainer rank: its own process, one client made with its rank."""

    def __init__(self, rank: int, name: str, hierarchy: str | None = None):
        self.rank = rank
        opts = {"hierarchy": hierarchy} if hierarchy else {}
        self.client = rlmetrics.connect("ray", name=name, world_size=WORLD, rank=rank, **opts)

    def step(self, step: int) -> None:
        d = rank_data(self.rank, step)
        self.client.submit_metric({"x/mean": d, "x/max": d})
        self.client.submit_metric({"ranks/total": 1.0})
        self.client.wait_submit()

    def hang(self, seconds: float) -> None:
        time.sleep(seconds)


def read(reader, step: int, timeout: float = DEADLINE):
    """The logging driver's read of ``step``: the result, the seconds it took, the warnings."""
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = reader.result(step, timeout=timeout, finalize=True)
    return res, time.monotonic() - start, [str(w.message) for w in caught]


def check_values(res, step: int, ranks) -> None:
    cat = np.concatenate([rank_data(r, step) for r in ranks])
    assert res["x/mean"] == pytest.approx(cat.mean(), rel=1e-12), (step, dict(res))
    assert res["x/max"] == cat.max() and res["ranks/total"] == len(ranks), (step, dict(res))


@pytest.mark.parametrize(
    "killed, hierarchy",
    [("before_survivors_close", None), ("after_survivors_close", None), ("after_survivors_close", "node")],
    ids=["before", "after", "after-below-a-node"],
)
def test_killed_rank_ends_its_step_partial_at_once_and_later_steps_complete_without_it(
    name, killed, hierarchy
):
    # the driver owns the aggregator (and with hierarchy="node" its node sub-aggregator)
    rlmetrics.get_metric_worker(name=name, final_timeout=DEADLINE, hierarchy=hierarchy)
    ranks = [Rank.remote(r, name, hierarchy) for r in range(WORLD)]
    survivors = [0, 1, 3]
    reader = rlmetrics.connect("ray", name=name)
    monitor = Monitor()
    alerts = []
    for step in range(2):
        ray.get([a.step.remote(step) for a in ranks])
        res, took, caught = read(reader, step)
        assert res.meta.complete and not caught, (res.meta, caught)
        check_values(res, step, range(WORLD))
        alerts += monitor.observe(step, res)
    if killed == "before_survivors_close":
        ray.kill(ranks[2])  # it closed step 1; step 2 is the one it did not close
        ray.get([ranks[r].step.remote(2) for r in survivors])
    else:
        ray.get([ranks[r].step.remote(2) for r in survivors])
        ray.kill(ranks[2])
    res, took, caught = read(reader, 2)
    assert took < FAST, f"step 2 took {took:.1f} s: it waited for the deadline"
    assert not res.meta.complete and len(res.meta.missing_ranks) == 1, res.meta
    assert res.meta.missing_ranks[0].startswith("rank2@"), res.meta.missing_ranks
    assert list(res.meta.lost) == res.meta.missing_ranks, res.meta.lost
    assert res.meta.missing_metrics["x/mean"] == [3, 4], res.meta.missing_metrics
    check_values(res, 2, survivors)
    assert any("rank2" in c and "partial" in c for c in caught), caught
    alerts += monitor.observe(2, res)
    for step in (3, 4):  # no set_world_size: the names rank2 sent expect 3 contributions now
        ray.get([ranks[r].step.remote(step) for r in survivors])
        res, took, caught = read(reader, step)
        assert took < FAST and res.meta.complete and not caught, (step, took, res.meta, caught)
        assert res.meta.contributions == [9, 9], res.meta.contributions
        check_values(res, step, survivors)
        alerts += monitor.observe(step, res)
    lost = [a for a in alerts if a.rule == "lost_rank"]
    assert len(lost) == 1 and lost[0].step == 2 and "rank2" in lost[0].message, alerts
    assert [a.rule for a in alerts] == ["lost_rank"], alerts
    for r in survivors:
        ray.kill(ranks[r])
    if hierarchy:
        ray.kill(ray.get_actor(f"{name}/node/{ray.get_runtime_context().get_node_id()}"))


def test_hung_but_alive_rank_still_gets_the_deadline(name):
    rlmetrics.get_metric_worker(name=name, final_timeout=DEADLINE)
    ranks = [Rank.remote(r, name) for r in range(WORLD)]
    reader = rlmetrics.connect("ray", name=name)
    ray.get([a.step.remote(0) for a in ranks])
    assert read(reader, 0)[0].meta.complete
    ranks[2].hang.remote(60)  # alive, busy: its actor is not dead
    ray.get([ranks[r].step.remote(1) for r in (0, 1, 3)])
    res, took, caught = read(reader, 1, timeout=4)
    assert took >= 4 - 0.5, f"returned after {took:.1f} s, before its deadline"  # not taken for dead
    assert not res.meta.complete and res.meta.missing_ranks[0].startswith("rank2@"), res.meta
    assert not res.meta.lost, res.meta.lost
    check_values(res, 1, [0, 1, 3])
    for a in ranks:
        ray.kill(a)
