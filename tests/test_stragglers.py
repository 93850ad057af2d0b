"""The straggler report (issue 33 point 1): each rank's own stage seconds, reported over ranks exactly
(numpy over the per-rank timings), the slowest ranks by name, JSONL, and the ``straggler`` health rule.
Every backend runs it in the differential harness (``tests/harness.py``, the ``stragglers`` row)."""

import json
import pickle

import numpy as np
import pytest

from rlmetrics.backends import MetricClient, local
from rlmetrics.core.states import decode_state, encode_state
from rlmetrics.health import Monitor, Straggler
from rlmetrics.messages import StepResult
from rlmetrics.metrics import catalog
from rlmetrics.metrics.stragglers import STATS, StageTimes
from rlmetrics.sinks import make_sinks
from rlmetrics.sinks.jsonl import read_jsonl, record_result

pytestmark = pytest.mark.torch  # stage times are read as timing_raw is (tensors too)

STAGES = ("gen", "update_actor", "step")


def run(times: list[list[dict[str, float]]], **connect) -> list[tuple[list[str], StepResult]]:
    """Each step's result of W local clients, rank i submitting ``times[step][i]``."""
    worker = local.LocalMetricWorker()
    world = len(times[0])
    clients = [MetricClient(worker, world_size=world, label=f"rank{i}") for i in range(world)]
    out = []
    for step, per_rank in enumerate(times):
        for client, timing in zip(clients, per_rank):
            client.compute_local_straggler_metrics(timing, step=step)
            client.wait_submit()
        out.append(([c.client_id for c in clients], clients[0].result(step)))
    return out


def reference(ids: list[str], per_rank: list[dict[str, float]], stage: str) -> tuple[dict, list[str]]:
    t = np.array([timing[stage] for timing in per_rank])
    head = f"perf/straggler/{stage}/"
    floats = {head + "min": t.min(), head + "p50": np.median(t), head + "max": t.max()}
    floats[head + "max_over_p50"] = t.max() / np.median(t)
    order = sorted(range(len(ids)), key=lambda i: (-t[i], ids[i]))
    return floats, [ids[i] for i in order[:3]]


@pytest.mark.parametrize("world", [1, 2, 5])
def test_the_report_is_numpy_over_the_ranks_own_times(world):
    rng = np.random.default_rng(world)
    times = [[{s: float(rng.uniform(0.1, 3.0)) for s in STAGES} for _ in range(world)] for _ in range(3)]
    for (ids, res), per_rank in zip(run(times), times):
        assert res.meta.complete
        want_lists = {}
        want = {}
        for stage in STAGES:
            floats, slowest = reference(ids, per_rank, stage)
            want |= floats
            want_lists[f"perf/straggler/{stage}/slowest"] = slowest
        assert dict(res) == pytest.approx(want, rel=1e-15) and set(res) == set(want)
        assert res.lists == want_lists


def test_a_stage_only_some_ranks_time_and_a_zero_median():
    (ids, res), *_ = run([[{"gen": 1.0, "ref": 0.0}, {"gen": 3.0, "ref": 0.0}, {"gen": 2.0}]])
    assert res["perf/straggler/gen/p50"] == 2.0 and res["perf/straggler/gen/max_over_p50"] == 1.5
    assert res["perf/straggler/ref/max"] == 0.0 and "perf/straggler/ref/max_over_p50" not in res  # 0 / 0
    assert res.lists["perf/straggler/gen/slowest"] == [ids[1], ids[2], ids[0]]
    assert res.lists["perf/straggler/ref/slowest"] == sorted(ids[:2])  # a tie: by name


def test_non_finite_times_and_non_numbers_are_left_out():
    (ids, res), *_ = run([[{"gen": 1.0, "ref": float("nan")}, {"gen": 6.0, "ref": 1.0, "note": "slow"}]])
    assert res["perf/straggler/gen/min"] == 1.0 and res["perf/straggler/gen/max"] == 6.0
    assert res.lists == {"perf/straggler/gen/slowest": ids[::-1], "perf/straggler/ref/slowest": [ids[1]]}


