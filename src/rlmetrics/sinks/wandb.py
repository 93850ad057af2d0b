"""Weights & Biases, offline by default: the run is written under ``<dir>/wandb/offline-run-*``."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.messages import DEFAULT_AXIS as _TRAIN_STEP
from rlmetrics.sinks.base import Row, RunSink, resume_id
from rlmetrics.sinks.compat import wandb_last_record
from rlmetrics.sinks.jsonl import run_config
from rlmetrics.sinks.names import path_safe

logger = logging.getLogger(__name__)

WANDB_MAX_BINS = 512
"""The most bins a ``wandb.Histogram`` takes (its ``MAX_LENGTH``; 64 is W&B's default)."""


def merge_bins(counts: Any, edges: Any, limit: int = WANDB_MAX_BINS) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` of at most ``limit`` bins, each ``ceil(bins / limit)`` adjacent bins merged.

    >>> counts, edges = merge_bins([1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], limit=2)
    >>> counts.tolist(), edges.tolist()
    ([6.0, 9.0], [0.0, 3.0, 5.0])
    >>> [a.size for a in merge_bins(np.ones(1000), np.arange(1001.0))]
    [500, 501]
    """
    counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
    if counts.size <= limit:
        return counts, edges
    group = -(-counts.size // limit)
    starts = np.arange(0, counts.size, group)
    return np.add.reduceat(counts, starts), np.append(edges[starts], edges[-1])


class WandbSink(RunSink):
    """Log each step with ``run.log(metrics, step=step)``; ``close()`` finishes the run."""

    tracker = "wandb"
    background = True  # written from its own thread (Tracking)
    case_insensitive_names = True  # W&B's metric names are

    @staticmethod
    def map_name(name: str) -> str:
        """Path-safe; a leading ``_`` becomes ``metric_`` (``_step``, ``_runtime``: W&B's own keys).

        >>> WandbSink.adapt_name("_step"), WandbSink.adapt_name("/abs/x"), WandbSink.adapt_name("pass@k")
        ('metric_step', 'abs/x', 'pass@k')
        """
        name = path_safe(name)
        return "metric" + name if name.startswith("_") else name

    folder_files = ("wandb",)
    takes_config = catches_up = rebuilds = True

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, **options: Any
    ) -> WandbSink:
        mode = os.environ.get("WANDB_MODE") or "offline"  # W&B's own variable: online where users set it
        return cls(project, run_name, dir=out_dir, mode=mode, resume=resume_id(resume), **options)

    def __init__(
        self,
        project: str = "rlmetrics",
        name: str | None = None,
        dir: str | os.PathLike | None = None,
        mode: str = "offline",
        close_timeout: float = 30.0,
        resume: str | None = None,
        axes: bool = False,
        config: Any = None,
        **init_kwargs: Any,
    ) -> None:
        config = run_config(config)
        wandb = require("wandb", "trackers")
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
            dir = str(dir)
        init_kwargs.setdefault(
            "settings",
            wandb.Settings(
                console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False
            ),
        )
        init_kwargs.setdefault("reinit", "create_new")
        if resume:
            init_kwargs.update(id=resume, resume="allow")
        self._Histogram = wandb.Histogram
        self.project, self.mode, self.close_timeout = project, mode, close_timeout
        self.axes = axes
        self._defined: set[str] = set()  # axes: names declared with their step metric
        init_kwargs.update(project=project, name=name, dir=dir, mode=mode, config=config)
        super().__init__(wandb.init(**init_kwargs))
        # resumed online: W&B's step and summary of the run; offline nothing (its API reads no offline run)
        self._row = self.run.step if resume else 0  # axes: the next W&B step
        if resume and self.run.step:
            last = self.run.summary.get(_TRAIN_STEP) if axes else self.run.step - 1
            self.resumed_at = None if last is None else int(last)

    @property
    def takes_axes(self) -> bool:
        return self.axes

    def earlier_sessions(self) -> list[Path]:
        if self.mode != "offline":  # online, W&B holds the run
            return []
        here = Path(self.run.settings.sync_dir)
        session = re.compile(rf"offline-run-.*-{re.escape(self.run.id)}(-\d+)?")  # -<n>: the same second
        return [d for d in here.parent.iterdir() if session.fullmatch(d.name) and d != here]

    def write(self, row: Row) -> None:
        if row.axis is not None and not self.axes:
            raise ValueError(f"{self!r} logs steps of axes when created with axes=True")
        if self.axes:
            self._write_row(self.values(row), row.axis or _TRAIN_STEP, row.step)
        else:
            super().write(row)

    def _write_row(self, values: dict[str, Any], axis: str, step: int) -> None:
        """One W&B step: ``values`` and ``axis = step``, each new name declared with ``step_metric=axis``."""
        if axis not in self._defined:
            self._defined.add(axis)
            self.run.define_metric(axis)
        for name in values:
            if name not in self._defined:
                self._defined.add(name)
                self.run.define_metric(name, step_metric=axis)
        self.run.log({**values, axis: step}, step=self._row)
        self._row += 1

    def media(self, histogram: Any) -> Any:
        return self._Histogram(np_histogram=merge_bins(histogram.counts, histogram.edges))

    def alert_key(self, alert: Alert) -> Any:
        return str(alert)

    def write_alert(self, alert: Alert) -> None:
        level = "ERROR" if alert.level == "error" else "WARN"
        title = f"{alert.rule}: {alert.metric}" if alert.metric else alert.rule
        self.run.alert(title=title[:63], text=str(alert), level=level)
        mark = {self.names(f"alert/{alert.rule}"): 1.0}
        if self.axes:
            self._write_row(mark, _TRAIN_STEP, alert.step)
        else:
            self.run.log(mark, step=alert.step)

    def finish(self) -> None:
        run_file = Path(self.run.settings.sync_file)
        self.run.finish()
        if self.mode != "disabled":
            self._wait_written(run_file)

    def _wait_written(self, run_file: Path) -> None:
        deadline = time.monotonic() + self.close_timeout
        while True:
            try:
                if wandb_last_record(run_file) == "exit":
                    return
            except ValueError:
                logger.warning("W&B run file %s: a format rlmetrics does not read; not waited for", run_file)
                return
            if time.monotonic() > deadline:
                logger.warning("W&B run file %s incomplete %.0f s after finish", run_file, self.close_timeout)
                return
            time.sleep(0.02)

    def __repr__(self) -> str:
        return f"WandbSink(project={self.project!r}, id={getattr(self.run, 'id', None)!r})"
