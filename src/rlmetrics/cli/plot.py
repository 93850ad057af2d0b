"""``rlmetrics plot`` and ``rlmetrics compare``: PNG plots of a run's metrics over steps.

    rlmetrics plot runs/demo -m 'critic/score/*' -m 'response/length/mean' -o score.png
    rlmetrics compare runs/a runs/b -m 'val-core/*' -o val.png

One panel per metric matching a glob (``*`` matches across ``/``), one line per run; steps where a
metric was not logged (validation rounds) are skipped, so sparse metrics show as points.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlmetrics.cli.report import add_metric_option, last_value, load_run, matching, print_table
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


def run_label(path: str) -> str:
    """A short legend label for a run path: its folder name.

    >>> run_label("runs/baseline/metrics.jsonl"), run_label("runs/lr3e-6/")
    ('baseline', 'lr3e-6')
    """
    p = Path(path)
    return (p.parent if p.suffix == ".jsonl" else p).name or str(p)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "plot", help="plot metrics of a run to a PNG", description=__doc__, formatter_class=fmt
    )
    p.add_argument("run", help="a metrics.jsonl, or the folder holding one")
    _add_common(p, "plot.png")
    p.set_defaults(handler=_plot)
    c = sub.add_parser(
        "compare",
        help="plot metrics of two runs side by side; table of last values",
        description=__doc__,
        formatter_class=fmt,
    )
    c.add_argument("run_a", help="first run (metrics.jsonl or its folder)")
    c.add_argument("run_b", help="second run")
    _add_common(c, "compare.png")
    c.set_defaults(handler=_compare)


def _add_common(p: argparse.ArgumentParser, default_out: str) -> None:
    add_metric_option(p, "metrics", required=True)
    p.add_argument("-o", "--output", default=default_out, help=f"PNG file to write (default {default_out})")


def _plot(args: argparse.Namespace) -> int:
    out = plot_runs([(run_label(args.run), load_run(args.run))], args.metric, args.output, title=args.run)
    return _written(out, args)


def _compare(args: argparse.Namespace) -> int:
    runs = [(run_label(p), load_run(p)) for p in (args.run_a, args.run_b)]
    if runs[0][0] == runs[1][0]:
        runs = [(args.run_a, runs[0][1]), (args.run_b, runs[1][1])]
    out = plot_runs(runs, args.metric, args.output, title=f"{runs[0][0]} vs {runs[1][0]}")
    names = matching(sorted(set(runs[0][1].names()) | set(runs[1][1].names())), args.metric)
    rows = [(n, *(last_value(run.series(n)[1]) for _, run in runs)) for n in names]
    rows = [(n, a, b, b - a) for n, a, b in rows]
    print_table(rows, "last values", ["metric", runs[0][0], runs[1][0], "b - a"])
    return _written(out, args)


def _written(out: Path | None, args: argparse.Namespace) -> int:
    if out is None:
        raise SystemExit(f"rlmetrics: no metric matches {args.metric}")
    print(f"wrote {out}")
    return 0