def test_a_rank_is_named_by_its_rank_else_its_client_id_or_as_asked():
    worker = local.LocalMetricWorker()
    a, b, c = (MetricClient(worker, world_size=3, rank=r) for r in (0, None, None))
    for client, seconds in zip((a, b, c), (3.0, 2.0, 1.0)):
        extra = {"name": "trainer-7"} if client is c else {}
        client.compute_local_straggler_metrics({"gen": seconds}, step=0, **extra)
        client.wait_submit()
    assert a.result(0).lists["perf/straggler/gen/slowest"] == ["rank0", b.client_id, "trainer-7"]


def test_a_ranks_pairs_add_up_per_stage():
    state = StageTimes([("r0", {"gen": 1.0}), ("r1", {"gen": 5.0})]).merge(StageTimes([("r0", {"gen": 2.0})]))
    assert state.reduce("", None, None)["perf/straggler/gen/min"] == 3.0


def test_opt_in_from_compute_local_timing_metrics():
    import torch

    batch = {"responses": torch.zeros(1, 2), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    worker = local.LocalMetricWorker()
    plain, asked = MetricClient(worker, world_size=1), MetricClient(local.LocalMetricWorker(), world_size=1)
    plain.compute_local_timing_metrics(batch, {"gen": 1.0}, step=0)
    asked.compute_local_timing_metrics(batch, {"gen": torch.tensor(1.0)}, step=0, stragglers=True)
    plain.wait_submit(), asked.wait_submit()
    assert not [n for n in plain.result(0) if n.startswith("perf/straggler/")]
    got = asked.result(0)
    assert {n for n in got if n.startswith("perf/straggler/")} == {f"perf/straggler/gen/{s}" for s in STATS}
    assert got["perf/delta_time/gen"] == got["perf/straggler/gen/max"] == 1.0


def test_the_state_travels_and_refuses_what_no_client_sends():
    state = StageTimes([("r0", {"gen": 1.0}), ("r1", {"gen": 2.0})])
    back = decode_state(*encode_state(state))
    back.validate()
    assert back.records == state.records
    bad_pairs = [(0, {"gen": 1.0}), ("r", {"gen": float("inf")}), ("r", {"a/b": 1.0}), ("r", {"g": 1})]
    for bad in ([pair] for pair in bad_pairs):
        with pytest.raises(ValueError):
            StageTimes(bad).validate()
    arr = np.empty(1, dtype=object)
    arr[0] = ("r", ["gen", 1.0])
    with pytest.raises(ValueError, match="must be a dict"):
        StageTimes.from_array(arr)


def test_lists_survive_pickling_jsonl_and_its_reader(tmp_path):
    (ids, res), *_ = run([[{"gen": 1.0}, {"gen": 5.0}]])
    assert pickle.loads(pickle.dumps(res)).lists == res.lists  # as Ray returns it
    tracking = make_sinks(["jsonl"], tmp_path / "run", health=None)
    tracking.log(res, 0)
    tracking.close()
    (line,) = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["lists"] == {"perf/straggler/gen/slowest": [ids[1], ids[0]]}
    assert record_result(record).lists == res.lists
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl").steps == [0]


def test_the_rule_alerts_once_when_a_rank_stays_k_times_slower_naming_rank_and_stage(tmp_path):
    fast = {"gen": 1.0, "step": 4.0}
    slow = {"gen": 2.5, "step": 4.0}  # rank2: 2.5 x the median gen time
    times = [[fast, fast, slow]] * 5 + [[fast, fast, fast]] + [[fast, fast, slow]] * 3
    results = run(times)
    ids = results[0][0]
    tracking = make_sinks(["jsonl"], tmp_path / "run", health=Monitor([Straggler()]))
    for step, (_, res) in enumerate(results):
        tracking.log(res, step)
    tracking.close()
    events = read_jsonl(tmp_path / "run" / "metrics.jsonl").events
    assert [(e["step"], e["event"]["rule"], e["event"]["metric"]) for e in events] == [
        (2, "straggler", "perf/straggler/gen/max_over_p50"),  # 3 steps in a row: once
        (8, "straggler", "perf/straggler/gen/max_over_p50"),  # again after a step where it did not hold
    ]
    assert events[0]["event"]["message"] == (
        f"{ids[2]} took 2.5x the median gen time on 3 consecutive steps (>= 2x)"
    )


def test_the_rule_starts_afresh_when_another_rank_is_the_slowest():
    rule = Straggler(factor=2.0, steps=2)
    name = "perf/straggler/gen/max_over_p50"

    def step(i, rank):
        return StepResult({name: 3.0}, i, lists={"perf/straggler/gen/slowest": [rank]})

    got = [bool(rule(i, step(i, rank))) for i, rank in enumerate(["a", "b", "b", "b", "a"])]
    assert got == [False, False, True, True, False]
    assert Monitor([Straggler(steps=1)]).observe(0, {name: 2.0})[0].message.startswith("the slowest rank")


def test_the_catalog_lists_the_names():
    (ids, res), *_ = run([[{"gen": 1.0}, {"gen": 2.0}]])
    for name in [*res, *res.lists]:
        assert any(catalog.covers(p, name) for p, _ in catalog.CATALOG), name


@pytest.mark.ray
@pytest.mark.slow
def test_ray_the_slowest_ranks_by_name(ray_session):
    import uuid

    import rlmetrics

    name = f"strag-{uuid.uuid4().hex[:8]}"
    clients = [rlmetrics.connect("ray", name=name, world_size=3, rank=r) for r in range(3)]
    for client, seconds in zip(clients, (2.0, 7.0, 1.0)):
        client.compute_local_straggler_metrics({"gen": seconds}, step=0)
        client.wait_submit()
    res = clients[0].result(0)
    assert res["perf/straggler/gen/p50"] == 2.0 and res["perf/straggler/gen/max_over_p50"] == 3.5
    assert res.lists == {"perf/straggler/gen/slowest": ["rank1", "rank0", "rank2"]}


def _torch_rank(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    import rlmetrics

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    try:
        client = rlmetrics.connect("torch")
        client.compute_local_straggler_metrics({"gen": 1.0 + 4 * rank})
        client.wait_submit()
        res = client.wait_final_res()
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((dict(res), res.lists), f)


@pytest.mark.slow
def test_torch_every_rank_gets_the_report_and_the_names(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_torch_rank, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        values, lists = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        assert values == {
            "perf/straggler/gen/min": 1.0, "perf/straggler/gen/p50": 3.0, "perf/straggler/gen/max": 5.0,
            "perf/straggler/gen/max_over_p50": 5.0 / 3.0,
        }  # fmt: skip
        assert lists == {"perf/straggler/gen/slowest": ["rank1", "rank0"]}


def test_the_slowest_ranks_reach_every_tracker_read_back_with_its_reader(tmp_path):
    """TensorBoard: a text summary per step; W&B: a string in the step's row and no media file;
    SwanLab: a text per step; MLflow: a run tag holding the newest step's names. Each read with the
    tracker's own format code."""
    from tests.trackers import one, swanlab_texts, tensorboard_texts, wandb_rows

    times = [[{"gen": 1.0 + i} for i in range(4)], [{"gen": 9.0 - 2 * i} for i in range(4)]]
    runs = run(times)
    wants = [", ".join(reference(ids, times[step], "gen")[1]) for step, (ids, _) in enumerate(runs)]
    with make_sinks(["tensorboard", "wandb", "mlflow", "swanlab"], tmp_path, health=None) as tracking:
        for step, (_, res) in enumerate(runs):
            tracking.log(res, step)
        assert not tracking.failed
        mlflow_run = tracking.sinks[2].run_id
    key = "perf/straggler/gen/slowest"
    assert tensorboard_texts(tmp_path / "tensorboard")[key] == list(enumerate(wants))
    run_file = one(tmp_path, "wandb/offline-run-*/run-*.wandb")
    assert [(step, row[key]) for step, row in wandb_rows([run_file]) if key in row] == list(enumerate(wants))
    assert not (run_file.parent / "files" / "media").exists()
    assert swanlab_texts([one(tmp_path, "swanlab/run-*/run-*.swanlab")])[key] == list(enumerate(wants))
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(mlflow_run).data.tags
    assert tags[key] == wants[-1]
