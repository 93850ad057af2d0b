"""The users' topology: one client per process (siiRL's DAGWorkers, verl's dp workers), rlmetrics
against siiRL 0.2.0 and the raw Ray floor, side by side in every step.

W rank actors (one process each), every one holding one client of each system. A step: the driver
tells every rank to go (one ``ray.get`` over the W ranks), each rank submits one dict of M scalar
floats (built before the step, untimed) and waits, then the driver reads the step's result:

- **raw Ray floor**: each rank sends its M values as one numpy vector to a plain actor that adds it
  to a running sum (``ray.get`` on the call); the driver reads the sum. No names, no reductions:
  Ray's own cost of one message per rank and one read.
- **siiRL 0.2.0**: siiRL's ``MetricWorker``; each rank's siiRL ``MetricClient`` calls
  ``submit_metric(d, W)`` then ``wait_submit()``; the driver calls ``MetricClient.wait_final_res()``.
- **rlmetrics seed loop**: the same calls on ``rlmetrics.connect("ray", world_size=W)`` clients
  (``wait_submit()`` returns once the aggregator holds the step); the driver's
  ``rlmetrics.MetricClient(worker).wait_final_res()``.
- **rlmetrics result(step)**: clients with ``blocking=False`` (``wait_submit()`` returns at once);
  the driver reads ``result(step, timeout)``, as verl's driver would.

The systems run one after the other in every step, their order rotated from step to step. Each
step's results are asserted: rlmetrics' equal siiRL's for every name (the names of
``bench_ray.metric_names``, on which both pick the same reduction; rel 1e-9), and ``.../mean``
names equal the floor's sum / W.

Measured, medians over the steps after the warm-up:

- **wall ms/step**, from the driver's go to the result in hand;
- **aggregator CPU** per step: the CPU time of every thread of each aggregator's process
  (:func:`report.cpu_seconds`) over the measured steps, divided by their number. Fitted over W as
  ``per step + W x per message`` (least squares over the W of the run), so ``per message`` is what
  one rank's message costs the aggregator (decode, merge, its share of finalize and replies) and
  ``per step`` what a step costs beyond its messages;
- **Ray's own cost of one call** to an async actor (rlmetrics' aggregator is one: readers wait
  inside it), a threaded actor (``max_concurrency`` > 1: readers could wait in its threads) and a
  plain actor (the floor), each a method that does nothing, from 4 caller actors: what part of the
  aggregator's CPU per message no code of ours can remove, and what moving it to threads would save;
- **rank CPU** per step: the CPU time of the rank process's Python threads around its submit and
  wait (:func:`python_cpu`: the caller's thread, where Ray serializes and submits a call, and the
  client's sender thread). Not for ``result(step)`` clients: their send runs after the call
  returned.

Run: ``python benchmarks/bench_users.py [--quick] [--markdown PATH]`` (needs the ``ray`` extra and
siiRL 0.2.0: ``make install-peers``). ``--quick``: W = 1 and 2, M = 100, 2 steps, Ray's call
costs from 1 caller x 20 calls.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import bench_peers
import bench_ray
import numpy as np
import ray
import report

import rlmetrics

WORLD_SIZES = (8, 16, 32)
METRIC_COUNTS = (100, 1000, 10000)
STEPS, WARMUP_STEPS = 10, 2
RESULT_TIMEOUT_S = 60.0
SYSTEMS = {"floor": "raw Ray floor", "siirl": "siiRL 0.2.0", "seed": "rlmetrics seed loop",
           "posted": "rlmetrics result(step)"}  # fmt: skip
TARGET_WALL, TARGET_MESSAGE, TARGET_STEP, TARGET_RANK_US = 1.3, 1.3, 2.0, 100.0
PER_NODE = 8  # ranks per node of the capacity table's hierarchy (8 GPUs a node)


def python_cpu() -> float:
    """CPU seconds of this process's Python threads so far (the caller's and the client's sender
    thread; not Ray's own C++ threads, whose background work grows with the time a step waits)."""
    total = 0.0
    for thread in threading.enumerate():
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):  # a thread that ended, or not started yet
            pass
    return total


