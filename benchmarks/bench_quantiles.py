"""Cost of exact quantiles: a step of one quantile name (``tok/p95``) over N values on 4 ranks, exact
(the raw values travel, up to the bound of 1,000,000 values per name and step) against the sketch
(log buckets beyond 4,096 values: the bound before issue 45), measured side by side in one process.

One step, as the Ray and local backends run it: each rank summarizes its N/4 normal values with
:func:`rlmetrics.packing.pack` (the sketch of a quantile name: sorted values, or buckets), the wire
encodes the contribution (:func:`rlmetrics.wire.encode`, then pickle, as Ray does), the aggregator
decodes it, merges it (:meth:`Aggregator.submit`), closes and finalizes the step (the quantile
read from the merged sketch). The sketch side runs the same code with ``RLMETRICS_EXACT_QUANTILES=4096``
in the environment (read where each rank builds its sketch). Timed: the ranks' part (pack, encode,
pickle: per rank, ranks run in parallel) and the aggregator's (unpickle, decode, merge, finalize),
in R rounds that run each side once in turn after a warm-up (R = 9; ``--quick``: 3 rounds, the two
small sizes); medians, and the median over the rounds of the exact / sketch ratio of the step time
(one rank's part plus the aggregator's). Payload: the pickled bytes one rank sends.

Before timing, the exact side's p95 is asserted equal to numpy's on the concatenation (relative
1e-12; torch's interpolation) and flagged exact; the sketch side's relative error is shown. The last
size, 1,000,000 values per rank (4,000,000 in the step), is beyond the bound: each rank still sends
its values (a rank cannot know the step's total), the aggregator merges them into buckets, and
``meta.approximate`` names the quantile.

Run: ``PYTHONPATH=src python benchmarks/bench_quantiles.py [--quick] [--markdown PATH]``.
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from dataclasses import dataclass

import numpy as np
import report

from rlmetrics import wire
from rlmetrics.core.sketch import EXACT_QUANTILES_ENV
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.packing import pack

WORLD = 4
NAME = "tok/p95"
SIZES = (4_096, 65_536, 1_000_000, 4_000_000)  # values per name and step, over the 4 ranks
QUICK_SIZES = (4_096, 65_536)
OLD_BOUND = "4096"


@dataclass
class Row:
    values: int
    exact_rank_ms: float
    exact_agg_ms: float
    sketch_rank_ms: float
    sketch_agg_ms: float
    ratio: float  # median over rounds of exact / sketch step time (one rank's part + the aggregator's)
    exact_bytes: int
    sketch_bytes: int
    exact_flagged: bool  # meta.approximate names the quantile on the "exact" side (beyond the bound)
    sketch_error: float

    def cells(self) -> list[object]:
        return [
            f"{self.values:,}",
            f"{self.exact_rank_ms:.2f}",
            f"{self.exact_agg_ms:.2f}",
            f"{self.sketch_rank_ms:.2f}",
            f"{self.sketch_agg_ms:.2f}",
            f"{self.ratio:.2f}x",
            f"{self.exact_bytes / 1024:,.1f}",
            f"{self.sketch_bytes / 1024:,.1f}",
            f"{self.exact_bytes / self.sketch_bytes:.1f}x",
            "approximate (flagged)" if self.exact_flagged else "exact",
            f"{self.sketch_error:.1e}",
        ]


COLUMNS = (
    "values in the step",
    "exact: rank ms",
    "exact: aggregator ms",
    "sketch: rank ms",
    "sketch: aggregator ms",
    "exact / sketch step time (median of rounds)",
    "exact: KiB per rank",
    "sketch: KiB per rank",
    "bytes exact / sketch",
    "exact side's p95",
    "sketch's rel. error",
)


class Side:
    """One side's pipeline: the ranks' messages and an aggregator that merges a new step each call."""

    def __init__(self, parts: list[np.ndarray], bound: str | None) -> None:
        self.parts, self.bound = parts, bound
        self.engine = Aggregator()
        self.table = wire.SchemaTable()
        self.step = 0
        self.rank_s: list[float] = []
        self.agg_s: list[float] = []
        self.bytes = 0
        self.result = None

    def rank(self, r: int, step: int) -> bytes:
        """Rank ``r``'s message of ``step``: its values summarized, encoded, pickled."""
        saved = os.environ.pop(EXACT_QUANTILES_ENV, None)
        if self.bound is not None:
            os.environ[EXACT_QUANTILES_ENV] = self.bound
        try:
            packed = pack({NAME: self.parts[r]})
        finally:
            os.environ.pop(EXACT_QUANTILES_ENV, None)
            if saved is not None:
                os.environ[EXACT_QUANTILES_ENV] = saved
        return pickle.dumps(wire.encode([(step, 0, WORLD, packed)], [step], send_names=True))

    def run(self) -> None:
        """One step; records one rank's part and the aggregator's (seconds)."""
        step, self.step = self.step, self.step + 1
        t0 = time.perf_counter()
        msgs = [self.rank(r, step) for r in range(WORLD)]
        t1 = time.perf_counter()
        for r, msg in enumerate(msgs):
            items, close, _ = wire.decode(pickle.loads(msg), self.table)
            for item_step, seq, world, packed in items:
                self.engine.submit(f"rank{r}", item_step, seq, world, packed)
            for s in close:
                self.engine.close(f"rank{r}", s)
        self.result = self.engine.finalize(step)
        t2 = time.perf_counter()
        self.rank_s.append((t1 - t0) / WORLD)
        self.agg_s.append(t2 - t1)
        self.bytes = len(msgs[0])


