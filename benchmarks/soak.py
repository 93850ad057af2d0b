"""Soak: a long run on Ray at training scale; memory stays flat, every step read is logged.

W ranks (``rank{r}`` clients of ``rlmetrics.connect("ray", ...)``) are multiplexed over a few Ray
"rank host" actors. At every step each rank submits one dict of M scalar metrics (names ending in
``/mean``, ``/max``, ``/min``, ``/total``), values drawn from ``default_rng((seed, rank, step))``, plus
``--new-names`` names used in that step only, and closes the step with ``wait_submit()``. The hosts
run at most ``LEAD`` steps ahead of the driver, which reads ``result(step, timeout=...)`` for every
``--read-every``-th step in order and logs it to a ``JsonlSink`` (the steps it does not read are
finalized when complete all the same).

The aggregator actor and the hosts are probed (``__ray_call__``: process RSS via psutil; the engine's
own counters; what each client keeps) at the end of the warm-up and every ``PROBE_EVERY`` steps.
Checks:

- aggregator and host RSS at the end grew < 5 % over RSS at the end of the warm-up;
- the JSONL holds every step read exactly once, in order, each complete;
- finalized steps are freed: the aggregator never holds more than ``LEAD + 2`` pending steps, keeps
  at most ``keep_results`` results, and holds no step at the end; no client keeps more than
  ``LEAD + 3`` steps of sent data (a client forgets a step once the aggregator saved it finalized,
  which its next reply says);
- names, schemas and layouts stay bounded (at most those of ``forget_after`` + ``LEAD + 2`` steps at
  the aggregator; at most its schema cache in a client);
- every step's values (read back from the JSONL) equal numpy over the regenerated data of all ranks.

Run: ``python benchmarks/soak.py [--steps 5000 --ranks 16 --metrics 500] [--new-names N]
[--read-every K] [--quick] [--out DIR]``; exits 1 when a check fails. ``--quick``: 200 steps, 100 of
them warm-up (more than the 64 results the aggregator keeps).
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
KEPT_LIMIT = LEAD + 3  # steps a client keeps: LEAD + 2 pending, and one finalized but not yet saved
PROBE_EVERY = 100
RSS_GROWTH_LIMIT = 0.05
CLIENT_SCHEMAS = 520  # a client clears its schema cache and known-schema set beyond 512
RESULT_TIMEOUT_S = 120.0
_TEMPLATES = ("soak/m{i}/mean", "soak/m{i}/max", "soak/m{i}/min", "soak/m{i}/total")
_REDUCE = {"mean": np.mean, "max": np.max, "min": np.min, "total": np.sum}


def metric_names(m: int) -> list[str]:
    """``m`` names cycling through the four plain reductions."""
    return [_TEMPLATES[k % 4].format(i=k // 4) for k in range(m)]


def step_names(m: int, new: int, step: int) -> list[str]:
    """The names of a step: ``m`` kept over the run, ``new`` used in this step only."""
    return metric_names(m) + [f"soak/s{step}/{n}" for n in metric_names(new)]


def rank_values(seed: int, rank: int, step: int, m: int) -> np.ndarray:
    """The ``m`` values rank ``rank`` submits at ``step``."""
    return np.random.default_rng((seed, rank, step)).uniform(0.5, 1.5, size=m)


def expected(seed: int, ranks: int, step: int, m: int, new: int = 0) -> dict[str, float]:
    """The step's result, by numpy over every rank's regenerated values."""
    data = np.stack([rank_values(seed, r, step, m + new) for r in range(ranks)])
    return {
        n: float(_REDUCE[n.rsplit("/", 1)[1]](data[:, k])) for k, n in enumerate(step_names(m, new, step))
    }


@ray.remote(num_cpus=1)
class RankHost:
    """One process simulating several ranks, each with its own rlmetrics client."""

    def __init__(self, name: str, ranks: list[int], world_size: int, m: int, new: int, seed: int) -> None:
        self.ranks, self.m, self.new, self.seed = ranks, m, new, seed
        self.clients = [
            rlmetrics.connect("ray", name=name, world_size=world_size, label=f"rank{r}") for r in ranks
        ]

    def step(self, step: int) -> None:
        names = step_names(self.m, self.new, step)
        for rank, client in zip(self.ranks, self.clients):
            values = rank_values(self.seed, rank, step, self.m + self.new).tolist()
            client.submit_metric(dict(zip(names, values)))
            client.wait_submit()

    def probe(self) -> dict:
        """This process's RSS and the most any of its clients keeps."""
        import gc

        import psutil

        gc.collect()
        clients = self.clients
        return {
            "rss": psutil.Process().memory_info().rss,
            "kept_steps": max(len(c._kept) for c in clients),
            "schemas": max(len(c._schemas) for c in clients),
            "known": max(len(c.transport._known) for c in clients),
        }

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
        **engine.memory(),
        "table": len(actor.table.schemas),
        "keep_results": engine.keep_results,
        "forget_after": engine.forget_after,
        "late": engine.late,
    }


