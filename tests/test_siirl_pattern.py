"""siiRL 0.2.0's DAGWorker metrics pattern, run on Ray as its code runs it (``docs/siirl.md``).

DP x TP ``DAGWorker`` actors (``num_cpus=0``), each with ``self.metric_worker = MetricClient(...)`` of
the driver's ``MetricWorker``. A training step (``DAGWorker._run_training_step``): only the
``tp_rank == 0`` ranks submit, on their dp shard: the node's metrics with ``submit_metric(..., dp)``,
``compute_local_data_metric(batch, dp)``, ``compute_local_throughout_metrics(batch, timing, pp * tp,
dp)``; rank 0 alone adds ``compute_local_timing_metrics(batch, timing, 1)``. EVERY rank then calls
``wait_submit()``, the ranks meet at a barrier (here ``ray.get`` of all of them), and rank 0's own
client calls ``wait_final_res()``. A validation round (``Validator.validate`` then
``execute_task_graph``'s ``wait_submit`` / barrier / rank 0's ``wait_final_res``) the same way, with
``process_local_validation_metrics`` on each dp shard.

Every value is checked against the single-process computation on the concatenated dp shards
(``tests/harness.py``'s inputs and reference), and every read returns at once although
``final_timeout`` is 60 s: the tp ranks that only call ``wait_submit()`` are never waited for.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")  # tests.harness imports it

import rlmetrics  # noqa: E402
from rlmetrics import MetricClient  # noqa: E402
from rlmetrics.metrics.timing import compute_throughput_metrics, compute_timing_metrics  # noqa: E402
from tests.harness import expected, rank_step  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.ray, pytest.mark.slow]

DP, TP, PP = 2, 2, 1
FINAL_TIMEOUT = 60.0
QUICK = 10.0  # a read that waited for no deadline returns well within this


def spec(val: list[int]) -> dict:
    """One step of a harness scenario (``tests/harness.py``): float64 shards of unequal size, no bad value."""
    return {
        "sizes": [3, 5], "prompt": 4, "response": 6, "multi_turn": True, "float64": True,
        "bad": None, "val": val,
    }  # fmt: skip


# steps 0 and 2: training; 1 and 3: validation rounds (a prompt's samples sit on both dp ranks)
SC = {"world": DP, "nan_strategy": "propagate", "seed": 11, "steps": [spec([0, 0]), spec([4, 3])] * 2}
TRAIN, VALIDATE = (0, 2), (1, 3)
TRAIN_FAMILIES = ("data", "throughput", "plain")  # tests.harness.METRICS rows a training step submits


def node_metrics(d: dict) -> dict:
    """What a node returns in ``node_output.metrics`` (lists, a weighted value, a count)."""
    x = d["plain"]["x"]
    return {"x/mean": x.tolist(), "x/max": x, "x/std": x, "x/p90": x.tolist(),
            "wx/mean": (x, d["plain"]["w"]), "n/total": d["plain"]["n"]}  # fmt: skip


def want_train(step: int) -> dict[str, float]:
    """The reference of a training step: the concatenation's data, throughput and node metrics
    (``expected``), rank 0's timings alone (siiRL submits them from rank 0 with ``world_size=1``)."""
    skip = "group/"  # the data family's group_by, which siiRL does not pass
    want = {k: v for k, v in expected(SC, step, metrics=TRAIN_FAMILIES).items() if not k.startswith(skip)}
    shards = [rank_step(SC, r, step) for r in range(DP)]
    cat = {k: torch.cat([d["batch"][k] for d in shards]) for k in shards[0]["batch"] if k != "data_source"}
    mean_timing = {s: float(np.mean([d["timing"][s] for d in shards])) for s in shards[0]["timing"]}
    throughput = compute_throughput_metrics(cat, mean_timing, DP * PP * TP, nan_strategy=SC["nan_strategy"])
    want["perf/throughput"] = throughput["perf/throughput"]  # each shard ran on pp * tp GPUs
    timing = compute_timing_metrics(shards[0]["batch"], shards[0]["timing"], nan_strategy=SC["nan_strategy"])
    want.update({k.replace("timing_s/", "perf/delta_time/"): v for k, v in timing.items()})
    return want


