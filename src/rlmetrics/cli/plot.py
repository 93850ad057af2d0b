"""rlmetrics plot RUN: PNG plots of a run's metrics over steps (of two runs: rlmetrics compare).

    rlmetrics plot runs/demo -m 'critic/score/*' -m 'response/length/mean' -o runs/demo/score.png
    rlmetrics plot runs/demo --hist response/length/hist -o runs/demo/lengths.png

One panel per metric matching a -m glob (* matches any characters, / too; without -m, the core
metrics: score, reward, response length, KL, entropy, grad norm, throughput, validation). A line
breaks where its metric skips more steps than its usual stride; a point without a neighbour is a
marker; a metric with one value over the run is named under the panels, not plotted. --hist NAME
(repeatable) draws a logged histogram as a heat map over steps instead: a column per step, its bin
counts (one row per integer for integer data) on a log colour scale.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlmetrics.cli.report import add_metric_option, check_globs, last_value, load_run, print_table
from rlmetrics.extras import require
from rlmetrics.globs import compile_globs, matching
from rlmetrics.sinks.console import format_value

MAX_PANELS = 24
MAX_CONSTANTS = 20
"""Constant metrics named under the panels; further ones are counted."""
UNITS = (
    ("*clip_ratio*", "share"),
    ("*delta_time/*", "s"),
    ("timing_s/*", "s"),
    ("timing_per_token_ms/*", "ms"),
    ("*throughput*", "tokens/s"),
    ("*length/*", "tokens"),
    ("*num_tokens*", "tokens"),
    ("*_gb", "GB"),
)
"""``(glob, unit)``, first match: the y label of a metric's panel (without a match, its name)."""


def unit(name: str) -> str:
    """The y label of metric ``name``: its unit, else the name.

    >>> unit("perf/delta_time/step"), unit("response/length/mean"), unit("actor/kl_loss")
    ('s', 'tokens', 'actor/kl_loss')
    """
    return next((u for glob, u in UNITS if compile_globs([glob]).fullmatch(name)), name)


def plot_runs(
    runs: Sequence[tuple[str, object]], globs: Sequence[str], out: str | Path, title: str = ""
) -> Path | None:
    """Plot the metrics matching ``globs`` of ``(label, JsonlRun)`` pairs to ``out`` (a PNG); None if none."""
    return _save(runs_figure(runs, globs, title), out)


