"""Soak: a long run on Ray at training scale; the aggregator's memory stays flat, every step is logged.

W ranks (``rank{r}`` clients of ``rlmetrics.connect("ray", ...)``) are multiplexed over a few Ray
"rank host" actors. At every step each rank submits one dict of M scalar metrics (names ending in
``/mean``, ``/max``, ``/min``, ``/total``), values drawn from ``default_rng((seed, rank, step))``, and
closes the step with ``wait_submit()``. The hosts run at most ``LEAD`` steps ahead of the driver,
which reads ``result(step, timeout=...)`` for every step in order and logs it to a ``JsonlSink``.

The aggregator actor is probed (``__ray_call__``: its process RSS via psutil, the steps it holds,
the results it keeps) at the end of the warm-up and every ``PROBE_EVERY`` steps. Checks:

- RSS at the end grew < 5 % over RSS at the end of the warm-up;
- the JSONL holds every step exactly once, in order, each complete;
- finalized steps are freed: the aggregator never holds more than ``LEAD + 2`` pending steps, keeps
  at most ``keep_results`` results, and holds no step at the end;
- every step's values (read back from the JSONL) equal numpy over the regenerated data of all ranks.

Run: ``python benchmarks/soak.py [--steps 5000 --ranks 16 --metrics 500] [--quick] [--out DIR]``;
exits 1 when a check fails. ``--quick``: 200 steps, 100 of them warm-up (more than the 64 results
the aggregator keeps).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import report

import rlmetrics

HOSTS = 4
LEAD = 2  # steps the rank hosts may run ahead of the driver's result() calls
PROBE_EVERY = 100
RSS_GROWTH_LIMIT = 0.05
RESULT_TIMEOUT_S = 120.0
_TEMPLATES = ("soak/m{i}/mean", "soak/m{i}/max", "soak/m{i}/min", "soak/m{i}/total")
_REDUCE = {"mean": np.mean, "max": np.max, "min": np.min, "total": np.sum}


def metric_names(m: int) -> list[str]:
    """``m`` names cycling through the four plain reductions."""
    return [_TEMPLATES[k % 4].format(i=k // 4) for k in range(m)]


def rank_values(seed: int, rank: int, step: int, m: int) -> np.ndarray:
    """The ``m`` values rank ``rank`` submits at ``step``."""
    return np.random.default_rng((seed, rank, step)).uniform(0.5, 1.5, size=m)


def expected(seed: int, ranks: int, step: int, m: int) -> dict[str, float]:
    """The step's result, by numpy over every rank's regenerated values."""
    data = np.stack([rank_values(seed, r, step, m) for r in range(ranks)])
    return {n: float(_REDUCE[n.rsplit("/", 1)[1]](data[:, k])) for k, n in enumerate(metric_names(m))}


@ray.remote(num_cpus=1)
class RankHost:
    """One process simulating several ranks, each with its own rlmetrics client."""

    def __init__(self, name: str, ranks: list[int], world_size: int, m: int, seed: int) -> None:
        self.ranks, self.m, self.seed = ranks, m, seed
        self.names = metric_names(m)
        self.clients = [
            rlmetrics.connect("ray", name=name, world_size=world_size, label=f"rank{r}") for r in ranks
        ]

    def step(self, step: int) -> None:
        for rank, client in zip(self.ranks, self.clients):
            client.submit_metric(dict(zip(self.names, rank_values(self.seed, rank, step, self.m).tolist())))
            client.wait_submit()

    def stop(self) -> None:
        for client in self.clients:
            client.stop()


def _probe(actor: Any) -> dict:
    """Run inside the aggregator actor: its RSS and what its engine holds."""
    import gc

    import psutil

    gc.collect()
    engine = actor.engine
    return {
        "rss": psutil.Process().memory_info().rss,
        "pending": len(engine.pending_steps()),
        "results": len(engine._results),
        "finalized": len(engine._finalized),
        "keep_results": engine.keep_results,
        "late": engine.late,
    }


@dataclass
class Soak:
    steps: int
    ranks: int
    metrics: int
    warmup: int
    seconds: float = 0.0
    rss_warm: int = 0
    rss_end: int = 0
    probes: list[dict] = field(default_factory=list)
    partial: list[int] = field(default_factory=list)
    jsonl_steps: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    end: dict = field(default_factory=dict)

    @property
    def growth(self) -> float:
        return self.rss_end / self.rss_warm - 1.0

    def checks(self) -> list[tuple[str, bool]]:
        max_pending = max(p["pending"] for p in self.probes)
        max_results = max(p["results"] for p in self.probes)
        return [
            (
                f"aggregator RSS growth after warm-up < {RSS_GROWTH_LIMIT:.0%}: {self.growth:+.2%}",
                self.growth < RSS_GROWTH_LIMIT,
            ),
            (
                f"JSONL holds every step exactly once, in order: {len(self.jsonl_steps)} records",
                self.jsonl_steps == list(range(self.steps)),
            ),
            (f"every step complete: {len(self.partial)} partial", not self.partial),
            (
                f"finalized steps freed: at most {max_pending} pending (limit {LEAD + 2}), "
                f"{max_results} results kept (limit {self.end['keep_results']}), "
                f"{self.end['pending']} pending at the end",
                max_pending <= LEAD + 2
                and max_results <= self.end["keep_results"]
                and not self.end["pending"],
            ),
            (
                f"values equal numpy in all {self.steps} steps: {len(self.mismatches)} mismatches "
                f"{self.mismatches[:3]}",
                not self.mismatches,
            ),
        ]


def verify_values(path: Path, seed: int, ranks: int, m: int) -> tuple[list[int], list[str]]:
    """Steps of the JSONL in file order, and every value that differs from numpy."""
    from rlmetrics.sinks import read_jsonl

    run = read_jsonl(path)
    bad = []
    for rec in run.records:
        want = expected(seed, ranks, rec["step"], m)
        got = rec["metrics"]
        if got.keys() != want.keys():
            bad.append(f"step {rec['step']}: names differ")
            continue
        bad += [
            f"step {rec['step']} {n}: {got[n]!r} != {v!r}"
            for n, v in want.items()
            if not math.isclose(got[n], v, rel_tol=1e-12)
        ]
    return run.steps, bad


def soak(steps: int, ranks: int, m: int, warmup: int, out_dir: Path, seed: int = 0) -> Soak:
    """Run the soak on a fresh local Ray instance; the JSONL goes to ``out_dir/soak.jsonl``."""
    from rlmetrics.sinks import JsonlSink

    out = Soak(steps, ranks, m, warmup)
    path = out_dir / "soak.jsonl"
    name = f"soak-{uuid.uuid4().hex[:8]}"
    ray.init(
        address="local", num_cpus=HOSTS, include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    try:
        worker = rlmetrics.get_metric_worker(name=name)  # the driver owns the aggregator
        reader = rlmetrics.connect("ray", name=name)
        per_host = [list(range(ranks))[h::HOSTS] for h in range(HOSTS)]
        hosts = [RankHost.remote(name, rs, ranks, m, seed) for rs in per_host if rs]
        launched, inflight = 0, []
        t0 = time.perf_counter()
        with JsonlSink(path) as sink:
            for step in range(steps):
                while launched < min(steps, step + LEAD + 1):
                    inflight.append([h.step.remote(launched) for h in hosts])
                    launched += 1
                res = reader.result(step, timeout=RESULT_TIMEOUT_S)
                ray.get(inflight.pop(0))  # a host's error surfaces here
                sink.log(res, step)
                if not res.meta.get("complete"):
                    out.partial.append(step)
                if step + 1 == warmup or (step + 1) % PROBE_EVERY == 0 or step + 1 == steps:
                    probe = ray.get(worker.__ray_call__.remote(_probe))
                    out.probes.append(probe)
                    if step + 1 == warmup:
                        out.rss_warm = probe["rss"]
        out.seconds = time.perf_counter() - t0
        ray.get([h.stop.remote() for h in hosts])
        out.end = ray.get(worker.__ray_call__.remote(_probe))
        out.rss_end = out.probes[-1]["rss"]
        for actor in (*hosts, worker):
            ray.kill(actor)
    finally:
        ray.shutdown()
    out.jsonl_steps, out.mismatches = verify_values(path, seed, ranks, m)
    return out


def render(s: Soak) -> str:
    mib = 2**20
    return report.table(
        ["steps", "W", "M", "s", "ms/step", "RSS warm-up MiB", "RSS max MiB", "RSS end MiB", "RSS growth",
         "max pending steps", "max results kept", "partial steps", "JSONL records"],
        [[s.steps, s.ranks, s.metrics, f"{s.seconds:.0f}", f"{s.seconds / s.steps * 1e3:.1f}",
          f"{s.rss_warm / mib:.1f}", f"{max(p['rss'] for p in s.probes) / mib:.1f}", f"{s.rss_end / mib:.1f}",
          f"{s.growth:+.2%}",
          max(p["pending"] for p in s.probes), max(p["results"] for p in s.probes), len(s.partial),
          len(s.jsonl_steps)]],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = report.parser(__doc__, "200 steps (100 warm-up)")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--metrics", type=int, default=500)
    p.add_argument(
        "--warmup", type=int, help="steps before the first RSS sample (default: max(100, steps // 10))"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="directory of soak.jsonl (default: a temporary one)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 200
    warmup = args.warmup or max(100, args.steps // 10)
    if not 0 < warmup < args.steps:
        p.error("--warmup must be between 0 and --steps")
    versions = (f"numpy {np.__version__}", f"ray {ray.__version__}", f"rlmetrics {rlmetrics.__version__}")
    head = report.header("soak", *versions)
    print(head, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        s = soak(args.steps, args.ranks, args.metrics, warmup, out_dir, args.seed)
    checks = s.checks()
    notes = [
        f"{HOSTS} rank-host processes, hosts at most {LEAD} steps ahead; RSS of the aggregator actor "
        f"after step {warmup} (warm-up) and after the last step; seed {args.seed}",
        *[f"{text} — {report.verdict(ok)}" for text, ok in checks],
    ]
    report.emit(head, render(s), notes, args.markdown)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