@ray.remote(num_cpus=0)
class Floor:
    """The raw floor's aggregator: adds each rank's vector to a sum."""

    def __init__(self) -> None:
        self.total: np.ndarray | None = None

    def add(self, values: np.ndarray) -> None:
        self.total = values.copy() if self.total is None else self.total + values

    def take(self) -> np.ndarray:
        out, self.total = self.total, None
        return out


@ray.remote(num_cpus=0)
class Rank:
    """One rank: one process with one client of each system."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.clients: dict[str, Any] = {}

    def join(self, world_size: int, m: int, floor: Any, siirl: Any, seed: str, posted: str) -> None:
        """New clients for a measurement of ``world_size`` ranks and ``m`` metrics."""
        self.world_size, self.m, self.floor = world_size, m, floor
        label = f"rank{self.rank}"
        self.clients = {
            "siirl": bench_peers._siirl_client(siirl),
            "seed": rlmetrics.connect("ray", name=seed, world_size=world_size, label=label),
            "posted": rlmetrics.connect(
                "ray", name=posted, world_size=world_size, label=label, blocking=False
            ),
        }
        self.names = bench_ray.metric_names(m)

    def leave(self) -> None:
        """The measurement ended: rlmetrics' clients stop (before their aggregators go)."""
        self.clients["seed"].stop()
        self.clients["posted"].stop()

    def prepare(self, step: int) -> None:
        """This step's values, as a vector and as a dict (untimed: the application's work)."""
        self.vector = bench_ray.rank_values(self.rank, step, self.m)
        self.dict = dict(zip(self.names, self.vector.tolist()))

    def step(self, system: str) -> float:
        """Submit this step's values with ``system`` and wait as its users do; the CPU seconds of
        this process's Python threads (:func:`python_cpu`) meanwhile."""
        t0 = python_cpu()
        if system == "floor":
            ray.get(self.floor.add.remote(self.vector))
        else:
            client = self.clients[system]
            client.submit_metric(self.dict, self.world_size)
            client.wait_submit()
        return python_cpu() - t0


@ray.remote(num_cpus=0, max_concurrency=1000)
class AsyncNoop:
    """An async actor (as rlmetrics' aggregator is: readers wait inside it) doing nothing."""

    async def call(self, payload: Any) -> None:
        return None


@ray.remote(num_cpus=0, max_concurrency=1000)
class ThreadedNoop:
    """A threaded actor (calls run in a pool of threads, where readers could wait) doing nothing."""

    def call(self, payload: Any) -> None:
        return None


@ray.remote(num_cpus=0)
class SyncNoop:
    """A plain actor (as the raw floor is) doing nothing."""

    def call(self, payload: Any) -> None:
        return None


@ray.remote(num_cpus=0)
class Caller:
    def run(self, actor: Any, calls: int, payload: Any) -> None:
        for _ in range(calls):
            ray.get(actor.call.remote(payload))


def call_costs(callers: int, calls: int) -> dict[str, float]:
    """The receiving actor's CPU seconds per call of a method that does nothing, for an async, a
    threaded and a plain actor, called by ``callers`` actors ``calls`` times each with an 8 kB
    payload (a message of M = 1000): Ray's own cost of one message to each kind of actor."""
    actors = {"async actor": AsyncNoop.remote(), "threaded actor": ThreadedNoop.remote(),
              "plain actor": SyncNoop.remote()}  # fmt: skip
    pids = {kind: report.actor_pid(actor) for kind, actor in actors.items()}
    pool = [Caller.remote() for _ in range(callers)]
    payload = b"x" * 8000
    cost: dict[str, list[float]] = {kind: [] for kind in actors}
    for _ in range(2):  # the kinds alternate: a change of load hits both
        for kind, actor in actors.items():
            c0 = report.cpu_seconds(pids[kind])
            ray.get([c.run.remote(actor, calls, payload) for c in pool])
            cost[kind].append((report.cpu_seconds(pids[kind]) - c0) / (callers * calls))
    for actor in (*actors.values(), *pool):
        ray.kill(actor)
    return {kind: min(v) for kind, v in cost.items()}


@dataclass
class Row:
    world_size: int
    metrics: int
    wall: dict[str, float]  # median seconds per step, by system
    aggregator: dict[str, float]  # aggregator CPU seconds per step, by system
    rank: dict[str, float] = field(default_factory=dict)  # median rank CPU seconds per step, by system