def runs_figure(runs: Sequence[tuple[str, object]], globs: Sequence[str], title: str = "") -> Any:
    """The matplotlib Figure of :func:`plot_runs` (None when no metric matches)."""
    require("matplotlib", "plot")
    from matplotlib.figure import Figure

    names: list[str] = []
    for _, run in runs:
        names += [n for n in matching(run.names(), globs) if n not in names]
    if not names:
        return None
    series = {n: [(label, *run.series(n)) for label, run in runs] for n in names}
    constant = {n: v for n in names if (v := _constant(series[n])) is not None}
    varying = [n for n in names if n not in constant]
    shown = varying[:MAX_PANELS]
    cols = max(1, min(3, len(shown)))
    rows = max(1, math.ceil(len(shown) / cols))
    fig = Figure(figsize=(4.2 * cols, 2.8 * rows), layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, name in zip(axes, shown):
        for label, steps, values in series[name]:
            x, y, isolated = _line(steps, values)
            if len(x):
                few = len(x) - np.isnan(x).sum() < 20
                ax.plot(x, y, marker="o", ms=3, markevery=(isolated | few).tolist(), label=label)
        ax.set_title(name, fontsize=8)
        ax.set_ylabel(unit(name), fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(shown) :]:
        ax.set_axis_off()
    if len(runs) > 1 and shown:
        axes[0].legend(fontsize=7)
    more = f" (first {MAX_PANELS} of {len(varying)} metrics)" if len(varying) > MAX_PANELS else ""
    fig.suptitle(title + more, fontsize=10)
    notes = [f"{n} = {format_value(v)}" for n, v in constant.items()]
    if len(notes) > MAX_CONSTANTS:
        notes[MAX_CONSTANTS - 1 :] = [f"and {len(notes) - MAX_CONSTANTS + 1} more"]
    note = textwrap.fill("one value over the run: " + "; ".join(notes), 45 * cols) if notes else ""
    fig.supxlabel("step" + (f"\n\n{note}" if note else ""), fontsize=8)
    return fig


def _constant(series: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> float | None:
    """The one value every run logged for a metric (NaN: none logged a number), None if it varies."""
    values = np.unique(np.concatenate([v[~np.isnan(v)] for _, _, v in series]))
    return None if len(values) > 1 else float(values[0]) if len(values) else math.nan


def _line(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A series' points with a NaN where it skips more than its smallest stride, and which are isolated.

    >>> x, y, isolated = _line(np.arange(6), np.array([1.0, 2.0, np.nan, 3.0, np.nan, 4.0]))
    >>> x.tolist(), isolated.tolist()
    ([0.0, 1.0, nan, 3.0, nan, 5.0], [False, False, False, True, False, True])
    """
    keep = ~np.isnan(values)
    x, y = steps[keep].astype(float), values[keep]
    stride = np.diff(x)
    gaps = np.flatnonzero(stride > stride.min()) + 1 if len(stride) else []
    x, y = np.insert(x, gaps, np.nan), np.insert(y, gaps, np.nan)
    gap = np.isnan(x)
    isolated = ~gap & np.r_[True, gap[:-1]] & np.r_[gap[1:], True]
    return x, y, isolated


HEAT_ROWS = 100
"""Rows of a histogram heat map (the value axis) at most."""


def plot_histograms(run: object, names: Sequence[str], out: str | Path, title: str = "") -> Path | None:
    """Heat maps over steps of the histograms ``names`` of a JsonlRun to ``out`` (a PNG); None if none."""
    return _save(histograms_figure(run, names, title), out)


def histograms_figure(run: object, names: Sequence[str], title: str = "") -> Any:
    """The matplotlib Figure of :func:`plot_histograms` (None when the run has none of ``names``)."""
    require("matplotlib", "plot")
    import matplotlib.colors
    from matplotlib.figure import Figure

    found = [(n, *run.histograms(n)) for n in names]
    found = [(n, steps, hists) for n, steps, hists in found if len(steps)]
    if not found:
        return None
    fig = Figure(figsize=(7, 2.8 * len(found)), layout="constrained")
    for ax, (name, steps, hists) in zip(fig.subplots(len(found), 1, squeeze=False).flat, found):
        lo = min(h.edges[0] for h in hists)
        hi = max(h.edges[-1] for h in hists)
        if all(map(_integer_valued, hists)):
            rows = np.arange(math.ceil(lo), math.floor(hi) + 2) - 0.5
        else:
            widest = max(np.diff(h.edges).max() for h in hists)
            rows = np.histogram_bin_edges([lo, hi], max(1, min(HEAT_ROWS, math.floor((hi - lo) / widest))))
        grid = np.array(
            [np.histogram((h.edges[:-1] + h.edges[1:]) / 2, rows, weights=h.counts)[0] for h in hists]
        ).T
        x = np.append(steps, steps[-1] + 1) - 0.5
        mesh = ax.pcolormesh(
            x, rows, np.ma.masked_equal(grid, 0), norm=matplotlib.colors.LogNorm(), cmap="viridis"
        )
        fig.colorbar(mesh, ax=ax, label="count")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(unit(name), fontsize=7)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def _integer_valued(hist: Any) -> bool:
    """Every bin of ``hist`` is narrower than 1 and each non-empty one holds an integer.

    >>> from rlmetrics.core.histogram import Histogram
    >>> edges = np.linspace(1, 3, 5)  # [1, 1.5), [1.5, 2), [2, 2.5), [2.5, 3]
    >>> _integer_valued(Histogram(edges, np.array([4.0, 0, 2, 1])))  # values 1, 2, 3
    True
    >>> _integer_valued(Histogram(edges, np.ones(4)))  # [1.5, 2) holds no integer
    False
    """
    left, right = hist.edges[:-1], hist.edges[1:]
    first = np.ceil(left)
    holds = (first < right) | ((first == right) & (np.arange(len(left)) == len(left) - 1))
    return bool(np.all(right - left < 1) and np.all(holds[hist.counts > 0]))


def _save(fig: Any, out: str | Path) -> Path | None:
    if fig is None:
        return None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def run_label(path: str) -> str:
    """A short legend label for a run path: its folder name.

    >>> run_label("runs/baseline/metrics.jsonl"), run_label("runs/lr3e-6/")
    ('baseline', 'lr3e-6')
    """
    p = Path(path)
    return (p.parent if p.suffix == ".jsonl" else p).name or str(p)


COMPARE = """rlmetrics compare RUN_A RUN_B: the metrics of two runs side by side.

    rlmetrics compare runs/a runs/b -m 'val-core/*' -o runs/val.png

One panel per metric matching a -m glob (* matches any characters, / too; without -m, the core
metrics), one line per run, in one PNG; and a
table of each metric's last value in both runs and their difference (b - a).
"""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot metrics of a run to a PNG", description=__doc__)
    p.add_argument("run", help="a metrics.jsonl, or the folder holding one")
    _add_common(p, "plot.png")
    p.add_argument("--hist", action="append", default=[], metavar="NAME",
                   help="heat map over steps of histogram NAME (repeatable), not -m's metrics")  # fmt: skip
    p.set_defaults(handler=_plot)
    c = sub.add_parser(
        "compare", help="plot metrics of two runs side by side; table of last values", description=COMPARE
    )
    c.add_argument("run_a", help="first run (metrics.jsonl or its folder)")
    c.add_argument("run_b", help="second run")
    _add_common(c, "compare.png")
    c.set_defaults(handler=_compare)


def _add_common(p: argparse.ArgumentParser, default_out: str) -> None:
    add_metric_option(p, "metrics (default: the core metrics, CORE_KEYS)", required=False)
    p.add_argument("-o", "--output", default=default_out, help="PNG file to write")


def _plot(args: argparse.Namespace) -> int:
    if args.hist:
        out = plot_histograms(load_run(args.run), args.hist, args.output, title=args.run)
        if out is None:
            raise SystemExit(f"rlmetrics: no histogram {args.hist} in {args.run}")
        print(f"wrote {out}")
        return 0
    run = load_run(args.run)
    globs = _globs(args, run.names(), args.run)
    out = plot_runs([(run_label(args.run), run)], globs, args.output, title=args.run)
    print(f"wrote {out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    runs = [(run_label(p), load_run(p)) for p in (args.run_a, args.run_b)]
    if runs[0][0] == runs[1][0]:
        runs = [(args.run_a, runs[0][1]), (args.run_b, runs[1][1])]
    every = sorted(set(runs[0][1].names()) | set(runs[1][1].names()))
    where = f"{args.run_a} or {args.run_b}"
    globs = _globs(args, every, where)
    out = plot_runs(runs, globs, args.output, title=f"{runs[0][0]} vs {runs[1][0]}")
    names = matching(every, globs)
    rows = [(n, *(last_value(run.series(n)[1]) for _, run in runs)) for n in names]
    rows = [(n, a, b, b - a) for n, a, b in rows]
    if rows:
        print_table(rows, "last values", ["metric", runs[0][0], runs[1][0], "b - a"])
    print(f"wrote {out}")
    return 0


def _globs(args: argparse.Namespace, names: Sequence[str], where: str) -> Sequence[str]:
    """The -m globs, each checked against ``names`` (:func:`check_globs`), or the core metrics."""
    from rlmetrics.sinks.keys import CORE_KEYS

    if args.metric:
        check_globs(names, args.metric, where, args.command)
        return args.metric
    if not matching(names, CORE_KEYS):
        raise SystemExit(
            f"rlmetrics {args.command}: no core metric (CORE_KEYS: {', '.join(CORE_KEYS)}) in {where}; "
            f"give -m GLOB (`rlmetrics report` lists its {len(names)} metrics)"
        )
    return CORE_KEYS
