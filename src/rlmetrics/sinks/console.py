r"""Rich tables on the terminal: one per logged step, rows grouped by the first path segment.

>>> import io
>>> out = io.StringIO()
>>> with ConsoleSink(file=out) as sink:
...     sink.log({"critic/score/mean": 0.123456, "perf/throughput": 12345.6, "critic/score/max": 1.0}, 7)
>>> print("\n".join(line.rstrip() for line in out.getvalue().strip("\n").splitlines()))
             step 7
┏━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━┓
┃ metric            ┃     value ┃
┡━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━┩
│ critic/score/max  │         1 │
│ critic/score/mean │    0.1235 │
├───────────────────┼───────────┤
│ perf/throughput   │ 1.235e+04 │
└───────────────────┴───────────┘
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.base import Row, Sink
from rlmetrics.sinks.names import as_floats


def format_value(value: float) -> str:
    """4 significant digits, compact: ``0.1235``, ``1.235e+04``, ``3``, ``nan``, ``-inf``.

    >>> [format_value(v) for v in (0.123456, 12345.6, 3.0, float("nan"), float("-inf"), 1e-7)]
    ['0.1235', '1.235e+04', '3', 'nan', '-inf', '1e-07']
    """
    if math.isnan(value):
        return "nan"
    return f"{value:.4g}"


def prefix(name: str) -> str:
    """The group of a metric: its first path segment (``critic/score/mean`` → ``critic``)."""
    return name.split("/", 1)[0] if "/" in name else ""


def summary_table(
    rows: Sequence[Sequence[Any]],
    columns: Sequence[str],
    title: str | None = None,
    max_rows: int | None = None,
):
    """A rich Table of ``rows``, a section per prefix of the first column; past ``max_rows``, ``… N more``."""
    rich_table = require("rich.table", "console")
    text = require("rich.text", "console")
    table = rich_table.Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", overflow="fold")
    groups: dict[str, list[Sequence[Any]]] = {}
    for row in rows:
        groups.setdefault(prefix(str(row[0])), []).append(row)
    ordered = [row for group in groups.values() for row in group]
    shown = ordered if max_rows is None else ordered[:max_rows]
    for i, row in enumerate(shown):
        last_of_group = i + 1 < len(shown) and prefix(str(shown[i + 1][0])) != prefix(str(row[0]))
        table.add_row(*(text.Text(str(cell)) for cell in row), end_section=last_of_group)
    if len(shown) < len(ordered):
        table.add_row(text.Text(f"… {len(ordered) - len(shown)} more"), *[""] * (len(columns) - 1))
    return table


def render_table(metrics: Mapping[str, float], title: str | None = None, max_rows: int | None = None):
    """``{name: value}`` as a two-column table, names sorted and grouped by prefix."""
    values = as_floats(metrics)
    rows = [(name, format_value(values[name])) for name in sorted(values)]
    return summary_table(rows, ["metric", "value"], title, max_rows)


class ConsoleSink(Sink):
    """Print a table every ``every`` steps (steps divisible by ``every``) to ``file`` (stdout)."""

    tracker = "console"  # names as they are: plain text, rich markup is not interpreted
    overview_copies = False  # each key once on the screen

    @classmethod
    def in_folder(cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str) -> ConsoleSink:
        return cls()

    def __init__(self, every: int = 1, file: IO[str] | None = None, max_rows: int | None = None) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self.max_rows = max_rows
        self.console = require("rich.console", "console").Console(file=file)
        self._text = require("rich.text", "console")
        self._alerts: list = []  # lines of the alerts of the step being logged

    def write(self, row: Row) -> None:
        alerts, self._alerts = self._alerts, []
        if row.step % self.every == 0:
            table = render_table(row.scalars, f"step {row.step}", self.max_rows)
            if row.meta is not None and not row.meta.complete:
                table.caption = f"partial step: missing ranks {row.meta.missing_ranks}"
            self.console.print(table)
            for name, text in row.texts.items():  # the slowest ranks of a stage: one line each
                self.console.print(self._text.Text(f"{name}: {text}"), soft_wrap=True)
        for line in alerts:
            self.console.print(line, soft_wrap=True)

    def alert(self, alert: Alert) -> None:
        """One line per alert, after its step's table, whatever ``every`` is."""
        style = "bold red" if alert.level == "error" else "yellow"
        self._alerts.append(self._text.Text(str(alert), style=style))

    def finish(self) -> None:
        self.console.file.flush()

    def __repr__(self) -> str:
        return f"ConsoleSink(every={self.every})"
