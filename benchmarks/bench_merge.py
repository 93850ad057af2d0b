"""Merge throughput of the rlmetrics engine against a naive per-name-list aggregator.

One step: each of W ranks submits one dict of M scalar floats under the same M metric names (a mix of
realistic names such as ``critic/score_7/mean``, ``perf/total_num_tokens_7``, ``timing_s/gen_7``).

- **rlmetrics**: each rank's dict is packed once with :func:`rlmetrics.engine.aggregator.pack` and a shared
  schema cache, outside the timed region (that client-side cost is the ``pack µs/rank`` column, the
  median over ranks). Timed: ``submit`` + ``close`` for every rank, then ``finalize(step)``. One
  warm-up step registers the schema; the median of the following steps is reported.
- **naive**: the seed's MetricWorker as described in its docs: ``working[name].append(value)`` per
  key, and once a name holds ``world_size`` values, the function picked by substring rules (min, max,
  sum/total, else ``statistics.mean``) with the ``timing_s/`` → ``perf/delta_time/`` rename. Timed:
  all ranks' dicts parsed key by key plus those computations; median of up to 7 repetitions (3 with
  ``--quick``; fewer when a cell exceeds its time budget).

Both sides must give the same numbers (relative 1e-9) for every name where their rules pick the
same reduction; the benchmark asserts it. (They differ on ``timing_s/*`` and ``actor/minibatch_loss``:
the seed's substring rules take ``min`` there, as ``"min" in "timing"`` and ``"minibatch"``.)

Run: ``make bench``, or ``PYTHONPATH=src python benchmarks/bench_merge.py [--quick] [--markdown PATH]``.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import report

from rlmetrics.core.packing import Packed, pack
from rlmetrics.core.reduce import resolve
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.messages import StepResult

WORLD_SIZES = (8, 64, 256, 1024)
METRIC_COUNTS = (100, 1000, 3000)
TARGET_CELL = (256, 3000)
TARGET_VALUES_PER_S = 50e6
TARGET_RATIO = 50.0
NAIVE_BUDGET_S = 4.0  # naive repetitions of one cell stop once they took this long (at least one runs)

T = TypeVar("T")

_TEMPLATES = (
    "critic/score_{i}/mean", "critic/score_{i}/max", "critic/score_{i}/min", "critic/rewards_{i}/mean",
    "critic/advantages_{i}/max", "critic/returns_{i}/min", "response_length_{i}/mean",
    "response_length_{i}/clip_ratio", "perf/total_num_tokens_{i}", "perf/max_memory_allocated_gb_{i}",
    "perf/throughput_{i}", "actor/minibatch_loss_{i}", "actor/pg_loss_{i}", "actor/entropy_{i}",
    "actor/grad_norm_{i}", "timing_s/gen_{i}", "timing_s/update_actor_{i}",
)  # fmt: skip


def metric_names(m: int) -> list[str]:
    """``m`` distinct, realistic metric names."""
    return [_TEMPLATES[k % len(_TEMPLATES)].format(i=k // len(_TEMPLATES)) for k in range(m)]


def rank_dicts(world_size: int, m: int, seed: int = 0) -> list[dict[str, float]]:
    """One ``{name: float}`` per rank: positive values, one scale per name (for relative checks)."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 4, size=m)
    values = rng.uniform(0.5, 1.5, size=(world_size, m)) * scale
    names = metric_names(m)
    return [dict(zip(names, row, strict=True)) for row in values.tolist()]


# ------------------------------------------------------------------------------------- naive baseline
def naive_kind(name: str) -> str:
    """The seed's substring rules (``MetricFunc``) for the four plain reductions."""
    if "min" in name:
        return "min"
    if "max" in name:
        return "max"
    if "sum" in name or "total" in name:
        return "sum"
    return "mean"


_NAIVE_FUNCS: dict[str, Callable[[list[float]], float]] = {
    "min": min,
    "max": max,
    "sum": sum,
    "mean": statistics.mean,
}


def naive_out_name(name: str) -> str:
    return "perf/delta_time/" + name[len("timing_s/") :] if name.startswith("timing_s/") else name


class NaiveMerger:
    """Per-name value lists, reduced when ``world_size`` values arrived (the seed's MetricWorker)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.working: defaultdict[str, list[float]] = defaultdict(list)
        self.results: dict[str, float] = {}

    def submit(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            values = self.working[name]
            values.append(value)
            if len(values) == self.world_size:
                self.results[naive_out_name(name)] = float(_NAIVE_FUNCS[naive_kind(name)](values))
                del self.working[name]


# ---------------------------------------------------------------------------------------- measuring
@dataclass
class Row:
    world_size: int
    metrics: int
    ours_s: float  # median seconds per step
    naive_s: float
    naive_reps: int
    pack_us: float  # median client-side pack time per rank
    checked: int  # names whose values were asserted equal on both sides

    @property
    def values(self) -> int:
        return self.world_size * self.metrics

    @property
    def ratio(self) -> float:
        return self.naive_s / self.ours_s


def _step_times(fn: Callable[[int], T], reps: int, budget_s: float = math.inf) -> tuple[list[float], T]:
    """Seconds of ``fn(i)`` for ``i = 0, 1, ...``: ``reps`` calls, fewer once ``budget_s`` is spent
    (at least one); gc is off throughout. Also the last call's result."""
    gc.collect()
    gc.disable()
    try:
        times: list[float] = []
        while len(times) < reps and sum(times) < budget_s:
            t0 = time.perf_counter()
            out = fn(len(times))
            times.append(time.perf_counter() - t0)
        return times, out
    finally:
        gc.enable()


