"""SwanLab, offline by default: the run is ``<logdir>/run-<time>-<id>/run-<id>.swanlab``.

Needs the ``trackers`` extra. Upload later with ``swanlab sync <logdir>/run-*``. One open run per
process (a second sink raises SwanLab's RuntimeError); names are path-safe, at most 512 characters.
``resume=<run id>`` reads the earlier sessions' files back and skips the steps they hold (the last
one gets the metrics it lacks); alerts and lists of names are texts; no histograms.
docs/trackers.md, "Sinks" and "Each tracker" (resuming: docs/resume.md).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.base import Row, RunSink, resume_id
from rlmetrics.sinks.compat import swanlab_records
from rlmetrics.sinks.jsonl import run_config
from rlmetrics.sinks.names import path_safe


class SwanLabSink(RunSink):
    """Log each step with ``run.log(metrics, step=step)``; ``close()`` finishes the run."""

    tracker = "swanlab"
    background = True  # written from its own thread (Tracking)
    name_limit = 512
    map_name = staticmethod(path_safe)

    folder_files = ("swanlab",)
    takes_config = catches_up = True

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, **options: Any
    ) -> SwanLabSink:
        if run_name:
            options["name"] = run_name
        logdir = os.environ.get("SWANLAB_LOG_DIR") or out_dir / "swanlab"  # SwanLab's (and verl's) variable
        return cls(project, logdir=logdir, mode="offline", resume=resume_id(resume), **options)

    def __init__(
        self,
        project: str = "rlmetrics",
        logdir: str | os.PathLike | None = None,
        mode: str = "offline",
        resume: str | None = None,
        config: Any = None,
        **kw: Any,
    ) -> None:
        kw["config"] = run_config(config)
        self._swanlab = swanlab = require("swanlab", "trackers")
        if logdir is not None:
            Path(logdir).mkdir(parents=True, exist_ok=True)
            kw["log_dir"] = str(logdir)
        if resume:
            kw.update(id=resume, resume="allow")
        self.project, self.logdir = project, logdir
        self._cut: int | None = None  # the last step of a resumed run, which may hold part of its metrics
        self._held: set[str] = set()  # the metrics it holds
        super().__init__(swanlab.init(project=project, mode=mode, **kw))
        if resume:
            self._read_back()

    def _read_back(self) -> None:
        """The last scalar step (and the metrics it holds) and the alerts of this run in the run files
        of its earlier sessions."""
        here = Path(self.run.dir)
        scalars = []
        self._alerted = set()
        for path in here.parent.glob(f"*-{self.run.id}/run-{self.run.id}.swanlab"):
            if path.parent == here or path.stat().st_size < 8:  # a killed session may leave it empty
                continue
            for record in swanlab_records(path):
                if record.HasField("scalar"):
                    scalars.append((record.scalar.step, record.scalar.key))
                elif record.HasField("media"):  # an alert: its text is known by its sha256
                    self._alerted.update((record.media.step, i.sha256) for i in record.media.value.items)
        self.resumed_at = self._cut = max((step for step, _ in scalars), default=None)
        self._held = {key for step, key in scalars if step == self._cut}

    def skips(self, step: int) -> bool:
        """A step up to the last one the run holds, but that one until it is logged again: SwanLab
        writes a record per metric and flushes every 8 KB, so a killed session may have left part of
        its metrics; it gets those it lacks."""
        return super().skips(step) and step != self._cut

    def write(self, row: Row) -> None:
        if row.axis is None and self._cut is not None and row.step >= self._cut:
            if row.step == self._cut:  # the last step held: what it lacks, once
                lacks = {k: v for k, v in row.scalars.items() if k not in self._held}
                row = Row(row.step, lacks, {}, {k: t for k, t in row.texts.items() if k not in self._held})
            self._cut = None  # gone past it: never lower again
            if not (row.scalars or row.texts):
                return
        super().write(row)

    def text(self, text: str) -> Any:
        return self._swanlab.Text(text)

    def alert_key(self, alert: Alert) -> Any:
        return alert.step, hashlib.sha256(str(alert).encode()).hexdigest()

    def write_alert(self, alert: Alert) -> None:
        self.run.log({self.names(f"alert/{alert.rule}"): self._swanlab.Text(str(alert))}, step=alert.step)

    def __repr__(self) -> str:
        return f"SwanLabSink(project={self.project!r}, logdir={str(self.logdir)!r})"
