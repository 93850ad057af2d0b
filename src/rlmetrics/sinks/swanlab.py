"""SwanLab, offline by default: the run is ``<logdir>/run-<time>-<id>/run-<id>.swanlab``; docs/trackers.md."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.base import RunSink, resume_id
from rlmetrics.sinks.jsonl import run_config
from rlmetrics.sinks.names import path_safe


class SwanLabSink(RunSink):
    """Log each step with ``run.log(metrics, step=step)``; ``close()`` finishes the run."""

    tracker = "swanlab"
    background = True  # written from its own thread (Tracking)
    name_limit = 512
    map_name = staticmethod(path_safe)

    folder_files = ("swanlab",)
    takes_config = catches_up = rebuilds = True

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
        super().__init__(swanlab.init(project=project, mode=mode, **kw))

    def earlier_sessions(self) -> list[Path]:
        here = Path(self.run.dir)
        return [d for d in here.parent.glob(f"run-*-{self.run.id}") if d != here and d.is_dir()]

    def text(self, text: str) -> Any:
        return self._swanlab.Text(text)

    def alert_key(self, alert: Alert) -> Any:
        return alert.step, hashlib.sha256(str(alert).encode()).hexdigest()

    def write_alert(self, alert: Alert) -> None:
        self.run.log({self.names(f"alert/{alert.rule}"): self._swanlab.Text(str(alert))}, step=alert.step)

    def __repr__(self) -> str:
        return f"SwanLabSink(project={self.project!r}, logdir={str(self.logdir)!r})"