def _dag_worker_class(ray):
    @ray.remote(num_cpus=0)
    class DAGWorker:
        """The metrics calls of siiRL's DAGWorker (and its Validator, which shares the client)."""

        def __init__(self, rank: int, metric_worker):
            self._rank = rank
            self.dp_rank, self.tp_rank = divmod(rank, TP)
            self.metric_worker = MetricClient(metric_worker=metric_worker)

        def run_training_step(self, step: int) -> None:
            if self.tp_rank == 0:
                d = rank_step(SC, self.dp_rank, step)
                batch = {k: v for k, v in d["batch"].items() if k != "data_source"}
                self.metric_worker.submit_metric(node_metrics(d), DP)
                self.metric_worker.compute_local_data_metric(batch, DP)
                self.metric_worker.compute_local_throughout_metrics(batch, d["timing"], PP * TP, DP)
                if self._rank == 0:
                    self.metric_worker.compute_local_timing_metrics(batch, d["timing"], 1)
            self.metric_worker.wait_submit()

        def validate(self, step: int) -> None:
            if self.tp_rank == 0:
                samples = rank_step(SC, self.dp_rank, step)["val"]  # sources, inputs, infos, turns
                self.metric_worker.process_local_validation_metrics(*samples, DP)
            self.metric_worker.wait_submit()

        def validate_without_batches(self) -> None:
            """``Validator.validate`` returns at once when ``num_val_batches <= 0``; the
            ``wait_submit()`` after it closes an empty round."""
            self.metric_worker.wait_submit()

        def wait_final_res(self):
            start = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res = self.metric_worker.wait_final_res()
            return res, time.monotonic() - start, [str(w.message) for w in caught]

    return DAGWorker


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_siirl_dagworker_pattern_dp_by_tp_equals_the_concatenated_shards(ray_session):
    ray = ray_session
    metric_worker = rlmetrics.MetricWorker.remote(final_timeout=FINAL_TIMEOUT)  # no start(): MainRunner.run
    workers = [_dag_worker_class(ray).remote(rank, metric_worker) for rank in range(DP * TP)]
    try:
        for step in range(4):
            if step in TRAIN:
                ray.get([w.run_training_step.remote(step) for w in workers])  # the step's dist.barrier
                want = want_train(step)
            else:
                ray.get([w.validate.remote(step) for w in workers])
                want = expected(SC, step, metrics=("validation",))
            res, took, caught = ray.get(workers[0].wait_final_res.remote())
            assert took < QUICK, f"step {step}: wait_final_res took {took:.1f} s (waited for a deadline?)"
            assert not caught, caught
            assert res.step == step and res.meta.complete and not res.meta.missing_ranks, res.meta
            assert len(res.meta.contributors) == DP, res.meta.contributors  # tp_rank != 0 never counts
            check_values(res, want, step)
        registered = ray.get(metric_worker.stats.remote())["clients"]
        assert len(registered) == DP, registered  # the tp ranks that only call wait_submit() never register
    finally:
        for actor in (*workers, metric_worker):
            ray.kill(actor)


def check_values(res, want: dict[str, float], step: int) -> None:
    """``tests.harness.check``'s comparison, on the names of ``want``."""
    own = ("meta/coverage", "meta/late", "perf/process_cpu_mem_used_gb")  # not of the data
    got = {k: v for k, v in res.items() if k not in own}
    assert set(got) == set(want), ("names differ", step, sorted(set(got) ^ set(want)))
    bad = {k: (got[k], v) for k, v in want.items() if not (got[k] == pytest.approx(v, rel=1e-9, abs=1e-12))}
    assert not bad, (step, bad)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_ranks_closing_an_empty_validation_round_before_rank_0_reads_are_not_waited_for(ray_session):
    """After a training step's barrier rank 0 reads, while the others (no barrier in between when
    there are no validation batches) already close the empty validation round: rank 0's read is the
    training step at once, and the empty round, once rank 0 closed it too, reads empty at once."""
    ray = ray_session
    metric_worker = rlmetrics.MetricWorker.remote(final_timeout=FINAL_TIMEOUT)  # no start(): MainRunner.run
    workers = [_dag_worker_class(ray).remote(rank, metric_worker) for rank in range(DP * TP)]
    try:
        ray.get([w.run_training_step.remote(0) for w in workers])
        ray.get([w.validate_without_batches.remote() for w in workers[1:]])
        res, took, caught = ray.get(workers[0].wait_final_res.remote())
        assert (res.step, res.meta.complete, caught) == (0, True, []) and took < QUICK, (res.meta, took)
        check_values(res, want_train(0), 0)
        ray.get(workers[0].validate_without_batches.remote())
        res, took, caught = ray.get(workers[0].wait_final_res.remote())
        assert (res.step, dict(res), res.meta.complete, caught) == (1, {}, True, []) and took < QUICK
    finally:
        for actor in (*workers, metric_worker):
            ray.kill(actor)
