"""meta/coverage and meta/late per step on the local backend: a rank that does not submit makes a
partial step whose coverage is the share of contributions that arrived (counted from the test's own
plan), a late submission is counted at the next step finalized; both reach the JSONL file through
Tracking, as a dashboard would read them."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

import rlmetrics
from rlmetrics.backends import local
from rlmetrics.sinks import JsonlSink, Tracking, read_jsonl

WORLD = 3
# step -> {rank: names it submits}; rank 2 is silent in step 1 and sends it late, after step 1 is final
PLAN = {
    0: {0: {"a", "b/max"}, 1: {"a", "b/max"}, 2: {"a", "b/max"}},
    1: {0: {"a", "b/max", "c"}, 1: {"a"}},
    2: {0: {"a", "b/max"}, 1: {"a", "b/max"}, 2: {"a", "b/max"}},
    3: {0: {"a"}, 1: {"a"}, 2: {"a"}},
}


def reference_coverage(plan_step):
    names = set().union(*plan_step.values())
    received = sum(name in sent for sent in plan_step.values() for name in names)
    return received / (WORLD * len(names))


@pytest.fixture
def worker_name():
    yield "coverage-test"
    local.drop_worker("coverage-test")


def test_partial_step_and_late_submission(tmp_path, worker_name):
    ranks = [rlmetrics.connect("local", world_size=WORLD, name=worker_name) for _ in range(WORLD)]
    reader = rlmetrics.connect("local", name=worker_name)
    results = []
    with Tracking([JsonlSink(tmp_path / "m.jsonl")], health=None) as tracking:
        for step, plan in PLAN.items():
            for rank, names in plan.items():
                ranks[rank].submit_metric({n: float(rank + step) for n in sorted(names)}, step=step)
                ranks[rank].wait_submit(step=step)
            with pytest.warns(RuntimeWarning, match="partial") if step == 1 else nullcontext():
                result = reader.result(step, timeout=0.3 if step == 1 else 10, finalize=True)
            if step == 1:  # rank 2 wakes up: its step 1 arrives after the step is final, and it is told
                ranks[2].submit_metric({"a": 9.0}, step=1)
                with pytest.warns(rlmetrics.LateDataWarning, match=r"step\(s\) \[1\]"):
                    ranks[2].wait_submit(step=1)
            results.append(result)
            tracking.log(result, step)
    assert [r.meta.complete for r in results] == [True, False, True, True]
    assert results[1].meta.missing_ranks == [ranks[2].client_id]
    run = read_jsonl(tmp_path / "m.jsonl")
    coverage = run.series("meta/coverage")[1].tolist()
    assert coverage == [reference_coverage(PLAN[s]) for s in PLAN] == [1.0, 4 / 9, 1.0, 1.0]
    assert run.series("meta/late")[1].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert run.records[1]["meta"]["contributions"] == [4, 9]
