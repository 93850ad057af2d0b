"""Cost of the health rules: ``Tracking`` with the default rules against ``health=None``, per step,
measured side by side in one process.

Two runs of ``make_sinks(["jsonl"], ...)`` (one per side, each its own folder) log the same steps:

- churn: the names the default rules watch (gradient norms, clip fractions, KL, entropy...) and
  200 names never seen before at every step, the group breakdowns of 40 new tasks
  (``group/task/<i>/...``, as a run grouped by task or prompt has);
- steady: the same 1000 names at every step.

Timed: N rounds (N = 1000 steps; ``--quick``: 100) that log one step to each side in turn, after a
warm-up step: the median ms/step of each side, the median over the rounds of the health / none ratio
of neighbouring calls (robust on a shared machine whose load changes), and that ratio's median over
the last quarter of the rounds against the first quarter: a cost of the rules that grows with the
names seen before would show there. Before reporting, both JSONL files are read back: the same
records at every step, and no alert (every value is one no rule objects to).

Run: ``PYTHONPATH=src python benchmarks/bench_health.py [--quick] [--markdown PATH]``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import report

from rlmetrics.sinks import make_sinks, read_jsonl

NEW_TASKS = 40  # per step, 5 names each: 200 new names per step
GROUPED = ("critic/score/mean", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "response/length/max")
WATCHED = (  # names of each default rule's patterns, and plain ones
    "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/grad_norm",
    "critic/grad_norm", "critic/zero_var_groups/mean", "response/clip_ratio/mean", "critic/score/mean",
    "critic/rewards/mean", "response/length/mean", "perf/throughput",
)  # fmt: skip
STEADY_NAMES = 1000
GROWTH_TARGET = 1.5  # the ratio over the last quarter of the steps at most this many times the first


@dataclass
class Row:
    case: str
    names: int  # per step
    new: int  # names never seen before, per step
    none_ms: float
    health_ms: float
    ratio: float  # the median of the rounds' health / none
    growth: float  # the ratio's median over the last quarter of the rounds / over the first quarter

    def cells(self) -> list[object]:
        times = (f"{self.none_ms:.3f}", f"{self.health_ms:.3f}", f"{self.ratio:.2f}x", f"{self.growth:.2f}x")
        return [self.case, self.names, self.new, *times]


def churned(steps: int) -> list[dict[str, float]]:
    """The names of WATCHED, and 200 new ``group/task/<i>/...`` names at every step."""
    rng = np.random.default_rng(0)
    out = []
    for step in range(steps):
        m = dict(zip(WATCHED, rng.uniform(0.2, 0.22, len(WATCHED)).tolist()))
        values = rng.uniform(0.2, 0.22, NEW_TASKS * len(GROUPED)).tolist()
        tasks = range(step * NEW_TASKS, (step + 1) * NEW_TASKS)
        m.update(zip((f"group/task/{t}/{n}" for t in tasks for n in GROUPED), values))
        out.append(m)
    return out


def steady(steps: int) -> list[dict[str, float]]:
    """The same STEADY_NAMES names at every step: WATCHED, then ``custom/metric_<i>/mean``."""
    names = [*WATCHED, *(f"custom/metric_{i}/mean" for i in range(STEADY_NAMES - len(WATCHED)))]
    rng = np.random.default_rng(1)
    return [dict(zip(names, rng.uniform(0.2, 0.22, len(names)).tolist())) for _ in range(steps)]


def measure(case: str, steps: list[dict[str, float]], out: Path) -> Row:
    sides = {"none": None, "health": True}
    trackings = {side: make_sinks(["jsonl"], out / case / side, health=h) for side, h in sides.items()}

    def logger(side: str):
        tracking, queue = trackings[side], iter(enumerate(steps))

        def log_next() -> None:
            step, metrics = next(queue)
            tracking.log(metrics, step)

        return log_next

    try:
        none, health = report.interleaved([logger("none"), logger("health")], len(steps) - 1)
    finally:
        for tracking in trackings.values():
            tracking.close()
    runs = {side: read_jsonl(out / case / side / "metrics.jsonl") for side in sides}
    for side, run in runs.items():
        assert [r["metrics"] for r in run.records] == steps, f"{case}: the {side} side's JSONL differs"
    assert runs["health"].events == [], f"{case}: spurious alerts {runs['health'].events[:3]}"
    ratios = [h / n for n, h in zip(none, health)]
    quarter = len(ratios) // 4
    growth = statistics.median(ratios[-quarter:]) / statistics.median(ratios[:quarter])
    new = len(steps[1].keys() - steps[0].keys())
    return Row(case, len(steps[0]), new, statistics.median(none) * 1e3, statistics.median(health) * 1e3,
               statistics.median(ratios), growth)  # fmt: skip


COLUMNS = (
    "case",
    "names/step",
    "new names/step",
    "health=None ms/step",
    "default health ms/step",
    "health / none (median of rounds)",
    "ratio: last quarter / first quarter",
)


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "100 steps per case instead of 1000", argv)
    start = time.perf_counter()
    n = 100 if args.quick else 1000
    head = report.header("health")
    print(head, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure("churn", churned(n + 1), Path(tmp)), measure("steady", steady(n + 1), Path(tmp))]
    worst = max(row.growth for row in rows)
    notes = [
        f"{n} steps per case through make_sinks(['jsonl']), one step to each side in turn per round "
        "(after a warm-up step), the garbage collector paused",
        "both sides' JSONL read back: the same records at every step, no alert on the health side",
        f"target per-step cost flat (O(names in the step)): last / first quarter <= {GROWTH_TARGET:g}x in "
        f"every case: {worst:.2f}x — {report.verdict(worst <= GROWTH_TARGET)}",
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, report.table(COLUMNS, [row.cells() for row in rows]), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
