"""Scale: 1024 simulated ranks x 1000 metrics, one root aggregator vs per-node sub-aggregators.

A real multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``: a head and 7 more nodes,
``num_cpus=1`` each, every node its own raylet and object store). One "rank host" actor per node,
pinned there, simulates ``W / nodes`` ranks: each an rlmetrics client (``rlmetrics.connect("ray",
..., world_size=W, label="rank{r}")``) that submits one dict of M scalar floats drawn from
``(rank, step)`` per step and calls ``wait_submit()``. The dicts of a step are built before it starts.

- **flat**: every client sends to the root ``MetricWorker`` (one message per rank and step; a host's
  messages posted while its previous call is in flight travel together in one ``send_many`` call).
- **node** (``hierarchy="node"``): clients send to their node's ``NodeWorker``, which merges its
  ranks and forwards one message per step to the root.

Timed per step: from telling all hosts to go (one ``ray.get([host.step.remote() ...])``) until rank
0 (host 0) has the step's result from ``result(step, timeout)``. Counted per step from the root's
``stats()``: messages (``calls["messages"]``, one per client or node message) and calls
(``send`` + ``send_many`` RPCs). Checked every step: the result is complete, ``.../mean`` names equal
the numpy mean over all ranks (rel 1e-9), ``.../max`` the numpy max; the root received exactly W
messages per step flat and exactly one per node with the hierarchy — the run fails otherwise.
CPU per step, read from each process's threads (``report.cpu_seconds``) around the step: the
root's (also per root message) and a node sub-aggregator's (mean over the nodes). Flat and node run
alternately in each step on the same hosts; median over the steps after one
warm-up step (9 timed steps; ``--quick``: 2 nodes, 16 ranks, 100 metrics, 2 timed steps).

Run: ``python benchmarks/bench_scale.py [--quick] [--markdown PATH]`` (needs the ``ray`` extra).
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from dataclasses import dataclass

import numpy as np
import ray
import report
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import rlmetrics
from rlmetrics.backends.ray import node_worker

FULL = {"nodes": 8, "ranks": 1024, "metrics": 1000, "steps": 9}
QUICK = {"nodes": 2, "ranks": 16, "metrics": 100, "steps": 2}
WARMUP_STEPS = 1
RESULT_TIMEOUT_S = 300.0
KINDS = ("flat", "node")


def metric_names(m: int) -> list[str]:
    """``m`` names: means, maxima and plain (mean) names, as a trainer's dict mixes them."""
    forms = ("actor/loss_{i}/mean", "critic/score_{i}/max", "actor/entropy_{i}")
    return [forms[k % len(forms)].format(i=k // len(forms)) for k in range(m)]


def rank_values(rank: int, step: int, m: int) -> np.ndarray:
    return np.random.default_rng((rank, step)).uniform(0.5, 1.5, size=m)


@ray.remote(num_cpus=1)
class RankHost:
    """One process (one per node) simulating a block of ranks, with a flat and a node client each."""

    def __init__(self, ranks: list[int], world: int, m: int, aggregators: dict[str, str]) -> None:
        self.ranks = ranks
        self.names = metric_names(m)
        self.clients = {
            kind: [
                rlmetrics.connect(
                    "ray",
                    name=aggregators[kind],
                    world_size=world,
                    label=f"rank{r}",
                    **({"hierarchy": "node"} if kind == "node" else {}),
                )
                for r in ranks
            ]
            for kind in KINDS
        }
        self.dicts: list[dict[str, float]] = []

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def prepare(self, step: int) -> None:
        """This step's dicts (untimed)."""
        m = len(self.names)
        self.dicts = [dict(zip(self.names, rank_values(r, step, m).tolist())) for r in self.ranks]

    def step(self, step: int, kind: str) -> rlmetrics.StepResult | None:
        clients = self.clients[kind]
        for client, d in zip(clients, self.dicts):
            client.submit_metric(d)
            client.wait_submit()
        if self.ranks[0] == 0:
            return clients[0].result(step, timeout=RESULT_TIMEOUT_S)
        for client in clients:
            client.flush()  # a refused message would raise here
        return None


@dataclass
class Row:
    kind: str
    nodes: int
    ranks: int
    metrics: int
    step_s: float  # median seconds per step
    messages: float  # root messages per step (all timed steps alike, checked)
    calls: float  # root RPCs per step (median)
    root_cpu: float  # the root's CPU seconds per step (mean)
    node_cpu: float  # a node sub-aggregator's CPU seconds per step (mean over nodes and steps; nan flat)


def root_counts(root) -> tuple[int, int]:
    calls = ray.get(root.stats.remote())["calls"]
    return calls.get("messages", 0), calls.get("send", 0) + calls.get("send_many", 0)


def check(kind: str, res: rlmetrics.StepResult, step: int, cfg: dict, messages: int) -> None:
    """Complete, exact against numpy, and the root's messages: W flat, one per node with the hierarchy."""
    w, m, nodes = cfg["ranks"], cfg["metrics"], cfg["nodes"]
    if not res.meta.complete or len(res) != m:
        raise SystemExit(f"{kind} step {step}: incomplete result {res.meta}")
    data = np.array([rank_values(r, step, m) for r in range(w)])
    means, maxima = data.mean(axis=0), data.max(axis=0)
    for name, mean, top in zip(metric_names(m), means.tolist(), maxima.tolist()):
        want = top if name.endswith("/max") else mean
        if not math.isclose(res[name], want, rel_tol=1e-9):
            raise SystemExit(f"{kind} step {step}: {name} = {res[name]}, numpy says {want}")
    expected = nodes if kind == "node" else w
    if messages != expected:
        raise SystemExit(f"{kind} step {step}: the root received {messages} messages, expected {expected}")


def measure(cfg: dict) -> list[Row]:
    nodes, w, m, steps = cfg["nodes"], cfg["ranks"], cfg["metrics"], cfg["steps"]
    node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(node_ids) == nodes, node_ids
    aggregators = {kind: f"bench-scale-{kind}-{uuid.uuid4().hex[:8]}" for kind in KINDS}
    roots = {
        "flat": rlmetrics.get_metric_worker(name=aggregators["flat"]),
        "node": rlmetrics.get_metric_worker(name=aggregators["node"], hierarchy="node"),
    }
    per_host = w // nodes
    hosts = [
        RankHost.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids[h], soft=False)).remote(
            list(range(h * per_host, (h + 1) * per_host)), w, m, aggregators
        )
        for h in range(nodes)
    ]
    if sorted(ray.get([h.node_id.remote() for h in hosts])) != node_ids:
        raise SystemExit("rank hosts are not spread one per node")
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    msgs: dict[str, list[int]] = {k: [] for k in KINDS}
    calls: dict[str, list[int]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in (*KINDS, "nodes")}
    root_pids = {kind: report.actor_pid(root) for kind, root in roots.items()}
    # the node sub-aggregators (get_metric_worker(hierarchy="node") started one on every node)
    node_pids = [report.actor_pid(node_worker(aggregators["node"], None, n)) for n in node_ids]
    try:
        for step in range(WARMUP_STEPS + steps):
            ray.get([h.prepare.remote(step) for h in hosts])
            for kind in KINDS:
                before = root_counts(roots[kind])
                c0 = [report.cpu_seconds(pid) for pid in (root_pids[kind], *node_pids)]
                t0 = time.perf_counter()
                res = ray.get([h.step.remote(step, kind) for h in hosts])[0]
                elapsed = time.perf_counter() - t0
                time.sleep(0.005)  # what the aggregators do after their replies counts to the step
                c1 = [report.cpu_seconds(pid) for pid in (root_pids[kind], *node_pids)]
                after = root_counts(roots[kind])
                check(kind, res, step, cfg, after[0] - before[0])
                if step >= WARMUP_STEPS:
                    times[kind].append(elapsed)
                    msgs[kind].append(after[0] - before[0])
                    calls[kind].append(after[1] - before[1])
                    cpu[kind].append(c1[0] - c0[0])
                    if kind == "node":
                        cpu["nodes"] += [b - a for a, b in zip(c0[1:], c1[1:])]
    finally:  # hosts first: their clients watch the aggregators
        for actor in hosts:
            ray.kill(actor)
        for nid in node_ids:
            ray.kill(node_worker(aggregators["node"], None, nid))
        for actor in roots.values():
            ray.kill(actor)
    med, mean = statistics.median, statistics.mean
    return [
        Row(k, nodes, w, m, med(times[k]), mean(msgs[k]), med(calls[k]), mean(cpu[k]),
            mean(cpu["nodes"]) if k == "node" else math.nan)
        for k in KINDS
    ]  # fmt: skip


