"""rlmetrics report RUN: last, min, max and mean of every metric of a run, filtered by globs.

RUN is a metrics.jsonl (written by rlmetrics.sinks.JsonlSink) or the folder holding it.

    rlmetrics report runs/demo
    rlmetrics report runs/demo -m 'critic/*' -m 'val-core/*'
"""

from __future__ import annotations

import argparse
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlmetrics.globs import did_you_mean, matching, unmatched

COLUMNS = ["metric", "last", "min", "max", "mean", "steps"]


def load_run(path: str | Path):
    """The :class:`~rlmetrics.sinks.JsonlRun` of a ``metrics.jsonl`` file or of a folder holding one."""
    from rlmetrics.sinks import read_jsonl

    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"rlmetrics: no metrics.jsonl at {path}")
    return read_jsonl(file)


def no_match(names: Sequence[str], globs: Sequence[str], where: str) -> str:
    """The error for globs that match none of a run's ``names``, with what they may have meant.

    >>> no_match(["critic/score/mean", "actor/entropy"], ["critic/score", "xyz"], "runs/a")
    "no metric matches 'critic/score', 'xyz' in runs/a; did you mean 'critic/score/*' (1 metric)?"
    """
    hint = did_you_mean(names, globs) or f" ({len(names)} metrics)"
    return f"no metric matches {', '.join(map(repr, globs))} in {where}{hint}"


def check_globs(names: Sequence[str], globs: Sequence[str], where: str, command: str) -> None:
    """SystemExit naming each glob that matches none of ``names``, with what it may have meant."""
    missed = unmatched(names, globs)
    if missed:
        raise SystemExit(f"rlmetrics {command}: {no_match(names, missed, where)}")


def last_value(values: np.ndarray) -> float:
    """The last logged value of a series (NaN where a step lacks the metric; a logged NaN counts).

    >>> last_value(np.array([1.0, 2.0, np.nan])), last_value(np.array([np.nan]))
    (2.0, nan)
    """
    logged = values[~np.isnan(values)]
    return float(logged[-1]) if len(logged) else math.nan


def summarize(run, globs: Sequence[str] = ()) -> list[tuple[str, float, float, float, float, int]]:
    """One row per matching metric: (name, last, min, max, mean, number of steps with a finite value)."""
    rows = []
    for name in matching(run.names(), globs):
        values = run.series(name)[1]
        finite = values[np.isfinite(values)]
        if len(finite):
            rows.append((name, last_value(values), finite.min(), finite.max(), finite.mean(), len(finite)))
        else:
            rows.append((name, last_value(values), math.nan, math.nan, math.nan, 0))
    return [(name, *map(float, stats), n) for name, *stats, n in rows]


def print_table(rows: Sequence[tuple], title: str, columns: Sequence[str] = COLUMNS) -> None:
    """Print rows as one rich table grouped by the names' first segment, at least 110 columns wide."""
    from rich.console import Console

    from rlmetrics.sinks.console import format_value, summary_table

    cells = [tuple(format_value(c) if isinstance(c, float) else c for c in row) for row in rows]
    width = max(shutil.get_terminal_size().columns, 110)
    Console(width=width).print(summary_table(cells, list(columns), title))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="table of last/min/max/mean per metric of a run", description=__doc__)
    p.add_argument("run", help="a metrics.jsonl, or the folder holding one (e.g. runs/demo)")
    add_metric_option(p, "only metrics", required=False)
    p.set_defaults(handler=_run)


def add_metric_option(p: argparse.ArgumentParser, what: str, required: bool) -> None:
    """``-m/--metric GLOB``, repeatable."""
    p.add_argument("-m", "--metric", action="append", default=[], metavar="GLOB", required=required,
                   help=f"{what} matching GLOB (repeatable; * matches any characters, '/' too)")  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    run = load_run(args.run)
    check_globs(run.names(), args.metric, args.run, "report")
    rows = summarize(run, args.metric)
    if not rows:
        raise SystemExit(f"rlmetrics report: no metric in {args.run}")
    print_table(rows, f"{args.run}: {len(run.steps)} steps")
    return 0
