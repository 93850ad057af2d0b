"""End-to-end step latency on a local Ray instance: rlmetrics' ``MetricWorker`` against a naive actor.

One step: each of W ranks submits one dict of M scalar floats, then rank 0 gets the step's result.
Ranks are simulated by 4 Ray actor processes ("rank hosts"), each hosting W/4 clients labelled
``rank{r}``; rank ``r`` submits values drawn from ``(r, step)``, so the driver can recompute them.
The dicts of a step are built before it starts (the application's work, not the metrics system's).
Timed: from telling all hosts to go (one ``ray.get([host.step.remote() ...])`` round) until rank 0
has the result. Every host, for each of its clients in turn, calls ``submit_metric(d, W)`` then
``wait_submit()``.

- **rlmetrics flat**: one ``MetricWorker`` (``rlmetrics.get_metric_worker``); clients from
  ``rlmetrics.connect("ray", ...)``; host 0's rank-0 client calls ``result(step, timeout=60)``.
  ``submit µs`` is the median client-side cost of ``submit_metric`` (``perf_counter`` around that
  call only, in the hosts).
- **naive**: an async actor written from the seed's description of its MetricWorker:
  ``working[name].append(value)`` per key; once a name holds ``world_size`` values, the reduction
  picked by substring rules (min, max, sum/total, else ``statistics.mean``) goes to ``final[name]``;
  ``wait_final_res()`` returns and resets ``final``. A client sends one ``submit_metric.remote(dict,
  W)`` per submit; ``wait_submit`` is ``ray.get`` on the pending refs; the driver calls
  ``wait_final_res`` once all hosts finished the step.
- **rlmetrics hierarchical** (``hierarchy="node"``): the same clients sending to the node's
  sub-aggregator, which forwards one message per step to the root (one node here, so this shows
  the cost of the extra hop; the gain is at the root of a multi-node cluster).

Both run side by side on the same hosts, one after the other in every step (naive first); the median
over the steps after one warm-up step is reported (7 steps; 2 with ``--quick``). Each step asserts:
rlmetrics ``.../mean`` names equal the numpy mean over all ranks' values, and every name equals the
naive result (relative 1e-9).

Run: ``python benchmarks/bench_ray.py [--quick] [--markdown PATH]`` (needs the ``ray`` extra).
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import report

import rlmetrics

WORLD_SIZES = (8, 64, 256)
METRIC_COUNTS = (100, 1000, 3000)
HOSTS = 4
WARMUP_STEPS = 1
TARGET_CELL = (256, 1000)
TARGET_RATIO = 10.0
TARGET_SUBMIT_US = 1000.0  # "submit_metric returns in well under a millisecond"
RESULT_TIMEOUT_S = 60.0

_TEMPLATES = (
    "actor/loss_{i}/mean", "critic/score_{i}/max", "critic/score_{i}/min", "perf/total_tokens_{i}",
    "actor/entropy_{i}",
)  # fmt: skip


def metric_names(m: int) -> list[str]:
    """``m`` distinct metric names on which rlmetrics and the seed's rules pick the same reduction."""
    return [_TEMPLATES[k % len(_TEMPLATES)].format(i=k // len(_TEMPLATES)) for k in range(m)]


def rank_values(rank: int, step: int, m: int) -> np.ndarray:
    """The ``m`` values rank ``rank`` submits at ``step``."""
    return np.random.default_rng((rank, step)).uniform(0.5, 1.5, size=m)


# ------------------------------------------------------------------------------------- naive baseline
def naive_reduce(name: str, values: list[float]) -> float:
    """The seed's ``MetricFunc`` substring rules for the four plain reductions."""
    if "min" in name:
        return min(values)
    if "max" in name:
        return max(values)
    if "sum" in name or "total" in name:
        return sum(values)
    return statistics.mean(values)


@ray.remote(num_cpus=0)
class NaiveMetricWorker:
    """The seed's MetricWorker as described: per-name value lists, reduced at ``world_size`` values."""

    def __init__(self) -> None:
        self.working: defaultdict[str, list[float]] = defaultdict(list)
        self.final: dict[str, float] = {}

    async def submit_metric(self, metrics: dict[str, float], world_size: int) -> None:
        for name, value in metrics.items():
            values = self.working[name]
            values.append(value)
            if len(values) == world_size:
                self.final[name] = naive_reduce(name, values)
                del self.working[name]

    async def wait_final_res(self) -> dict[str, float]:
        out, self.final = self.final, {}
        return out


class NaiveClient:
    """The seed's MetricClient: one remote call per submit, ``wait_submit`` waits for them."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.pending: list[Any] = []

    def submit_metric(self, metrics: dict[str, float], world_size: int) -> None:
        self.pending.append(self.worker.submit_metric.remote(metrics, world_size))

    def wait_submit(self) -> None:
        ray.get(self.pending)
        self.pending = []


# ------------------------------------------------------------------------------------------ rank hosts
@ray.remote(num_cpus=1)
class RankHost:
    """One process simulating W/HOSTS ranks, each with an rlmetrics client and a naive client."""

    def __init__(
        self,
        host: int,
        world_size: int,
        m: int,
        worker_names: tuple[str, str],
        naive: Any,
        baseline_client: Any = None,
    ) -> None:
        """``naive``: the baseline worker; ``baseline_client(worker)`` makes its clients (default
        :class:`NaiveClient`; ``bench_peers.py`` passes siiRL's ``MetricClient``)."""
        per_host = world_size // HOSTS
        self.ranks = range(host * per_host, (host + 1) * per_host)
        self.world_size = world_size
        self.names = metric_names(m)
        flat, tree = worker_names
        self.clients = {
            "flat": [
                rlmetrics.connect("ray", name=flat, world_size=world_size, label=f"rank{r}")
                for r in self.ranks
            ],
            "node": [
                rlmetrics.connect("ray", name=tree, world_size=world_size, label=f"rank{r}", hierarchy="node")
                for r in self.ranks
            ],
        }
        self.naive_clients = [(baseline_client or NaiveClient)(naive) for _ in self.ranks]
        self.dicts: list[dict[str, float]] = []

    def prepare(self, step: int) -> None:
        """Build this step's dicts (untimed)."""
        m = len(self.names)
        self.dicts = [dict(zip(self.names, rank_values(r, step, m).tolist())) for r in self.ranks]

    def step_naive(self) -> None:
        for client, d in zip(self.naive_clients, self.dicts):
            client.submit_metric(d, self.world_size)
            client.wait_submit()

    def step_ours(self, step: int, kind: str) -> tuple[list[float], rlmetrics.StepResult | None]:
        """Submit every rank's dict (``kind``: "flat" or "node" clients); rank 0 (on host 0) then
        waits for the result. Also the seconds each ``submit_metric`` call took."""
        submit_s = []
        clients = self.clients[kind]
        for client, d in zip(clients, self.dicts):
            t0 = time.perf_counter()
            client.submit_metric(d, self.world_size)
            submit_s.append(time.perf_counter() - t0)
            client.wait_submit()
        result = clients[0].result(step, timeout=RESULT_TIMEOUT_S) if self.ranks[0] == 0 else None
        return submit_s, result


# ---------------------------------------------------------------------------------------- measuring
@dataclass
class Row:
    world_size: int
    metrics: int
    naive_s: float  # median seconds per step
    ours_s: float
    hier_s: float
    submit_us: float  # median rlmetrics submit_metric call, µs

    @property
    def ratio(self) -> float:
        return self.naive_s / self.ours_s


def check(world_size: int, m: int, step: int, ours: rlmetrics.StepResult, naive: dict[str, float]) -> None:
    """rlmetrics ``.../mean`` names equal numpy means over all ranks; every name equals naive's."""
    assert ours.meta["complete"], f"rlmetrics step {step} incomplete: {ours.meta}"
    names = metric_names(m)
    assert len(ours) == len(naive) == m, (len(ours), len(naive), m)
    means = np.mean([rank_values(r, step, m) for r in range(world_size)], axis=0)
    for name, mean in zip(names, means.tolist()):
        if name.endswith("/mean"):
            assert math.isclose(ours[name], mean, rel_tol=1e-9), (name, ours[name], mean)
    for name in names:
        assert math.isclose(ours[name], naive[name], rel_tol=1e-9), (name, ours[name], naive[name])


def measure(world_size: int, m: int, steps: int) -> Row:
    names = (f"bench-ray-{uuid.uuid4().hex[:12]}", f"bench-ray-node-{uuid.uuid4().hex[:12]}")
    worker = rlmetrics.get_metric_worker(name=names[0])
    tree = rlmetrics.get_metric_worker(name=names[1], hierarchy="node")
    naive = NaiveMetricWorker.remote()
    hosts = [RankHost.remote(h, world_size, m, names, naive) for h in range(HOSTS)]
    naive_s: list[float] = []
    ours_s: list[float] = []
    hier_s: list[float] = []
    submit_s: list[float] = []
    try:
        for step in range(WARMUP_STEPS + steps):
            ray.get([h.prepare.remote(step) for h in hosts])
            t0 = time.perf_counter()
            ray.get([h.step_naive.remote() for h in hosts])
            naive_res = ray.get(naive.wait_final_res.remote())
            t1 = time.perf_counter()
            outs = ray.get([h.step_ours.remote(step, "flat") for h in hosts])
            t2 = time.perf_counter()
            tree_outs = ray.get([h.step_ours.remote(step, "node") for h in hosts])
            t3 = time.perf_counter()
            check(world_size, m, step, outs[0][1], naive_res)
            check(world_size, m, step, tree_outs[0][1], naive_res)
            if step >= WARMUP_STEPS:
                naive_s.append(t1 - t0)
                ours_s.append(t2 - t1)
                hier_s.append(t3 - t2)
                submit_s += [t for times, _ in outs for t in times]
    finally:  # hosts first: their clients watch the workers
        node = rlmetrics.backends.ray.node_worker(names[1], None)
        for actor in (*hosts, naive, worker, tree, node):
            ray.kill(actor)
    return Row(
        world_size,
        m,
        statistics.median(naive_s),
        statistics.median(ours_s),
        statistics.median(hier_s),
        statistics.median(submit_s) * 1e6,
    )


# ---------------------------------------------------------------------------------------- reporting
def render(rows: list[Row]) -> str:
    columns = [
        "W",
        "M",
        "naive ms/step",
        "rlmetrics ms/step",
        "ratio",
        "hierarchical ms/step",
        "submit µs/call",
    ]
    return report.table(
        columns,
        [
            [r.world_size, r.metrics, f"{r.naive_s * 1e3:.1f}", f"{r.ours_s * 1e3:.1f}", f"{r.ratio:.1f}x",
             f"{r.hier_s * 1e3:.1f}", f"{r.submit_us:.0f}"]
            for r in rows
        ],
    )  # fmt: skip


def targets(rows: list[Row]) -> list[str]:
    slowest = max(r.submit_us for r in rows)
    lines = [
        f"target submit_metric < {TARGET_SUBMIT_US:.0f} µs (median) in every cell: at most {slowest:.0f} µs "
        f"— {report.verdict(slowest < TARGET_SUBMIT_US)}"
    ]
    w, m = TARGET_CELL
    cell = next((r for r in rows if (r.world_size, r.metrics) == TARGET_CELL), None)
    ratio = None if cell is None else cell.ratio
    return [*lines, report.ratio_target(f"the naive baseline at W={w}, M={m}", ratio, TARGET_RATIO)]


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "W in {8, 64}, M in {100, 1000}, 2 steps", argv)

    start = time.perf_counter()
    world_sizes, metric_counts, steps = (
        ((8, 64), (100, 1000), 2) if args.quick else (WORLD_SIZES, METRIC_COUNTS, 7)
    )
    versions = (f"numpy {np.__version__}", f"ray {ray.__version__}", f"rlmetrics {rlmetrics.__version__}")
    head = report.header("Ray step", *versions)
    print(head, flush=True)
    ray.init(address="local", num_cpus=HOSTS, include_dashboard=False)
    try:
        rows = [measure(w, m, steps) for w in world_sizes for m in metric_counts]
    finally:
        ray.shutdown()
    notes = [
        f"{HOSTS} rank-host processes; median of {steps} steps after {WARMUP_STEPS} warm-up step(s); "
        f"submit µs: median over all ranks and timed steps",
        "results asserted per step: .../mean names = numpy mean over ranks, all names = naive (rel 1e-9)",
        *targets(rows),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, render(rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
