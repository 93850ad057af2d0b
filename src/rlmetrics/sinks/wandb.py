"""Weights & Biases, offline by default: the run is written under ``<dir>/wandb/offline-run-*``.

Needs the ``trackers`` extra. Upload later with ``wandb sync <dir>/wandb/offline-run-*``. A step is
one ``run.log`` (a histogram of more than 512 bins merged by :func:`merge_bins`); an alert is
``run.alert`` and ``alert/<rule> = 1``; ``axes=True`` plots each metric against its step axis.
``resume=<run id>`` reads the earlier sessions' run files back and skips the steps they hold;
``close()`` returns once the run file is complete. docs/trackers.md, "Sinks" and "Each tracker".
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.messages import DEFAULT_AXIS as _TRAIN_STEP
from rlmetrics.sinks.base import Row, RunSink, resume_id
from rlmetrics.sinks.compat import wandb_records
from rlmetrics.sinks.jsonl import run_config
from rlmetrics.sinks.names import as_floats, as_step, axis_names, path_safe

logger = logging.getLogger(__name__)

WANDB_MAX_BINS = 512
"""The most bins a ``wandb.Histogram`` takes (its ``MAX_LENGTH``; 64 is W&B's default)."""


def merge_bins(counts: Any, edges: Any, limit: int = WANDB_MAX_BINS) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` of at most ``limit`` bins: a histogram of more is re-binned exactly, each
    ``ceil(bins / limit)`` adjacent bins merged into one (their counts summed, their outer edges kept;
    the last group may be smaller), so every count stays in the range it was in and the total is
    unchanged. Fewer bins are returned as they are.

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


def _logged(key: str) -> bool:
    """``key`` of a history row is a metric this sink logged (not W&B's own, not an alert's)."""
    return not key.startswith(("_", "alert/"))


def _step_metrics(keys: Iterable[str]) -> set[str]:
    """The step metrics a row of an ``axes=True`` run may hold: ``train_step`` and the ``a`` of its
    ``a/...`` names."""
    return {_TRAIN_STEP} | {k.split("/", 1)[0] for k in keys if "/" in k}


class WandbSink(RunSink):
    """Log each step with ``run.log(metrics, step=step)``; ``close()`` finishes the run."""

    tracker = "wandb"
    background = True  # written from its own thread (Tracking)
    case_insensitive_names = True  # W&B's metric names are

    @staticmethod
    def map_name(name: str) -> str:
        """Path-safe (:func:`~rlmetrics.sinks.names.path_safe`); a leading ``_`` becomes ``metric_``
        (``_step``, ``_runtime`` and ``_timestamp`` are W&B's own keys).

        >>> WandbSink.adapt_name("_step"), WandbSink.adapt_name("/abs/x"), WandbSink.adapt_name("pass@k")
        ('metric_step', 'abs/x', 'pass@k')
        """
        name = path_safe(name)
        return "metric" + name if name.startswith("_") else name

    folder_files = ("wandb",)
    takes_config = catches_up = True

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, **options: Any
    ) -> WandbSink:
        return cls(project, run_name, dir=out_dir, mode="offline", resume=resume_id(resume), **options)

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
        self._row = 0  # axes: the next W&B step
        self._marks: dict[str, float] = {}  # axes: the last value of each step metric, when resumed
        self._defined: set[str] = set()  # axes: names declared with their step metric
        init_kwargs.update(project=project, name=name, dir=dir, mode=mode, config=config)
        super().__init__(wandb.init(**init_kwargs))
        if resume:
            try:
                self._read_back()
            except Exception:  # a run file it cannot read: the session just begun is taken back
                self._take_back()
                raise

    def _take_back(self) -> None:
        """Finish this session and remove its folder, and W&B's links into it (``latest-run``, the
        debug logs), so nothing of it is left for ``wandb sync``."""
        session = Path(self.run.settings.sync_dir)
        self.finish()
        shutil.rmtree(session, ignore_errors=True)
        for link in session.parent.iterdir():
            if link.is_symlink() and not link.exists():
                link.unlink()

    def _read_back(self) -> None:
        """The last step and the alerts of this run in the run files of its earlier sessions (online,
        the step W&B resumed it at)."""
        run_file = Path(self.run.settings.sync_file)
        session = re.compile(rf".*-{re.escape(self.run.id)}(-\d+)?")  # -<n>: a start in the same second
        files = [
            f
            for f in run_file.parent.parent.glob(f"*-{self.run.id}*/{run_file.name}")
            if session.fullmatch(f.parent.name) and f != run_file
        ]
        steps = [self.run.step - 1] if self.run.step else []
        rows = list(steps)
        self._alerted = set()
        for path in files:
            records, bad = wandb_records(path)
            if bad is not None:
                logger.warning("W&B run file %s: the record at byte %d is damaged; read up to it", path, bad)
            for record in records:
                kind = record.WhichOneof("record_type")
                if kind == "history":
                    keys = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                    rows.append(record.history.step.num)
                    for key in set(keys) & _step_metrics(keys) if self.axes else ():
                        self._marks[key] = max(float(keys[key]), self._marks.get(key, -1.0))
                    if any(_logged(k) for k in keys):
                        steps.append(record.history.step.num)
                elif kind == "alert":
                    self._alerted.add(record.alert.text)
        self.resumed_at = max(steps, default=None)
        if self.axes:
            self._row = max(rows, default=-1) + 1
            self.resumed_at = int(self._marks[_TRAIN_STEP]) if _TRAIN_STEP in self._marks else None

    def write(self, row: Row) -> None:
        if self.axes:
            self._write_row(self.values(row), _TRAIN_STEP, row.step)
        else:
            super().write(row)

    def log_axis(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        if not self.axes:
            raise ValueError(f"{self!r} logs steps of axes when created with axes=True")
        self.check_open()
        step = as_step(step)
        if step > self._marks.get(axis, -1):
            self._write_row(self.names.adapt(axis_names(as_floats(metrics), axis)), axis, step)

    def _write_row(self, values: dict[str, Any], axis: str, step: int) -> None:
        """One W&B step: ``values`` and ``axis = step``, each name declared with ``axis`` as its
        step metric the first time it is seen."""
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
                records = wandb_records(run_file)[0]
            except ValueError:
                logger.warning("W&B run file %s: a format rlmetrics does not read; not waited for", run_file)
                return
            if records and records[-1].WhichOneof("record_type") == "exit":
                return
            if time.monotonic() > deadline:
                logger.warning("W&B run file %s incomplete %.0f s after finish", run_file, self.close_timeout)
                return
            time.sleep(0.02)

    def __repr__(self) -> str:
        return f"WandbSink(project={self.project!r}, id={getattr(self.run, 'id', None)!r})"
