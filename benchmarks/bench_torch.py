"""Time and bytes per step of the torch.distributed backend against ``all_gather_object`` of the dict.

One step: each of W gloo processes (``torch.multiprocessing``, one machine) holds one dict of M scalar
floats under the same M realistic names (:func:`bench_merge.rank_dicts`) and every rank gets the
merged result. For every W in {2, 4, 8} and M in {100, 1000, 10000}:

- **rlmetrics** in both exchange forms (``connect("torch", exchange=...)``, see
  :mod:`rlmetrics.backends.torch_dist`): ``gather`` (one ``all_gather`` of every rank's packed
  state) and ``reduce`` (all-reduces). Timed: ``submit_metric(d)``, ``wait_submit()`` (the
  collectives) and ``result(step)``, so packing and the final reduction into ``{name: value}`` are
  included. Step 0 agrees on the layout (the one ``all_gather_object`` of names) and is a warm-up,
  not timed. What a user gets, ``exchange="auto"``, runs the very code of the form it picks (the
  ``auto`` column, read from an untimed step of an ``auto`` client; its ratio is that form's).
- **all_gather_object**: ``dist.all_gather_object(out, d)`` of the dict alone (the target's baseline:
  no reduction at all), and followed by the seed's per-name reduction of the gathered dicts on every
  rank (:class:`bench_merge.NaiveMerger`: substring rules, ``statistics.mean``).

The sides take turns within every step (each timed call started by a ``dist.barrier``, the order
rotating from step to step, the garbage collector paused), so a noisy neighbour slows all alike;
times are the median over the steps of rank 0. ``bytes out`` is what a
rank receives per step: ``all_reduce`` returns a vector of its input's size, ``all_gather`` and
``all_gather_object`` return W of them (padded pickles for the latter, plus the sizes). Each form's
result is asserted equal to the seed's merge (relative 1e-9) wherever the seed's rules pick the same
reduction as ours.

Run: ``python benchmarks/bench_torch.py [--quick] [--markdown PATH]`` (needs the ``torch`` extra).
"""

from __future__ import annotations

import gc
import pickle
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import report
from bench_merge import NaiveMerger, _check_same, rank_dicts

WORLD_SIZES = (2, 4, 8)
METRIC_COUNTS = (100, 1000, 10000)
FORMS = ("gather", "reduce")
TARGET_RATIO = 1.0  # against the bare all_gather_object, in every cell


@dataclass
class Row:
    world: int
    metrics: int
    ours_ms: dict[str, float]  # by exchange form
    chosen: str  # the form exchange="auto" picks
    bare_ms: float  # all_gather_object alone
    merge_ms: float  # all_gather_object + the seed's merge
    ours_out: dict[str, int] = field(default_factory=dict)  # bytes received per rank, by form
    bare_out: int = 0

    def ratio(self, form: str | None = None) -> float:
        return self.bare_ms / self.ours_ms[form or self.chosen]


def _timed_round(dist, calls: dict, times: dict, step: int) -> None:
    """One timed call of each side, the order rotating from step to step, the garbage collector
    paused (it would run in whichever call follows the seed's merge and its many small objects)."""
    names = list(calls)
    names = names[step % len(names) :] + names[: step % len(names)]
    gc.collect()
    gc.disable()
    try:
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            calls[name](step)
            times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()


