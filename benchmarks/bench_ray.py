"""End-to-end step latency on a local Ray instance: rlmetrics' ``MetricWorker`` against a naive actor,
many clients per process (the secondary table; ``bench_users.py`` measures the users' topology, one
client per process).

One step: each of W ranks submits one dict of M scalar floats, then rank 0 gets the step's result.
Ranks are simulated by 4 Ray actor processes ("rank hosts"; 1 with ``--quick``), each hosting W/4
clients labelled ``rank{r}``; rank ``r`` submits values drawn from ``(r, step)``, so the driver can
recompute them.
The dicts of a step are built before it starts (the application's work, not the metrics system's).
Timed: from telling all hosts to go (one ``ray.get([host.step.remote() ...])`` round) until the
step's result is in. In every host each rank, in a thread of its own (ranks are concurrent processes
in a real run), calls ``submit_metric(d, W)`` then ``wait_submit()``.

- **rlmetrics seed mode**: one ``MetricWorker`` (``rlmetrics.get_metric_worker``); clients from
  ``rlmetrics.connect("ray", ...)``, whose ``wait_submit()`` returns once the aggregator holds the
  step; once every host returned, the driver reads with ``wait_final_res()`` (the seed's loop).
  ``submit µs`` is the median client-side cost of ``submit_metric`` (``perf_counter`` around that
  call only, in the hosts).
- **rlmetrics non-blocking**: clients with ``blocking=False`` (``wait_submit()`` returns at once; a
  host's clients' messages posted while a call is in flight travel together); host 0's rank-0 client calls
  ``result(step, timeout=60)``.
- **naive**: an async actor written from the seed's description of its MetricWorker:
  ``working[name].append(value)`` per key; once a name holds ``world_size`` values, the reduction
  picked by substring rules (min, max, sum/total, else ``statistics.mean``) goes to ``final[name]``;
  ``wait_final_res()`` returns and resets ``final``. A client sends one ``submit_metric.remote(dict,
  W)`` per submit; ``wait_submit`` is ``ray.get`` on the pending refs; the driver calls
  ``wait_final_res`` once all hosts finished the step.
- **rlmetrics hierarchical** (``hierarchy="node"``, seed mode): the same clients sending to the
  node's sub-aggregator, which forwards one message per step to the root (one node here, so this
  shows the cost of the extra hop; the gain is at the root of a multi-node cluster).

All run side by side on the same hosts, one after the other in every step (naive first); the median
over the steps after two warm-up steps is reported (7 steps; 2 with ``--quick``, which also runs
W = 8, M = 100 only, in one rank-host process). Each step asserts: the result is that step's,
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import report

import rlmetrics

WORLD_SIZES = (8, 64, 256)
METRIC_COUNTS = (100, 1000, 3000)
HOSTS = 4
QUICK_HOSTS = 1  # --quick: one rank-host process (each costs seconds of start-up)
WARMUP_STEPS = 2  # step 0 teaches the names
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
    """One of ``hosts`` processes simulating W/hosts ranks, each with rlmetrics clients and a naive
    client; the ranks of a step run concurrently, one thread each (in a real run they are processes)."""

    def __init__(
        self,
        host: int,
        hosts: int,
        world_size: int,
        m: int,
        worker_names: tuple[str, str, str],
        naive: Any,
        baseline_client: Any = None,
    ) -> None:
        """``naive``: the baseline worker; ``baseline_client(worker)`` makes its clients (default
        :class:`NaiveClient`; ``bench_peers.py`` passes siiRL's ``MetricClient``)."""
        self.ranks = range(host, world_size, hosts)
        self.world_size = world_size
        self.names = metric_names(m)
        seed, posted, tree = worker_names
        self.clients = {
            "seed": [
                rlmetrics.connect("ray", name=seed, world_size=world_size, label=f"rank{r}")
                for r in self.ranks
            ],
            "posted": [
                rlmetrics.connect("ray", name=posted, world_size=world_size, label=f"rank{r}", blocking=False)
                for r in self.ranks
            ],
            "node": [
                rlmetrics.connect("ray", name=tree, world_size=world_size, label=f"rank{r}", hierarchy="node")
                for r in self.ranks
            ],
        }
        self.naive_clients = [(baseline_client or NaiveClient)(naive) for _ in self.ranks]
        self.dicts: list[dict[str, float]] = []
        self.pool = ThreadPoolExecutor(max_workers=len(self.ranks))

    def prepare(self, step: int) -> None:
        """Build this step's dicts (untimed)."""
        m = len(self.names)
        self.dicts = [dict(zip(self.names, rank_values(r, step, m).tolist())) for r in self.ranks]

    def _each_rank(self, run: Any, clients: list[Any]) -> list[Any]:
        """``run(client, d)`` for every rank at once, one thread per rank."""
        return list(self.pool.map(run, clients, self.dicts))

    def step_naive(self) -> None:
        def run(client: Any, d: dict[str, float]) -> None:
            client.submit_metric(d, self.world_size)
            client.wait_submit()

        self._each_rank(run, self.naive_clients)

    def step_ours(self, step: int, kind: str) -> tuple[list[float], rlmetrics.StepResult | None]:
        """Submit every rank's dict with ``kind``'s clients: ``"seed"`` and ``"node"`` block in
        ``wait_submit`` until the aggregator holds the step (the driver then reads with
        ``wait_final_res``); ``"posted"`` do not block, and rank 0 (on host 0) waits for
        ``result(step)``. Also the seconds each ``submit_metric`` call took."""

        def run(client: Any, d: dict[str, float]) -> float:
            t0 = time.perf_counter()
            client.submit_metric(d, self.world_size)
            seconds = time.perf_counter() - t0
            client.wait_submit()
            return seconds

        clients = self.clients[kind]
        submit_s = self._each_rank(run, clients)
        read = kind == "posted" and self.ranks[0] == 0
        return submit_s, clients[0].result(step, timeout=RESULT_TIMEOUT_S) if read else None


@dataclass
class OurWorkers:
    """rlmetrics' aggregators of one measurement, one per way of using it (see
    :meth:`RankHost.step_ours`): ``seed``, ``posted`` and ``node`` (hierarchical)."""

    names: tuple[str, str, str]
    handles: list[Any]
    readers: dict[str, Any]

    @classmethod
    def start(cls, prefix: str) -> OurWorkers:
        tag = uuid.uuid4().hex[:12]
        names = (f"{prefix}-seed-{tag}", f"{prefix}-posted-{tag}", f"{prefix}-node-{tag}")
        handles = [
            rlmetrics.get_metric_worker(name=names[0]),
            rlmetrics.get_metric_worker(name=names[1]),
            rlmetrics.get_metric_worker(name=names[2], hierarchy="node"),
        ]
        readers = {"seed": rlmetrics.MetricClient(handles[0]), "node": rlmetrics.MetricClient(handles[2])}
        return cls(names, handles, readers)

    def step(self, hosts: list[Any], step: int, kind: str) -> tuple[list[float], rlmetrics.StepResult]:
        """One step of ``kind`` on every host, and its result: the seed's read (``wait_final_res``
        once every host returned) or rank 0's ``result(step)``."""
        outs = ray.get([h.step_ours.remote(step, kind) for h in hosts])
        res = outs[0][1] if kind == "posted" else self.readers[kind].wait_final_res()
        assert res.step == step, (kind, res.step, step)
        return [t for times, _ in outs for t in times], res

    def kill(self) -> None:
        """The aggregators and this node's sub-aggregator (kill the hosts first: their clients
        watch the aggregators)."""
        for actor in (*self.handles, rlmetrics.backends.ray.node_worker(self.names[2], None)):
            ray.kill(actor)


# ---------------------------------------------------------------------------------------- measuring
@dataclass
class Row:
    world_size: int
    metrics: int
    seconds: dict[str, float]  # median seconds per step: "baseline" and each kind of ours
    submit_us: float  # median rlmetrics submit_metric call (seed mode), µs

    def ratio(self, kind: str = "seed") -> float:
        return self.seconds["baseline"] / self.seconds[kind]


KINDS = {"seed": "rlmetrics seed mode", "posted": "rlmetrics non-blocking", "node": "hierarchical"}


@dataclass
class Baseline:
    """What rlmetrics is measured against: ``start()`` gives the worker actor the hosts' baseline
    clients use and a function that reads a step's result on the driver; ``client(worker)`` makes a
    rank's client (inside a host)."""

    name: str
    start: Any
    client: Any = None


def _start_naive() -> tuple[Any, Any]:
    naive = NaiveMetricWorker.remote()
    return naive, lambda: ray.get(naive.wait_final_res.remote())


NAIVE = Baseline("naive", _start_naive)


def check(world_size: int, m: int, step: int, ours: rlmetrics.StepResult, naive: dict[str, float]) -> None:
    """rlmetrics ``.../mean`` names equal numpy means over all ranks; every name equals naive's."""
    assert ours.meta.complete, f"rlmetrics step {step} incomplete: {ours.meta}"
    names = metric_names(m)
    assert len(ours) == len(naive) == m, (len(ours), len(naive), m)
    means = np.mean([rank_values(r, step, m) for r in range(world_size)], axis=0)
    for name, mean in zip(names, means.tolist()):
        if name.endswith("/mean"):
            assert math.isclose(ours[name], mean, rel_tol=1e-9), (name, ours[name], mean)
    for name in names:
        assert math.isclose(ours[name], naive[name], rel_tol=1e-9), (name, ours[name], naive[name])


def measure(
    world_size: int,
    m: int,
    steps: int,
    baseline: Baseline = NAIVE,
    kinds: tuple[str, ...] = tuple(KINDS),
    hosts: int = HOSTS,
) -> Row:
    """Median seconds per step of ``baseline`` and of each of our ``kinds``, side by side in every
    step (baseline first), each step's results checked; the ranks live in ``hosts`` processes."""
    if not 1 <= hosts <= min(world_size, HOSTS):  # a host takes one of Ray's HOSTS CPUs
        raise ValueError(f"hosts must be in 1..{min(world_size, HOSTS)}, got {hosts}")
    ours = OurWorkers.start(f"bench-{baseline.name}")
    worker, read = baseline.start()
    host_actors = [
        RankHost.remote(h, hosts, world_size, m, ours.names, worker, baseline.client) for h in range(hosts)
    ]
    times: dict[str, list[float]] = defaultdict(list)
    submit_s: list[float] = []
    try:
        for step in range(WARMUP_STEPS + steps):
            ray.get([h.prepare.remote(step) for h in host_actors])
            t0 = time.perf_counter()
            ray.get([h.step_naive.remote() for h in host_actors])
            base_res = read()
            step_s = {"baseline": time.perf_counter() - t0}
            for kind in kinds:
                t0 = time.perf_counter()
                submits, res = ours.step(host_actors, step, kind)
                step_s[kind] = time.perf_counter() - t0
                check(world_size, m, step, res, base_res)
                submit_s += submits if kind == kinds[0] else []
            if step >= WARMUP_STEPS:
                for kind, seconds in step_s.items():
                    times[kind].append(seconds)
    finally:
        for actor in (*host_actors, worker):
            ray.kill(actor)
        ours.kill()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return Row(world_size, m, medians, statistics.median(submit_s) * 1e6)


# ---------------------------------------------------------------------------------------- reporting
def render(rows: list[Row], baseline: str = "naive") -> str:
    """A row per cell: the baseline's ms/step, then each kind's ms/step and ratio, submit µs."""
    kinds = [k for k in KINDS if k in rows[0].seconds]
    columns = ["W", "M", f"{baseline} ms/step"]
    for kind in kinds:
        columns += [f"{KINDS[kind]} ms/step", "speed-up"]
    body = []
    for r in rows:
        cells = [r.world_size, r.metrics, f"{r.seconds['baseline'] * 1e3:.1f}"]
        for kind in kinds:
            cells += [f"{r.seconds[kind] * 1e3:.1f}", f"{r.ratio(kind):.1f}x"]
        body.append([*cells, f"{r.submit_us:.0f}"])
    return report.table([*columns, "submit µs/call"], body)


def target(rows: list[Row], cell: tuple[int, int], ratio: float, what: str) -> str:
    """The seed-mode ratio target of ``cell`` (W, M)."""
    row = next((r for r in rows if (r.world_size, r.metrics) == cell), None)
    got = None if row is None else row.ratio("seed")
    return report.ratio_target(f"{what} at W={cell[0]}, M={cell[1]} (seed mode)", got, ratio)


def targets(rows: list[Row]) -> list[str]:
    slowest = max(r.submit_us for r in rows)
    lines = [
        f"target submit_metric < {TARGET_SUBMIT_US:.0f} µs (median) in every cell: at most {slowest:.0f} µs "
        f"— {report.verdict(slowest < TARGET_SUBMIT_US)}"
    ]
    return [*lines, target(rows, TARGET_CELL, TARGET_RATIO, "the naive baseline")]


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, f"W = 8, M = 100, 2 steps, {QUICK_HOSTS} rank-host process", argv)

    start = time.perf_counter()
    world_sizes, metric_counts, steps = ((8,), (100,), 2) if args.quick else (WORLD_SIZES, METRIC_COUNTS, 7)
    hosts = QUICK_HOSTS if args.quick else HOSTS
    versions = (f"numpy {np.__version__}", f"ray {ray.__version__}", f"rlmetrics {rlmetrics.__version__}")
    head = report.header("Ray step", *versions)
    print(head, flush=True)
    ray.init(address="local", num_cpus=HOSTS, include_dashboard=False)
    try:
        rows = [measure(w, m, steps, hosts=hosts) for w in world_sizes for m in metric_counts]
    finally:
        ray.shutdown()
    notes = [
        f"{hosts} rank-host process{'es' if hosts > 1 else ''}; median of {steps} steps after "
        f"{WARMUP_STEPS} warm-up step(s); submit µs: median over all ranks and timed steps",
        "results asserted per step: .../mean names = numpy mean over ranks, all names = naive (rel 1e-9)",
        *targets(rows),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, render(rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