class Aggregators:
    """The aggregators of one measurement and how the driver reads each one's step; ``siirl``: siiRL's
    started worker and its read, shared by the measurements (it keeps nothing between steps and its
    start imports torch: about 15 s on a 2-core machine)."""

    def __init__(self, siirl: tuple[Any, Any]) -> None:
        tag = uuid.uuid4().hex[:12]
        self.names = {"seed": f"users-seed-{tag}", "posted": f"users-posted-{tag}"}
        self.floor = Floor.remote()
        self.siirl, siirl_read = siirl
        self.handles = {kind: rlmetrics.get_metric_worker(name=name) for kind, name in self.names.items()}
        readers = {kind: rlmetrics.MetricClient(handle) for kind, handle in self.handles.items()}
        self.read = {
            "floor": lambda step: ray.get(self.floor.take.remote()),
            "siirl": lambda step: siirl_read(),
            "seed": lambda step: readers["seed"].wait_final_res(),
            "posted": lambda step: readers["posted"].result(step, RESULT_TIMEOUT_S),
        }
        actors = {"floor": self.floor, "siirl": self.siirl, **self.handles}
        self.pids = {kind: report.actor_pid(actor) for kind, actor in actors.items()}

    def kill(self) -> None:
        for actor in (self.floor, *self.handles.values()):
            ray.kill(actor)


def check(world_size: int, m: int, step: int, results: dict[str, Any]) -> None:
    """rlmetrics equals siiRL on every name, ``.../mean`` names the floor's sum / W (rel 1e-9)."""
    siirl, floor = results["siirl"], results["floor"]
    names = bench_ray.metric_names(m)
    for kind in ("seed", "posted"):
        ours = results[kind]
        assert ours.step == step and ours.meta.complete, (kind, step, ours.meta)
        assert len(ours) == len(siirl) == m, (kind, len(ours), len(siirl), m)
        for i, name in enumerate(names):
            assert math.isclose(ours[name], siirl[name], rel_tol=1e-9), (kind, name, ours[name], siirl[name])
            if name.endswith("/mean"):
                assert math.isclose(ours[name], floor[i] / world_size, rel_tol=1e-9), (kind, name)


def measure(ranks: list[Any], m: int, steps: int, siirl: tuple[Any, Any]) -> Row:
    """Every system on ``ranks`` with ``m`` metrics, side by side in each step."""
    world_size = len(ranks)
    aggs = Aggregators(siirl)
    ray.get([r.join.remote(world_size, m, aggs.floor, aggs.siirl, *aggs.names.values()) for r in ranks])
    order = list(SYSTEMS)
    wall: dict[str, list[float]] = {s: [] for s in order}
    rank_cpu: dict[str, list[float]] = {s: [] for s in order}
    cpu = dict.fromkeys(order, 0.0)
    try:
        for step in range(WARMUP_STEPS + steps):
            ray.get([r.prepare.remote(step) for r in ranks])
            results = {}
            for system in order[step % len(order) :] + order[: step % len(order)]:
                c0 = report.cpu_seconds(aggs.pids[system])
                t0 = time.perf_counter()
                seconds = ray.get([r.step.remote(system) for r in ranks])
                results[system] = aggs.read[system](step)
                t1 = time.perf_counter()
                time.sleep(0.005)  # what the aggregator does after its reply counts to its step
                if step >= WARMUP_STEPS:
                    wall[system].append(t1 - t0)
                    rank_cpu[system] += seconds
                    cpu[system] += report.cpu_seconds(aggs.pids[system]) - c0
            check(world_size, m, step, results)
    finally:
        ray.get([r.leave.remote() for r in ranks])
        aggs.kill()
    return Row(
        world_size,
        m,
        {s: statistics.median(v) for s, v in wall.items()},
        {s: v / steps for s, v in cpu.items()},
        {s: statistics.median(v) for s, v in rank_cpu.items()},
    )


def fit(rows: list[Row], m: int, system: str) -> tuple[float, float]:
    """Least squares ``aggregator CPU per step = a + b W`` over the rows of ``m``: (a, b) seconds."""
    points = [(r.world_size, r.aggregator[system]) for r in rows if r.metrics == m]
    if len({w for w, _ in points}) < 2:
        return math.nan, math.nan
    b, a = np.polyfit(*zip(*points), 1)
    return float(a), float(b)