def _worker(rank: int, world: int, out_dir: str, metric_counts: tuple[int, ...], steps: int) -> None:
    import torch.distributed as dist

    import rlmetrics

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    rows = []
    try:
        for m in metric_counts:
            dicts = rank_dicts(world, m, seed=m)
            mine = dicts[rank]
            clients = {form: rlmetrics.connect("torch", exchange=form) for form in (*FORMS, "auto")}
            results: dict = {form: {} for form in clients}
            gathered: list = [None] * world
            naive: dict = {}

            def ours(step: int, form: str, mine=mine, clients=clients, results=results) -> None:
                client = clients[form]
                client.submit_metric(mine)
                client.wait_submit()
                results[form][step] = client.result(step)

            def bare(_: int, mine=mine, gathered=gathered) -> None:
                dist.all_gather_object(gathered, mine)

            def merge(_: int, bare=bare, gathered=gathered, naive=naive) -> None:
                bare(0)
                merger = NaiveMerger(world)
                for d in gathered:
                    merger.submit(d)
                naive.update(merger.results)

            calls = {form: (lambda s, form=form, ours=ours: ours(s + 1, form)) for form in FORMS}
            calls.update(bare=bare, merge=merge)
            for form in clients:  # layout agreement: the warm-up step
                ours(0, form)
            merge(0)
            times: dict = {name: [] for name in calls}
            for step in range(steps):
                _timed_round(dist, calls, times, step)
            for form in FORMS:
                _check_same(results[form][steps], naive, m)
            sizes = [len(pickle.dumps(d)) for d in dicts]
            transports = {form: clients[form].transport for form in FORMS}
            rows.append(
                Row(
                    world,
                    m,
                    {form: statistics.median(times[form]) * 1e3 for form in FORMS},
                    results["auto"][0].meta.exchange,
                    statistics.median(times["bare"]) * 1e3,
                    statistics.median(times["merge"]) * 1e3,
                    {form: t.bytes_received_last_step for form, t in transports.items()},
                    world * (max(sizes) + 8),
                )
            )
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(out_dir) / "rows.pkl").write_bytes(pickle.dumps(rows))


# ------------------------------------------------------------------ where one rank's step goes
_STAGES = (  # (label, module, attribute path): timed around every call, in one process (W = 1)
    ("submit_metric", "rlmetrics.client", "ClientCore.submit_metric"),
    ("wait_submit", "rlmetrics.backends.torch_dist", "TorchMetricClient.wait_submit"),
    ("send: merge into the rank's aggregator", "rlmetrics.backends.torch_dist", "TorchDistTransport.send"),
    ("close_step", "rlmetrics.backends.torch_dist", "TorchDistTransport.close_step"),
    ("take the rank's submissions", "rlmetrics.engine.aggregator", "Aggregator.take"),
    ("local columns", "rlmetrics.backends.torch_dist", "TorchDistTransport._local_columns"),
    ("exchange_state", "rlmetrics.backends.torch_dist", "exchange_state"),
    ("collective (gloo, W = 1)", "rlmetrics.backends.torch_dist", "TorchDistTransport._collect"),
    ("finalize into {name: value}", "rlmetrics.backends.torch_dist", "TorchDistTransport._finish"),
    ("result(step)", "rlmetrics.client", "ClientCore.result"),
)


def stage_profile(m: int, steps: int) -> tuple[float, float, dict[str, float]]:
    """One process (a gloo group of 1): µs per step of rlmetrics (gather form) and of a bare
    ``all_gather_object``, and µs per step in each of :data:`_STAGES` (nested: ``close_step``
    holds take, local columns, exchange_state and finalize; exchange_state holds the collective)."""
    import importlib

    import torch.distributed as dist

    import rlmetrics

    spent: dict[str, float] = {label: 0.0 for label, _, _ in _STAGES}
    saved = []

    def timed(label: str, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0

        return run

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mine = rank_dicts(1, m, seed=m)[0]
        client = rlmetrics.connect("torch", exchange="gather")
        gathered: list = [None]

        def ours(step: int) -> None:
            client.submit_metric(mine)
            client.wait_submit()
            client.result(step)

        ours(0)
        bare_s, ours_s = [], []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            dist.all_gather_object(gathered, mine)
            t1 = time.perf_counter()
            ours(step)
            bare_s.append(t1 - t0)
            ours_s.append(time.perf_counter() - t1)
        for label, module, path in _STAGES:
            owner = importlib.import_module(module)
            *parents, attr = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, timed(label, getattr(owner, attr)))
        for step in range(steps + 1, 2 * steps + 1):
            ours(step)
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
        dist.destroy_process_group()
    per_step = {label: seconds / steps * 1e6 for label, seconds in spent.items()}
    return statistics.median(ours_s) * 1e6, statistics.median(bare_s) * 1e6, per_step