@dataclass
class Soak:
    steps: int
    ranks: int
    metrics: int
    warmup: int
    new_names: int = 0
    read_every: int = 1
    seconds: float = 0.0
    warm: int = 0  # the index of the probe at the end of the warm-up
    probes: list[dict] = field(default_factory=list)  # the aggregator's
    host_probes: list[list[dict]] = field(default_factory=list)  # per probe, every host's
    partial: list[int] = field(default_factory=list)
    jsonl_steps: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    end: dict = field(default_factory=dict)

    @property
    def growth(self) -> float:
        return self.probes[-1]["rss"] / self.probes[self.warm]["rss"] - 1.0

    @property
    def host_growth(self) -> float:
        warm, end = self.host_probes[self.warm], self.host_probes[-1]
        return max(e["rss"] / w["rss"] - 1.0 for w, e in zip(warm, end))

    def read_steps(self) -> list[int]:
        return list(range(0, self.steps, self.read_every))

    def checks(self) -> list[tuple[str, bool]]:
        max_pending = max(p["pending"] for p in self.probes)
        max_results = max(p["results"] for p in self.probes)
        window = self.end["forget_after"] + LEAD + 2  # steps whose names the aggregator may hold
        names_limit = self.metrics + window * self.new_names
        max_names = max(p["names"] for p in self.probes)
        max_schemas = max(max(p["schemas"], p["table"]) for p in self.probes)
        max_layouts = max(p["layouts"] for p in self.probes)
        hosts = [h for probe in self.host_probes for h in probe]
        max_kept = max(h["kept_steps"] for h in hosts)
        max_client_schemas = max(max(h["schemas"], h["known"]) for h in hosts)
        return [
            (
                f"aggregator RSS growth after warm-up < {RSS_GROWTH_LIMIT:.0%}: {self.growth:+.2%}; "
                f"rank hosts: {self.host_growth:+.2%}",
                self.growth < RSS_GROWTH_LIMIT and self.host_growth < RSS_GROWTH_LIMIT,
            ),
            (
                f"JSONL holds every step read exactly once, in order: {len(self.jsonl_steps)} records",
                self.jsonl_steps == self.read_steps(),
            ),
            (f"every step complete: {len(self.partial)} partial", not self.partial),
            (
                f"finalized steps freed: at most {max_pending} pending (limit {LEAD + 2}), "
                f"{max_results} results kept (limit {self.end['keep_results']}), "
                f"{self.end['pending']} pending at the end",
                max_pending <= LEAD + 2
                and max_results <= self.end["keep_results"]
                and not self.end["pending"]
                and max_kept <= KEPT_LIMIT,
            ),
            (
                f"names, schemas, layouts bounded: at most {max_names} names (limit {names_limit}), "
                f"{max_schemas} schemas and {max_layouts} layouts (limit {window}) at the aggregator, "
                f"{max_client_schemas} in a client (limit {CLIENT_SCHEMAS}); clients keep at most "
                f"{max_kept} steps (limit {KEPT_LIMIT})",
                max_names <= names_limit
                and max_schemas <= window
                and max_layouts <= window
                and max_client_schemas <= CLIENT_SCHEMAS,
            ),
            (
                f"values equal numpy in all {self.steps} steps: {len(self.mismatches)} mismatches "
                f"{self.mismatches[:3]}",
                not self.mismatches,
            ),
        ]