# ---------------------------------------------------------------------------------------- reporting
def render_wall(rows: list[Row]) -> str:
    columns = ["W", "M", *(f"{SYSTEMS[s]} ms" for s in SYSTEMS), "seed loop vs siiRL (<1: faster)",
               "seed vs floor", "result(step) vs floor"]  # fmt: skip
    body = [
        [
            r.world_size,
            r.metrics,
            *(f"{r.wall[s] * 1e3:.1f}" for s in SYSTEMS),
            f"{r.wall['seed'] / r.wall['siirl']:.2f}x",
            f"{r.wall['seed'] / r.wall['floor']:.2f}x",
            f"{r.wall['posted'] / r.wall['floor']:.2f}x",
        ]
        for r in rows
    ]
    return report.table(columns, body)


def ratio(x: float, floor: float) -> str:
    """``x / floor`` as ``1.4x``; "noise" where either is not above zero (a per-step cost the fit's
    intercept cannot tell from zero)."""
    return f"{x / floor:.1f}x" if x > 0 and floor > 0 else "noise"


def render_cpu(rows: list[Row]) -> str:
    """Per M: each aggregator's fitted CPU per message and per step, and the ratio to the floor's."""
    body = []
    for m in sorted({r.metrics for r in rows}):
        floor_a, floor_b = fit(rows, m, "floor")
        for system in SYSTEMS:
            a, b = fit(rows, m, system)
            body.append([m, SYSTEMS[system], f"{b * 1e3:.3f}", ratio(b, floor_b), f"{a * 1e3:.2f}",
                         ratio(a, floor_a)])  # fmt: skip
    columns = ["M", "aggregator", "CPU ms per rank message", "vs floor", "CPU ms per step beyond", "vs floor"]
    return report.table(columns, body)


def render_rank(rows: list[Row]) -> str:
    systems = ("floor", "siirl", "seed")
    columns = ["W", "M", *(f"{SYSTEMS[s]} µs" for s in systems), "rlmetrics seed beyond floor µs"]
    body = [
        [r.world_size, r.metrics, *(f"{r.rank[s] * 1e6:.0f}" for s in systems),
         f"{(r.rank['seed'] - r.rank['floor']) * 1e6:.0f}"]
        for r in rows
    ]  # fmt: skip
    return report.table(columns, body)


def capacity(rows: list[Row]) -> str:
    """On paper, from the fitted CPU of the seed loop's aggregator (``a`` per step, ``b`` per
    message) and the rank's CPU per step (``r``): steps per second at 1,000 and 10,000 ranks,

    - flat: the root merges every rank's message, ``a + W b`` per step;
    - ``hierarchy="node"``, 8 ranks per node: each node merges its 8 ranks and forwards one message
      (``a + 8 b + r``, every node in parallel on its own CPU), the root merges one message per node
      (``a + W / 8 b``); the step takes the slower of the two.

    Each aggregator's CPU alone: no network, no waiting on the slowest rank."""
    body = []
    for m in sorted({r.metrics for r in rows}):
        a, b = fit(rows, m, "seed")
        a = max(a, 0.0)  # an intercept lost in noise: at 1,000 ranks and more, W b is the cost
        send = statistics.median(r.rank["seed"] for r in rows if r.metrics == m)
        for w in (1_000, 10_000):
            layouts = {"flat": (a + w * b, math.nan), f"node ({PER_NODE} ranks per node)":
                       (a + w / PER_NODE * b, a + PER_NODE * b + send)}  # fmt: skip
            for layout, (root, node) in layouts.items():
                if not b > 0:  # the fit lost the per-message cost in noise (or had one W)
                    body.append([m, f"{w:,}", layout, "noise", "", "noise"])
                    continue
                busiest = root if math.isnan(node) else max(root, node)
                node_ms = "" if math.isnan(node) else f"{node * 1e3:.1f}"
                body.append([m, f"{w:,}", layout, f"{root * 1e3:.1f}", node_ms, f"{1 / busiest:.2f}"])
    columns = ["M", "ranks", "layout", "root CPU ms/step", "node CPU ms/step", "steps/s"]
    return report.table(columns, body)