def render_stages(profiles: dict[int, tuple[float, float, dict[str, float]]]) -> str:
    ms = list(profiles)
    rows = [
        ["rlmetrics step (median, untimed stages)", *(f"{profiles[m][0]:.0f}" for m in ms)],
        ["bare all_gather_object (median)", *(f"{profiles[m][1]:.0f}" for m in ms)],
    ]
    rows += [[label, *(f"{profiles[m][2][label]:.0f}" for m in ms)] for label, _, _ in _STAGES]
    return report.table(["µs per step, one process (W = 1)", *(f"M = {m}" for m in ms)], rows)


def render(rows: list[Row]) -> str:
    columns = [
        "W",
        "M",
        "all_gather_object ms",
        "+ seed's merge ms",
        "rlmetrics gather ms",
        "rlmetrics reduce ms",
        "auto picks",
        "auto vs all_gather_object",
        "gather / reduce vs all_gather_object",
        "auto vs + merge",
        "bytes out: all_gather_object / gather / reduce",
    ]
    return report.table(
        columns,
        [
            [r.world, r.metrics, f"{r.bare_ms:.2f}", f"{r.merge_ms:.2f}",
             f"{r.ours_ms['gather']:.2f}", f"{r.ours_ms['reduce']:.2f}", r.chosen,
             f"{r.ratio():.1f}x", f"{r.ratio('gather'):.1f}x / {r.ratio('reduce'):.1f}x",
             f"{r.merge_ms / r.ours_ms[r.chosen]:.1f}x",
             f"{r.bare_out:,} / {r.ours_out['gather']:,} / {r.ours_out['reduce']:,}"]
            for r in rows
        ],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "W in {2, 4}, M in {100, 1000}, 5 steps", argv)
    import torch
    import torch.multiprocessing as mp

    import rlmetrics  # noqa: F401 - imported once, before the ranks fork
    from rlmetrics.backends.torch_dist import GATHER_LIMIT

    start = time.perf_counter()
    worlds, metric_counts, steps = (
        ((2, 4), (100, 1000), 5) if args.quick else (WORLD_SIZES, METRIC_COUNTS, 40)
    )
    head = report.header("torch.distributed (gloo, one machine)", f"torch {torch.__version__}")
    print(head, flush=True)
    rows: list[Row] = []
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"  # fork: no re-import per rank
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_worker, (world, tmp, metric_counts, steps), nprocs=world, start_method=method)
            rows += pickle.loads((Path(tmp) / "rows.pkl").read_bytes())
    profiles = {m: stage_profile(m, 200 if args.quick else 2000) for m in metric_counts}
    worst = min(rows, key=lambda r: r.ratio())
    notes = [
        f"median of {steps} steps on rank 0 after 1 warm-up step, the sides taking turns within each step "
        "(order rotating, gc paused); "
        "every form's result asserted equal to the seed's merge (rel 1e-9) where both rules pick the same "
        f"reduction; auto gathers while W x (the stat fields the reductions read + header) <= "
        f"{GATHER_LIMIT:,} floats",
        report.ratio_target(
            f"a bare all_gather_object of the dict in every cell (worst: W={worst.world}, M={worst.metrics})",
            worst.ratio(),
            TARGET_RATIO,
        ),
        f"numpy {np.__version__}; total runtime: {time.perf_counter() - start:.1f} s",
    ]
    body = "\n\n".join(
        [
            render(rows),
            "Where a step goes: the same step in one process (a gloo group of one), each stage timed "
            "around every call (nested: close_step holds take, local columns, exchange_state and "
            "finalize; exchange_state holds the collective)",
            render_stages(profiles),
        ]
    )
    report.emit(head, body, notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
