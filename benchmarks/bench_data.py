"""Speed of :func:`rlmetrics.metrics.data.compute_data_metric` against a per-metric ``.item()`` reference.

One batch of B sequences, prompt width P (left-padded), response width R (right-padded), on CPU:
``token_level_scores`` / ``token_level_rewards`` (one reward on the last response token, about half
of them correct), ``advantages``, ``returns``, ``values`` (float32, zero off the response),
``attention_mask`` and ``response_mask`` (int64), ``__num_turns__`` (int32 numpy, as siiRL's agent
loop stores it).

- **rlmetrics**: ``compute_data_metric(batch)``: every summary on the device, one host transfer.
- **reference**: the seed's code style, written here: ``masked_select`` for the response tokens,
  then ``torch.mean/max/min(...).item()`` for every metric (one host sync each on an accelerator),
  ``torch.var`` for the explained variance, boolean indexing for correct / wrong lengths.

Timed: the median of N calls after one warm-up (N = 15, 5 with ``--quick``), three times with the
sides alternating, best median kept; at torch's default thread count (the target) and with one
thread. The one-thread ratio is the sober one: on a small, busy machine the reference's
``masked_select`` gets slower with more threads, which flatters the default-thread ratio. On CPU an
``.item()`` costs microseconds, so these numbers compare computation only; on an accelerator each
``.item()`` also waits for the device (not measured here). Both sides must agree (relative 1e-5) on
every name they share; the benchmark asserts it.

Second table: the cost of the built-in histograms (:mod:`rlmetrics.core.histogram`):
``compute_data_stats(batch)`` (what ``compute_local_data_metric`` submits: the Stats plus the
sketches of the default histograms, response and prompt lengths and scores) and
``compute_data_stats(batch, histograms=HISTOGRAMS.values())`` (also every advantage token) against
``compute_data_stats(batch, histograms=False)``, with one torch thread (the sober setting, see
above), and the work the histograms add, timed alone: their Stats with sketches built from the host
vectors (``Stat.of(v, sketch=True)``). All five calls in turn, 3 N times, the fastest call of each
kept. The ratios are ``(no histograms + sketches) / no histograms``: on a busy machine the noise of
the end-to-end columns is larger than the tenth of a millisecond the default sketches cost.

Run: ``PYTHONPATH=src python benchmarks/bench_data.py [--quick] [--markdown PATH]``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import psutil
import report
import torch

from rlmetrics.core.stat import Stat
from rlmetrics.metrics.data import DEFAULT_HISTOGRAMS, HISTOGRAMS, compute_data_metric, compute_data_stats

SHAPES = ((64, 512, 1024), (256, 1024, 2048))
QUICK_SHAPES = ((64, 256, 512),)
DEFAULT_THREADS = torch.get_num_threads()
TARGET_SHAPE = (256, 1024, 2048)
TARGET_RATIO = 2.0


def make_batch(b: int, p: int, r: int, seed: int = 0) -> dict:
    """A realistic PPO batch (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, p + 1, (b,), generator=g)
    response_len = torch.randint(0, r + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p) >= p - prompt_len[:, None]).long()
    response_mask = (torch.arange(r) < response_len[:, None]).long()
    maskf = response_mask.float()
    scores = torch.zeros(b, r)
    last = (response_len - 1).clamp(min=0)
    scores[torch.arange(b), last] = (torch.rand(b, generator=g) > 0.5).float() * (response_len > 0)
    advantages = torch.randn(b, r, generator=g) * maskf
    values = torch.randn(b, r, generator=g) * maskf
    return {
        "responses": torch.zeros(b, r, dtype=torch.long),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "advantages": advantages,
        "returns": (advantages + values) * maskf,
        "values": values,
        "__num_turns__": np.random.default_rng(seed).integers(1, 5, size=b).astype(np.int32),
    }


