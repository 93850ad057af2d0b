"""rlmetrics report RUN: last, min, max and mean of every metric of a run, filtered by globs.

RUN is a metrics.jsonl (written by rlmetrics.sinks.JsonlSink) or the folder holding it.

    rlmetrics report runs/demo
    rlmetrics report runs/demo -m 'critic/*' -m 'val-core/*'
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

COLUMNS = ["metric", "last", "min", "max", "mean", "steps"]


def load_run(path: str | Path):
    """The :class:`~rlmetrics.sinks.JsonlRun` of a ``metrics.jsonl`` file or of a folder holding one."""
    from rlmetrics.sinks import read_jsonl

    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"rlmetrics: no metrics.jsonl at {path}")
    return read_jsonl(file)


def matching(names: Sequence[str], globs: Sequence[str]) -> list[str]:
    """The names matching any glob (all names without globs), in the order of ``names``.

    >>> matching(["critic/score/mean", "perf/throughput", "val-core/a/acc/mean@4"], ["critic/*", "val-*"])
    ['critic/score/mean', 'val-core/a/acc/mean@4']
    """
    return [n for n in names if not globs or any(fnmatch.fnmatchcase(n, g) for g in globs)]


def nearby(names: Sequence[str], glob: str) -> str:
    """What the user may have meant by a glob that matches none of ``names``: the glob of the names
    under it or holding it, with their number, else the closest name ('' when nothing is close).

    >>> names = ["critic/score/mean", "critic/score/max", "actor/entropy"]
    >>> nearby(names, "critic/score"), nearby(names, "entropy"), nearby(names, "actor/entropi")
    ("'critic/score/*' (2 metrics)", "'*entropy*' (1 metric)", "'actor/entropy'")
    """
    for wider in (glob.rstrip("/") + "/*", f"*{glob}*"):
        n = len(matching(names, [wider]))
        if n:
            return f"{wider!r} ({n} metric{'s' if n > 1 else ''})"
    return ", ".join(map(repr, difflib.get_close_matches(glob, names, n=1)))


def no_match(names: Sequence[str], globs: Sequence[str], where: str) -> str:
    """The error for globs that match none of a run's ``names``, with what they may have meant.

    >>> no_match(["critic/score/mean", "actor/entropy"], ["critic/score", "xyz"], "runs/a")
    "no metric matches 'critic/score', 'xyz' in runs/a; did you mean 'critic/score/*' (1 metric)?"
    """
    hints = [h for h in (nearby(names, g) for g in globs) if h]
    did_you_mean = f"; did you mean {', '.join(hints)}?" if hints else f" ({len(names)} metrics)"
    return f"no metric matches {', '.join(map(repr, globs))} in {where}{did_you_mean}"


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
    """Print rows as one rich table (floats to 4 significant digits), grouped by the first segment of
    the metric name; at least 110 columns wide, so that names are not folded in a pipe or a log."""
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
                   help=f"{what} matching GLOB (repeatable; * matches across '/')")  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    run = load_run(args.run)
    rows = summarize(run, args.metric)
    if not rows:
        problem = no_match(run.names(), args.metric, args.run) if args.metric else f"no metric in {args.run}"
        raise SystemExit(f"rlmetrics report: {problem}")
    print_table(rows, f"{args.run}: {len(run.steps)} steps")
    return 0
