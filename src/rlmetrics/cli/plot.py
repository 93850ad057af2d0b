"""rlmetrics plot RUN: PNG plots of a run's metrics over steps (of two runs: rlmetrics compare).

    rlmetrics plot runs/demo -m 'critic/score/*' -m 'response/length/mean' -o score.png
    rlmetrics plot runs/demo --hist response/length/hist -o lengths.png

One panel per metric matching a glob (* matches across /); steps where a metric was not logged
(validation rounds) are skipped, so sparse metrics show as points. --hist NAME (repeatable) draws a
histogram of the run (logged in metrics.jsonl) as a heat map over steps instead: one column per
step, the counts of its bins (re-binned onto one value axis for all steps, as each step has its own
edges) on a log colour scale.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlmetrics.cli.report import add_metric_option, last_value, load_run, matching, no_match, print_table
from rlmetrics.extras import require

MAX_PANELS = 24


def plot_runs(
    runs: Sequence[tuple[str, object]], globs: Sequence[str], out: str | Path, title: str = ""
) -> Path | None:
    """Plot the metrics matching ``globs`` of ``(label, JsonlRun)`` pairs into one PNG at ``out``.

    Returns the path, or None when no metric matches (nothing is written). At most
    :data:`MAX_PANELS` panels; further matches are left out with a note in the title.
    """
    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    for _, run in runs:
        names += [n for n in matching(run.names(), globs) if n not in names]
    if not names:
        return None
    shown = names[:MAX_PANELS]
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False, layout="constrained"
    )
    for ax, name in zip(axes.flat, shown):
        for label, run in runs:
            steps, values = run.series(name)
            keep = ~np.isnan(values)
            if keep.any():
                ax.plot(steps[keep], values[keep], marker="o" if keep.sum() < 20 else None, ms=3, label=label)
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=7)
    more = f" (first {MAX_PANELS} of {len(names)} metrics)" if len(names) > MAX_PANELS else ""
    fig.suptitle(title + more, fontsize=10)
    fig.supxlabel("step", fontsize=8)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


HEAT_ROWS = 100
"""Rows of a histogram heat map (the value axis)."""


def plot_histograms(run: object, names: Sequence[str], out: str | Path, title: str = "") -> Path | None:
    """Heat maps over steps of the histograms ``names`` of a JsonlRun into one PNG at ``out``
    (one panel per name that the run has); None when it has none of them."""
    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.colors
    import matplotlib.pyplot as plt

    found = [(n, *run.histograms(n)) for n in names]
    found = [(n, steps, hists) for n, steps, hists in found if len(steps)]
    if not found:
        return None
    fig, axes = plt.subplots(
        len(found), 1, figsize=(7, 2.8 * len(found)), squeeze=False, layout="constrained"
    )
    for ax, (name, steps, hists) in zip(axes.flat, found):
        lo = min(h.edges[0] for h in hists)
        hi = max(h.edges[-1] for h in hists)
        rows = np.histogram_bin_edges([lo, hi], HEAT_ROWS)
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
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_label(path: str) -> str:
    """A short legend label for a run path: its folder name.

    >>> run_label("runs/baseline/metrics.jsonl"), run_label("runs/lr3e-6/")
    ('baseline', 'lr3e-6')
    """
    p = Path(path)
    return (p.parent if p.suffix == ".jsonl" else p).name or str(p)


COMPARE = """rlmetrics compare RUN_A RUN_B: the metrics of two runs side by side.

    rlmetrics compare runs/a runs/b -m 'val-core/*' -o val.png

One panel per metric matching a glob (* matches across /), one line per run, in one PNG; and a
table of each metric's last value in both runs and their difference (b - a).
"""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot metrics of a run to a PNG", description=__doc__)
    p.add_argument("run", help="a metrics.jsonl, or the folder holding one")
    _add_common(p, "plot.png", required=False)
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


def _add_common(p: argparse.ArgumentParser, default_out: str, required: bool = True) -> None:
    add_metric_option(p, "metrics", required=required)
    p.add_argument("-o", "--output", default=default_out, help="PNG file to write")


def _plot(args: argparse.Namespace) -> int:
    if args.hist:
        out = plot_histograms(load_run(args.run), args.hist, args.output, title=args.run)
        if out is None:
            raise SystemExit(f"rlmetrics: no histogram {args.hist} in {args.run}")
        print(f"wrote {out}")
        return 0
    if not args.metric:
        raise SystemExit("rlmetrics plot: give -m GLOB (metrics) or --hist NAME (histograms)")
    run = load_run(args.run)
    out = plot_runs([(run_label(args.run), run)], args.metric, args.output, title=args.run)
    return _written(out, args, run.names(), args.run)


def _compare(args: argparse.Namespace) -> int:
    runs = [(run_label(p), load_run(p)) for p in (args.run_a, args.run_b)]
    if runs[0][0] == runs[1][0]:
        runs = [(args.run_a, runs[0][1]), (args.run_b, runs[1][1])]
    out = plot_runs(runs, args.metric, args.output, title=f"{runs[0][0]} vs {runs[1][0]}")
    every = sorted(set(runs[0][1].names()) | set(runs[1][1].names()))
    names = matching(every, args.metric)
    rows = [(n, *(last_value(run.series(n)[1]) for _, run in runs)) for n in names]
    rows = [(n, a, b, b - a) for n, a, b in rows]
    print_table(rows, "last values", ["metric", runs[0][0], runs[1][0], "b - a"])
    return _written(out, args, every, f"{args.run_a} or {args.run_b}")


def _written(out: Path | None, args: argparse.Namespace, names: Sequence[str], where: str) -> int:
    if out is None:
        raise SystemExit(f"rlmetrics {args.command}: {no_match(names, args.metric, where)}")
    print(f"wrote {out}")
    return 0