def measure(n: int, reps: int) -> Row:
    rng = np.random.default_rng(n)
    parts = [rng.normal(size=n // WORLD) for _ in range(WORLD)]
    x = np.concatenate(parts)
    want = float(np.quantile(x, 0.95))
    exact, sketch = Side(parts, None), Side(parts, OLD_BOUND)
    for side in (exact, sketch):
        side.run()  # the warm-up, and the check
    beyond = n > 1_000_000
    assert exact.result.meta.approximate == ([NAME] if beyond else []), exact.result.meta
    if not beyond:
        assert abs(exact.result[NAME] - want) <= 1e-12 * abs(want), (exact.result[NAME], want)
    assert sketch.result.meta.approximate == ([NAME] if n > int(OLD_BOUND) else [])
    report.interleaved([exact.run, sketch.run], reps)
    for side in (exact, sketch):  # the rounds' times, without the warm-ups
        side.rank_s, side.agg_s = side.rank_s[-reps:], side.agg_s[-reps:]
    step_s = [[r + a for r, a in zip(side.rank_s, side.agg_s)] for side in (exact, sketch)]
    return Row(
        n,
        statistics.median(exact.rank_s) * 1e3,
        statistics.median(exact.agg_s) * 1e3,
        statistics.median(sketch.rank_s) * 1e3,
        statistics.median(sketch.agg_s) * 1e3,
        statistics.median(e / s for e, s in zip(*step_s)),
        exact.bytes,
        sketch.bytes,
        beyond,
        abs(sketch.result[NAME] - want) / abs(want),
    )


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "3 rounds, the two small sizes", argv)
    start = time.perf_counter()
    sizes, reps = (QUICK_SIZES, 3) if args.quick else (SIZES, 9)
    head = report.header("exact-quantiles", f"numpy {np.__version__}")
    print(head, flush=True)
    rows = [measure(n, reps) for n in sizes]
    notes = [
        f"{WORLD} ranks of normal values, one quantile name; medians of {reps} rounds running each side "
        "once in turn (after a warm-up), in one process: a rank's part is per rank (ranks run in parallel)",
        "exact: the default bound (1,000,000 values per name and step); sketch: "
        "RLMETRICS_EXACT_QUANTILES=4096 (the bound before issue 45; 0.5% relative error beyond)",
        "exact p95 asserted equal to numpy's on the concatenation (rel 1e-12) up to the bound; beyond it "
        "meta.approximate names the quantile on both sides",
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, report.table(COLUMNS, [row.cells() for row in rows]), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