def measure(world_size: int, m: int, reps: int) -> Row:
    dicts = rank_dicts(world_size, m, seed=world_size * 10_007 + m)
    clients = [f"rank{r}" for r in range(world_size)]

    schemas: dict = {}
    packed: list[Packed] = []
    pack_times = []
    for d in dicts:
        t0 = time.perf_counter()
        packed.append(pack(d, schemas=schemas))
        pack_times.append(time.perf_counter() - t0)

    agg = Aggregator()

    def ours_step(step: int) -> StepResult:
        for client, p in zip(clients, packed, strict=True):
            agg.submit(client, step, 0, world_size, p)
            agg.close(client, step)
        return agg.finalize(step)

    def naive_step(_: int) -> dict[str, float]:
        merger = NaiveMerger(world_size)
        for d in dicts:
            merger.submit(d)
        return merger.results

    ours_times, ours = _step_times(ours_step, reps + 1)  # step 0 registers the schema: warm-up
    naive_times, naive = _step_times(naive_step, reps, NAIVE_BUDGET_S)
    return Row(
        world_size,
        m,
        statistics.median(ours_times[1:]),
        statistics.median(naive_times),
        len(naive_times),
        statistics.median(pack_times) * 1e6,
        _check_same(ours, naive, m),
    )


def _check_same(ours: StepResult, naive: dict[str, float], m: int) -> int:
    """Assert both results agree wherever both rules pick the same reduction; how many names that is."""
    assert ours.meta.complete, "rlmetrics step is incomplete"
    assert len(ours) == len(naive) == m, (len(ours), len(naive), m)
    agreeing = [n for n in metric_names(m) if resolve(n).name == naive_kind(n)]
    assert len(agreeing) > m // 2, "too few names where both rules agree"
    for name in agreeing:
        out = naive_out_name(name)
        assert math.isclose(ours[out], naive[out], rel_tol=1e-9), (name, ours[out], naive[out])
    return len(agreeing)


# ---------------------------------------------------------------------------------------- reporting
def render(rows: list[Row]) -> str:
    columns = [
        "W",
        "M",
        "rlmetrics M values/s",
        "naive M values/s",
        "ratio",
        "rlmetrics ms/step",
        "pack µs/rank",
    ]
    return report.table(
        columns,
        [
            [r.world_size, r.metrics, f"{r.values / r.ours_s / 1e6:.1f}", f"{r.values / r.naive_s / 1e6:.2f}",
             f"{r.ratio:.0f}x", f"{r.ours_s * 1e3:.2f}", f"{r.pack_us:.0f}"]
            for r in rows
        ],
    )  # fmt: skip


def targets(rows: list[Row]) -> list[str]:
    w, m = TARGET_CELL
    cell = next((r for r in rows if (r.world_size, r.metrics) == TARGET_CELL), None)
    if cell is None:
        return [f"targets at W={w}, M={m}: not measured in this run"]
    rate = cell.values / cell.ours_s
    return [
        f"target >= {TARGET_VALUES_PER_S / 1e6:.0f} M values/s at W={w}, M={m}: {rate / 1e6:.1f} M values/s "
        f"— {report.verdict(rate >= TARGET_VALUES_PER_S)}",
        f"target >= {TARGET_RATIO:.0f}x naive at W={w}, M={m}: {cell.ratio:.0f}x "
        f"— {report.verdict(cell.ratio >= TARGET_RATIO)}",
    ]


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "W in {8, 64}, M in {100, 1000}, fewer reps", argv)

    start = time.perf_counter()
    world_sizes, metric_counts, reps = (
        ((8, 64), (100, 1000), 3) if args.quick else (WORLD_SIZES, METRIC_COUNTS, 7)
    )
    head = report.header("merge", f"numpy {np.__version__}")
    print(head, flush=True)
    rows = [measure(w, m, reps) for w in world_sizes for m in metric_counts]
    notes = [
        f"rlmetrics: median of {reps} steps after 1 warm-up step; naive: median of up to {reps} repetitions"
        f" ({NAIVE_BUDGET_S:g} s budget per cell)"
    ]
    notes += [
        f"naive W={r.world_size}, M={r.metrics}: {r.naive_reps} repetition(s)"
        for r in rows
        if r.naive_reps < reps
    ]
    notes.append(
        f"results asserted equal (rel 1e-9) on {sum(r.checked for r in rows)} of "
        f"{sum(r.metrics for r in rows)} names, those where both rules pick the same reduction"
    )
    notes += targets(rows)
    notes.append(f"total runtime: {time.perf_counter() - start:.1f} s")
    report.emit(head, render(rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