# ------------------------------------------------------------------------------------------ reference
def reference_data_metric(batch: dict) -> dict[str, float]:
    """The seed's style: masked_select, then one ``.item()`` per metric."""
    r = batch["responses"].shape[-1]
    prompt_mask = batch["attention_mask"][:, :-r]
    response_mask = batch["response_mask"].bool()
    prompt_length = prompt_mask.sum(-1).float()
    response_length = batch["response_mask"].sum(-1).float()
    score = batch["token_level_scores"].sum(-1)
    reward = batch["token_level_rewards"].sum(-1)
    adv = torch.masked_select(batch["advantages"], response_mask)
    ret = torch.masked_select(batch["returns"], response_mask)
    val = torch.masked_select(batch["values"], response_mask)
    out: dict[str, float] = {}
    for prefix, x in (
        ("critic/score", score),
        ("critic/rewards", reward),
        ("critic/advantages", adv),
        ("critic/returns", ret),
        ("critic/values", val),
        ("response/length", response_length),
        ("prompt/length", prompt_length),
    ):
        out[f"{prefix}/mean"] = torch.mean(x).item()
        out[f"{prefix}/max"] = torch.max(x).item()
        out[f"{prefix}/min"] = torch.min(x).item()
    out["critic/vf_explained_var"] = (1.0 - torch.var(ret - val) / (torch.var(ret) + 1e-5)).item()
    out["response/clip_ratio/mean"] = torch.mean(torch.eq(response_length, r).float()).item()
    out["prompt/clip_ratio/mean"] = torch.mean(torch.eq(prompt_length, prompt_mask.shape[-1]).float()).item()
    correct = reward > 0.5
    for prefix, sel in (("response/correct_length", correct), ("response/wrong_length", ~correct)):
        lengths = response_length[sel]
        if lengths.numel():
            out[f"{prefix}/mean"] = torch.mean(lengths).item()
            out[f"{prefix}/max"] = torch.max(lengths).item()
            out[f"{prefix}/min"] = torch.min(lengths).item()
    out["response/aborted_ratio"] = torch.mean((response_length == 0).float()).item()
    turns = torch.as_tensor(batch["__num_turns__"]).float()
    out["num_turns/min"] = turns.min().item()
    out["num_turns/max"] = turns.max().item()
    out["num_turns/mean"] = turns.mean().item()
    out["perf/process_cpu_mem_used_gb"] = psutil.Process(os.getpid()).memory_info().rss / 1024**3
    return out


# ---------------------------------------------------------------------------------------- measuring
@dataclass
class Row:
    batch: int
    prompt: int
    response: int
    threads: int
    ours_s: float
    ref_s: float
    checked: int

    @property
    def ratio(self) -> float:
        return self.ref_s / self.ours_s


def _median_time(fn: Callable[[], object], reps: int) -> float:
    return statistics.median(report.timed(fn, reps)[0])


def check_same(ours: dict[str, float], ref: dict[str, float]) -> int:
    shared = [n for n in ref if n != "perf/process_cpu_mem_used_gb"]
    missing = [n for n in shared if n not in ours]
    assert not missing, f"rlmetrics lacks {missing}"
    for name in shared:
        assert math.isclose(ours[name], ref[name], rel_tol=1e-5, abs_tol=1e-5), (name, ours[name], ref[name])
    return len(shared)


def measure(b: int, p: int, r: int, reps: int, threads: int) -> Row:
    batch = make_batch(b, p, r, seed=b + p + r)
    checked = check_same(compute_data_metric(batch), reference_data_metric(batch))
    torch.set_num_threads(threads)
    try:  # alternate the two sides so that a noisy neighbour slows both alike
        ours, ref = [], []
        for _ in range(3):
            ours.append(_median_time(lambda: compute_data_metric(batch), reps))
            ref.append(_median_time(lambda: reference_data_metric(batch), reps))
    finally:
        torch.set_num_threads(DEFAULT_THREADS)
    return Row(b, p, r, threads, min(ours), min(ref), checked)


def measure_histograms(b: int, p: int, r: int, reps: int) -> tuple[float, float, float, float, float]:
    """Seconds of ``compute_data_stats`` without histograms, with the default ones, with all; and of
    the work the histograms add alone (their Stats with sketches from the host vectors: the default
    ones, the advantage tokens)."""
    batch = make_batch(b, p, r, seed=b + p + r)
    every = tuple(HISTOGRAMS.values())
    assert set(every) <= set(compute_data_stats(batch, histograms=every))
    mask = batch["response_mask"].numpy() != 0
    vectors = [
        mask.sum(-1),
        batch["attention_mask"].numpy()[:, :p].sum(-1),
        batch["token_level_scores"].sum(-1).numpy(),
    ]
    advantages = batch["advantages"].numpy()
    calls = [
        lambda: compute_data_stats(batch, histograms=False),
        lambda: compute_data_stats(batch),
        lambda: compute_data_stats(batch, histograms=every),
        lambda: [Stat.of(v, sketch=True) for v in vectors],
        lambda: Stat.of(advantages[mask], sketch=True),
    ]
    times: list[list[float]] = [[] for _ in calls]
    torch.set_num_threads(1)
    try:  # one call of each in turn, so that a noisy neighbour slows all alike; the fastest call kept
        for call in calls:
            call()
        for _ in range(3 * reps):
            for out, call in zip(times, calls):
                out.append(report.timed(call, 1)[0][0])
    finally:
        torch.set_num_threads(DEFAULT_THREADS)
    none, default, every_s, default_work, token_work = (min(t) for t in times)
    return none, default, every_s, default_work, token_work