def verdict(x: float, floor: float, target: float) -> str:
    """``ratio(x, floor)`` and whether it is within ``target``; a ratio lost in noise is no verdict."""
    got = ratio(x, floor)
    return f"{got} — " + ("cannot tell" if got == "noise" else report.verdict(x / floor <= target))


def targets(rows: list[Row]) -> list[str]:
    worst_wall = max(r.wall["seed"] / r.wall["floor"] for r in rows)
    lines = [
        f"target seed loop within {TARGET_WALL}x the floor's wall time at every W, M: worst "
        f"{worst_wall:.2f}x — {report.verdict(worst_wall <= TARGET_WALL)}",
        f"target no slower than siiRL: worst {max(r.wall['seed'] / r.wall['siirl'] for r in rows):.2f}x its "
        f"wall time — {report.verdict(all(r.wall['seed'] <= r.wall['siirl'] for r in rows))}",
    ]
    for m in sorted({r.metrics for r in rows}):
        (fa, fb), (a, b) = fit(rows, m, "floor"), fit(rows, m, "seed")
        lines.append(
            f"target aggregator CPU per rank message within {TARGET_MESSAGE}x the floor at M={m}: "
            f"{verdict(b, fb, TARGET_MESSAGE)}; per step within {TARGET_STEP}x: {verdict(a, fa, TARGET_STEP)}"
        )
    beyond = [r.rank["seed"] - r.rank["floor"] for r in rows if r.metrics == 1000]
    if beyond:
        worst = max(beyond) * 1e6
        lines.append(
            f"target rank CPU <= {TARGET_RANK_US:.0f} µs per step beyond the floor at M=1000: worst "
            f"{worst:.0f} µs — {report.verdict(worst <= TARGET_RANK_US)}"
        )
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "W = 1 and 2, M = 100, 2 steps, 1 x 20 calls", argv)
    start = time.perf_counter()
    world_sizes, metric_counts, steps = (WORLD_SIZES, METRIC_COUNTS, STEPS)
    if args.quick:
        world_sizes, metric_counts, steps = (1, 2), (100,), 2
    versions = (f"numpy {np.__version__}", f"ray {ray.__version__}", f"rlmetrics {rlmetrics.__version__}")
    head = report.header("users' topology", *versions)
    print(head, flush=True)
    ray.init(address="local", include_dashboard=False, runtime_env=bench_peers._ray_runtime_env())
    try:
        ranks = [Rank.remote(r) for r in range(max(world_sizes))]
        siirl = bench_peers._start_siirl()
        rows = [measure(ranks[:w], m, steps, siirl) for w in world_sizes for m in metric_counts]
        for actor in (*ranks, siirl[0]):
            ray.kill(actor)
        calls = call_costs(1, 20) if args.quick else call_costs(4, 500)
    finally:
        ray.shutdown()
    notes = [
        f"one process per rank; medians of {steps} steps after {WARMUP_STEPS} warm-up steps, the systems' "
        "order rotated every step; results asserted per step (rlmetrics = siiRL on every name, means = "
        "floor sum / W)",
        "aggregator CPU: the run time of its process's threads over the measured steps, fitted "
        "a + b W over the W of the run (b: per rank message, a: per step)",
        *targets(rows),
        "Ray alone: a call to an async actor costs the actor {:.0f} µs of CPU, to a threaded actor "
        "{:.0f} µs, to a plain actor {:.0f} µs (async / plain {})".format(
            *(calls[k] * 1e6 for k in calls), ratio(calls["async actor"], calls["plain actor"])
        ),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    ray_call = report.table(
        ["receiving actor", "CPU µs per call (a method that does nothing, 8 kB argument)"],
        [[kind, f"{seconds * 1e6:.0f}"] for kind, seconds in calls.items()],
    )
    body = "\n\n".join(
        ["Wall time per step", render_wall(rows), "Aggregator CPU", render_cpu(rows), "Rank CPU per step",
         render_rank(rows), "Ray's own cost of one call, by kind of actor", ray_call,
         "Capacity on paper (aggregators' CPU alone)", capacity(rows)]
    )  # fmt: skip
    report.emit(head, body, notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
