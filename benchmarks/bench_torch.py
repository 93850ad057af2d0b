"""Bytes and time per step of the torch.distributed backend against ``all_gather_object`` of the dict.

One step: each of W = 4 gloo processes (``torch.multiprocessing``, one machine) holds one dict
of M scalar floats under the same M realistic names (:func:`bench_merge.rank_dicts`) and every rank
gets the merged result.

- **rlmetrics**: ``rlmetrics.connect("torch")``; timed: ``submit_metric(d)``, ``wait_submit()`` (the
  collectives) and ``result(step)``, so packing and the final reduction are included. Step 0 agrees
  on the layout (the one ``all_gather_object`` of names) and is a warm-up, not timed.
- **all_gather_object**: ``dist.all_gather_object(out, d)`` of the dict, then on every rank the seed's
  per-name reduction of the gathered dicts (:class:`bench_merge.NaiveMerger`: substring rules,
  ``statistics.mean``); the bare ``all_gather_object`` time is shown as well.

``bytes in`` is what one rank hands to its collectives per step (rlmetrics: the float64 vectors of
``all_reduce``; the baseline: its pickled dict plus the 8-byte size that ``all_gather_object`` sends
first). ``bytes out`` is what every rank receives: ``all_reduce`` returns a vector of the input's
size, ``all_gather_object`` returns W padded pickles. Times: the median over the steps of rank 0,
every step started by a ``dist.barrier``. Each step asserts both results agree (relative 1e-9)
wherever the seed's rules pick the same reduction as ours.

Run: ``python benchmarks/bench_torch.py [--quick] [--markdown PATH]`` (needs the ``torch`` extra).
"""

from __future__ import annotations

import pickle
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import report
from bench_merge import NaiveMerger, _check_same, rank_dicts

WORLD = 4
METRIC_COUNTS = (1000, 10000)
TARGET_M = 10000
TARGET_TIME_RATIO = 2.0
TARGET_BYTES_RATIO = 4.0  # bytes received per rank


@dataclass
class Row:
    metrics: int
    ours_ms: float
    gather_ms: float  # all_gather_object + per-name reduction
    bare_ms: float  # all_gather_object alone
    ours_in: int
    ours_out: int
    gather_in: int
    gather_out: int

    @property
    def time_ratio(self) -> float:
        return self.gather_ms / self.ours_ms

    @property
    def bytes_ratio(self) -> float:
        return self.gather_out / self.ours_out


def _timed_steps(dist, steps: int, fn) -> list[float]:
    times = []
    for step in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn(step)
        times.append(time.perf_counter() - t0)
    return times


def _worker(rank: int, out_dir: str, metric_counts: tuple[int, ...], steps: int) -> None:
    import torch.distributed as dist

    import rlmetrics

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    rows = []
    try:
        for m in metric_counts:
            dicts = rank_dicts(WORLD, m, seed=m)
            mine = dicts[rank]
            client = rlmetrics.connect("torch")
            results = {}

            def ours(step: int, client=client, mine=mine, results=results) -> None:
                client.submit_metric(mine)
                client.wait_submit()
                results[step] = client.result(step)

            ours(0)  # layout agreement: the warm-up step
            ours_t = _timed_steps(dist, steps, lambda s, ours=ours: ours(s + 1))
            ours_bytes = client.transport.bytes_last_step
            gathered: list = [None] * WORLD

            def bare(_: int, mine=mine, gathered=gathered) -> None:
                dist.all_gather_object(gathered, mine)

            naive: dict = {}

            def gather(_: int, bare=bare, gathered=gathered, naive=naive) -> None:
                bare(0)
                merger = NaiveMerger(WORLD)
                for d in gathered:
                    merger.submit(d)
                naive.update(merger.results)

            gather(0)
            gather_t = _timed_steps(dist, steps, gather)
            bare_t = _timed_steps(dist, steps, bare)
            _check_same(results[steps], naive, m)
            sizes = [len(pickle.dumps(d)) for d in dicts]
            rows.append(
                Row(
                    m,
                    statistics.median(ours_t) * 1e3,
                    statistics.median(gather_t) * 1e3,
                    statistics.median(bare_t) * 1e3,
                    ours_bytes,
                    ours_bytes,
                    sizes[rank] + 8,
                    WORLD * (max(sizes) + 8),
                )
            )
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(out_dir) / "rows.pkl").write_bytes(pickle.dumps(rows))


def render(rows: list[Row]) -> str:
    columns = [
        "M",
        "rlmetrics ms/step",
        "all_gather_object + merge ms/step",
        "all_gather_object alone ms",
        "time ratio (+ merge / alone)",
        "rlmetrics bytes in / out",
        "all_gather_object bytes in / out",
        "bytes out ratio",
    ]
    return report.table(
        columns,
        [
            [r.metrics, f"{r.ours_ms:.2f}", f"{r.gather_ms:.2f}", f"{r.bare_ms:.2f}",
             f"{r.time_ratio:.1f}x / {r.bare_ms / r.ours_ms:.1f}x",
             f"{r.ours_in:,} / {r.ours_out:,}", f"{r.gather_in:,} / {r.gather_out:,}",
             f"{r.bytes_ratio:.1f}x"]
            for r in rows
        ],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "M in {100, 1000}, 5 steps", argv)
    import torch
    import torch.multiprocessing as mp

    import rlmetrics  # noqa: F401 - imported once, before the ranks fork

    start = time.perf_counter()
    metric_counts, steps = ((100, 1000), 5) if args.quick else (METRIC_COUNTS, 30)
    head = report.header(f"torch.distributed (gloo, {WORLD} processes)", f"torch {torch.__version__}")
    print(head, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"  # fork: no re-import per rank
        mp.start_processes(_worker, (tmp, metric_counts, steps), nprocs=WORLD, start_method=method)
        rows = pickle.loads((Path(tmp) / "rows.pkl").read_bytes())
    cell = next((r for r in rows if r.metrics == TARGET_M), None)
    notes = [
        f"median of {steps} steps on rank 0 after 1 warm-up step; results asserted equal (rel 1e-9) where "
        "both rules pick the same reduction",
        report.ratio_target(
            f"all_gather_object + merge, time at M={TARGET_M}", cell and cell.time_ratio, TARGET_TIME_RATIO
        ),
        report.ratio_target(
            f"all_gather_object, bytes received per rank at M={TARGET_M}",
            cell and cell.bytes_ratio,
            TARGET_BYTES_RATIO,
        ),
        f"numpy {np.__version__}; total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, render(rows), notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