def render_histograms(shapes: list[tuple[int, int, int]], times: list[tuple[float, ...]]) -> str:
    rows = []
    for (b, p, r), (none, default, every, default_work, token_work) in zip(shapes, times):
        rows.append([
            b, p, r, f"{none * 1e3:.2f}", f"{default * 1e3:.2f}", f"{every * 1e3:.2f}",
            f"{default_work * 1e3:.3f}", f"{(none + default_work) / none:.3f}x",
            f"{token_work * 1e3:.2f}", f"{(none + default_work + token_work) / none:.2f}x",
        ])  # fmt: skip
    return report.table(
        ["B", "prompt", "response", "no histograms ms", "default ms", "all ms", "default sketches ms",
         "ratio", "advantage sketch ms", "ratio"],
        rows,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- reporting
def render(rows: list[Row]) -> str:
    columns = [
        "B",
        "prompt",
        "response",
        "torch threads",
        "rlmetrics ms",
        "reference ms",
        "speed-up",
        "names checked",
    ]
    return report.table(
        columns,
        [
            [r.batch, r.prompt, r.response, r.threads, f"{r.ours_s * 1e3:.2f}", f"{r.ref_s * 1e3:.2f}",
             f"{r.ratio:.1f}x", r.checked]
            for r in rows
        ],
    )  # fmt: skip


def targets(rows: list[Row]) -> list[str]:
    b, p, r = TARGET_SHAPE
    cells = {row.threads: row for row in rows if (row.batch, row.prompt, row.response) == TARGET_SHAPE}
    cell = cells.get(DEFAULT_THREADS)
    if cell is None:
        return [f"target at B={b}, prompt {p}, response {r}: not measured in this run"]
    verdict = report.verdict(cell.ratio >= TARGET_RATIO)
    lines = [
        f"target >= {TARGET_RATIO:g}x the .item() reference at B={b}, prompt {p}, response {r} "
        f"(torch's default {DEFAULT_THREADS} threads): {cell.ratio:.1f}x — {verdict}"
    ]
    if 1 in cells and DEFAULT_THREADS != 1:
        lines.append(f"with one torch thread (no target, for comparison): {cells[1].ratio:.1f}x")
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    args = report.parse_args(__doc__, "fewer repetitions, one small shape", argv)

    start = time.perf_counter()
    shapes, reps = (QUICK_SHAPES, 5) if args.quick else (SHAPES, 15)
    head = report.header(
        "data-metrics", f"{torch.get_num_threads()} torch threads", f"torch {torch.__version__}"
    )
    print(head, flush=True)
    thread_counts = sorted({DEFAULT_THREADS, 1}, reverse=True)
    rows = [measure(b, p, r, reps, threads) for b, p, r in shapes for threads in thread_counts]
    hist_times = [measure_histograms(b, p, r, reps) for b, p, r in shapes]
    body = (
        f"{render(rows)}\n\ncompute_data_stats without histograms, with the default ones "
        f"({', '.join(DEFAULT_HISTOGRAMS)}) and with critic/advantages/hist too, 1 torch thread:\n\n"
        f"{render_histograms(list(shapes), hist_times)}"
    )
    notes = [
        f"best of 3 medians of {reps} calls (after a warm-up) per side, the sides alternating; CPU tensors",
        f"results asserted equal (rel 1e-5) on {sum(r.checked for r in rows[:: len(thread_counts)])} names",
        *targets(rows),
        f"total runtime: {time.perf_counter() - start:.1f} s",
    ]
    report.emit(head, body, notes, args.markdown)
    return rows


if __name__ == "__main__":
    main()
