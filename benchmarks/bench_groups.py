"""Cost of a group breakdown: ``compute_data_metric(batch, group_by="data_source")`` against
``compute_data_metric(batch)`` on the same batch, measured side by side in one process.

The batch is :func:`bench_data.make_batch`'s (B sequences, prompt width P, response width R, on CPU)
plus a ``data_source`` key (a numpy object array, as verl's ``non_tensor_batch`` holds it) with G
sources drawn at random, so groups have unequal sizes. With ``group_by`` the response-token
summaries are computed per sequence (one device pass, as without) and merged per group on the host;
every data metric is reported for the batch and for each of the G groups.

Timed: N rounds (N = 45; ``--quick``: 5, one small shape) that call each side once in turn, after
a warm-up, at torch's default thread count: the median time of each side, and the median over the
rounds of the grouped / ungrouped ratio of neighbouring calls (robust on a shared machine whose load
changes).
Before timing, every grouped number is checked against ``compute_data_metric`` of that group's
sequences alone (relative 1e-5).

Run: ``PYTHONPATH=src python benchmarks/bench_groups.py [--quick] [--markdown PATH]``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import report
import torch
from bench_data import make_batch

from rlmetrics.metrics.data import compute_data_metric

SHAPES = ((64, 512, 1024, 8), (256, 1024, 2048, 8), (256, 1024, 2048, 32))
QUICK_SHAPES = ((64, 256, 512, 8),)
TARGET = (256, 1024, 2048, 8)
TARGET_RATIO = 1.5  # at most this many times the ungrouped time
MEM = "perf/process_cpu_mem_used_gb"


@dataclass
class Row:
    batch: int
    prompt: int
    response: int
    groups: int
    plain_s: float
    grouped_s: float
    ratio: float  # the median of the rounds' grouped / ungrouped
    checked: int

    def cells(self) -> list[object]:
        times = (f"{self.plain_s * 1e3:.2f}", f"{self.grouped_s * 1e3:.2f}", f"{self.ratio:.2f}x")
        return [self.batch, self.prompt, self.response, self.groups, *times, self.checked]


def grouped_batch(b: int, p: int, r: int, g: int) -> dict:
    batch = make_batch(b, p, r, seed=b + p + r + g)
    rng = np.random.default_rng(g)
    batch["data_source"] = np.array([f"source{i}" for i in rng.integers(0, g, size=b)], dtype=object)
    return batch


def check_groups(batch: dict, got: dict[str, float]) -> int:
    """Every grouped number against the group's sequences computed alone; the number checked."""
    checked = 0
    b = len(batch["data_source"])
    for source in sorted(set(batch["data_source"])):
        idx = np.nonzero(batch["data_source"] == source)[0]
        rows = torch.as_tensor(idx)
        sub = {k: v[rows] if isinstance(v, torch.Tensor) else v[idx] for k, v in batch.items() if len(v) == b}
        for name, want in compute_data_metric(sub).items():
            if name == MEM:
                continue
            have = got[f"group/data_source/{source}/{name}"]
            assert math.isclose(have, want, rel_tol=1e-5, abs_tol=1e-5), (source, name, have, want)
            checked += 1
    return checked


def measure(b: int, p: int, r: int, g: int, reps: int) -> Row:
    batch = grouped_batch(b, p, r, g)
    checked = check_groups(batch, compute_data_metric(batch, group_by="data_source"))
    plain, grouped = report.interleaved(
        [lambda: compute_data_metric(batch), lambda: compute_data_metric(batch, group_by="data_source")], reps
    )
    ratio = statistics.median(g / p for p, g in zip(plain, grouped))
    return Row(b, p, r, g, statistics.median(plain), statistics.median(grouped), ratio, checked)


COLUMNS = (
    "B",
    "prompt",
    "response",
    "groups",
    "ungrouped ms",
    "grouped ms",
    "grouped / ungrouped (median of rounds)",
    "grouped names checked",
)


def render(rows: list[Row]) -> str:
    return report.table(COLUMNS, [row.cells() for row in rows])


def target_line(rows: list[Row]) -> str:
    b, p, r, g = TARGET
    cell = next((row for row in rows if (row.batch, row.prompt, row.response, row.groups) == TARGET), None)
    what = f"at B={b}, prompt {p}, response {r}, {g} groups"
    if cell is None:
        return f"target <= {TARGET_RATIO:g}x the ungrouped time {what}: not measured in this run"
    verdict = report.verdict(cell.ratio <= TARGET_RATIO)
    return f"target <= {TARGET_RATIO:g}x the ungrouped time {what}: {cell.ratio:.2f}x — {verdict}"


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "fewer repetitions, one small shape", argv)
    start = time.perf_counter()
    shapes, reps = (QUICK_SHAPES, 5) if args.quick else (SHAPES, 45)
    head = report.header(
        "group-breakdown", f"{torch.get_num_threads()} torch threads", f"torch {torch.__version__}"
    )
    print(head, flush=True)
    rows = [measure(b, p, r, g, reps) for b, p, r, g in shapes]
    notes = [
        f"medians of {reps} rounds calling each side once in turn (after a warm-up); CPU tensors",
        f"grouped numbers asserted equal (rel 1e-5) to each group alone: {sum(r.checked for r in rows)}",
        target_line(rows),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, render(rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