def verify_values(path: Path, seed: int, ranks: int, m: int, new: int) -> tuple[list[int], list[str]]:
    """Steps of the JSONL in file order, and every value that differs from numpy."""
    from rlmetrics.sinks import read_jsonl

    run = read_jsonl(path)
    bad = []
    for rec in run.records:
        want = expected(seed, ranks, rec["step"], m, new)
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


def soak(s: Soak, out_dir: Path, seed: int = 0) -> Soak:
    """Run the soak ``s`` describes on a fresh local Ray instance; the JSONL goes to
    ``out_dir/soak.jsonl``."""
    from rlmetrics.sinks import JsonlSink

    path = out_dir / "soak.jsonl"
    name = f"soak-{uuid.uuid4().hex[:8]}"
    ray.init(
        address="local", num_cpus=HOSTS, include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    try:
        worker = rlmetrics.get_metric_worker(name=name)  # the driver owns the aggregator
        reader = rlmetrics.connect("ray", name=name)
        per_host = [list(range(s.ranks))[h::HOSTS] for h in range(HOSTS)]
        hosts = [RankHost.remote(name, rs, s.ranks, s.metrics, s.new_names, seed) for rs in per_host if rs]
        launched, inflight = 0, []
        t0 = time.perf_counter()
        with JsonlSink(path) as sink:
            for step in range(s.steps):
                while launched < min(s.steps, step + LEAD + 1):
                    inflight.append([h.step.remote(launched) for h in hosts])
                    launched += 1
                if step % s.read_every == 0:
                    res = reader.result(step, timeout=RESULT_TIMEOUT_S, finalize=True)
                    sink.log(res, step)
                    if not res.meta.complete:
                        s.partial.append(step)
                ray.get(inflight.pop(0))  # a host's error surfaces here
                if step + 1 == s.warmup or (step + 1) % PROBE_EVERY == 0 or step + 1 == s.steps:
                    s.probes.append(ray.get(worker.__ray_call__.remote(_probe)))
                    s.host_probes.append(ray.get([h.probe.remote() for h in hosts]))
                    if step + 1 == s.warmup:
                        s.warm = len(s.probes) - 1
        s.seconds = time.perf_counter() - t0
        ray.get([h.stop.remote() for h in hosts])
        s.end = ray.get(worker.__ray_call__.remote(_probe))
        for actor in (*hosts, worker):
            ray.kill(actor)
    finally:
        ray.shutdown()
    s.jsonl_steps, s.mismatches = verify_values(path, seed, s.ranks, s.metrics, s.new_names)
    return s


def render(s: Soak) -> str:
    mib = 2**20
    return report.table(
        ["steps", "W", "M", "new names/step", "read every", "s", "ms/step", "RSS warm-up MiB", "RSS max MiB",
         "RSS end MiB", "RSS growth", "host RSS growth", "max names", "max pending steps",
         "max results kept", "partial steps", "JSONL records"],
        [[s.steps, s.ranks, s.metrics, s.new_names, s.read_every, f"{s.seconds:.0f}",
          f"{s.seconds / s.steps * 1e3:.1f}", f"{s.probes[s.warm]['rss'] / mib:.1f}",
          f"{max(p['rss'] for p in s.probes) / mib:.1f}", f"{s.probes[-1]['rss'] / mib:.1f}",
          f"{s.growth:+.2%}", f"{s.host_growth:+.2%}", max(p["names"] for p in s.probes),
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
    p.add_argument("--new-names", type=int, default=0, help="names used in one step only, per step")
    p.add_argument("--read-every", type=int, default=1, help="the driver reads every K-th step")
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
        s = Soak(args.steps, args.ranks, args.metrics, warmup, args.new_names, args.read_every)
        soak(s, out_dir, args.seed)
    checks = s.checks()
    notes = [
        f"{HOSTS} rank-host processes, hosts at most {LEAD} steps ahead; RSS of the aggregator actor and "
        f"the hosts after step {warmup} (warm-up) and after the last step; seed {args.seed}",
        *[f"{text} — {report.verdict(ok)}" for text, ok in checks],
    ]
    report.emit(head, render(s), notes, args.markdown)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