def render(rows: list[Row]) -> str:
    flat = next(r for r in rows if r.kind == "flat")
    columns = ["aggregation", "nodes", "ranks", "metrics", "ms/step", "vs flat", "root messages/step",
               "root RPCs/step", "root CPU ms/step", "root CPU ms/message", "node CPU ms/step"]  # fmt: skip
    body = []
    for r in rows:
        node = "" if math.isnan(r.node_cpu) else f"{r.node_cpu * 1e3:.1f}"
        body.append([r.kind, r.nodes, r.ranks, r.metrics, f"{r.step_s * 1e3:.0f}",
                     f"{flat.step_s / r.step_s:.2f}x", f"{r.messages:g}", f"{r.calls:g}",
                     f"{r.root_cpu * 1e3:.1f}", f"{r.root_cpu / r.messages * 1e3:.2f}", node])  # fmt: skip
    return report.table(columns, body)


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "2 nodes, 16 ranks, 100 metrics, 2 timed steps", argv)
    start = time.perf_counter()
    cfg = QUICK if args.quick else FULL
    versions = (f"numpy {np.__version__}", f"ray {ray.__version__}", f"rlmetrics {rlmetrics.__version__}")
    head = report.header("scale", *versions)
    print(head, flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(cfg["nodes"] - 1):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        rows = measure(cfg)
    finally:
        ray.shutdown()
        cluster.shutdown()
    tree = next(r for r in rows if r.kind == "node")
    notes = [
        f"ray.cluster_utils.Cluster: {cfg['nodes']} nodes (num_cpus=1 each) on one machine, one rank host "
        f"per node with {cfg['ranks'] // cfg['nodes']} rank clients; median of {cfg['steps']} steps after "
        f"{WARMUP_STEPS} warm-up step(s); every node shares the same cores, so the hierarchy's latency here "
        "includes its extra hop without the network it saves",
        "results asserted per step: complete, .../mean = numpy mean over all ranks (rel 1e-9), .../max exact",
        f"target root messages/step = ranks (flat) and = nodes (hierarchy), every step: {tree.messages:g} "
        f"with {tree.nodes} nodes — {report.verdict(tree.messages == tree.nodes)}",
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, render(rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
