"""trackio (Hugging Face's local tracker): the run in a SQLite file in the sink's folder; docs/trackers.md."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.base import RunSink, resume_id
from rlmetrics.sinks.compat import trackio_folders
from rlmetrics.sinks.jsonl import run_config

_REMOTE = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")


def _use_dir(logdir: Path) -> Any:
    """trackio, imported with its folders in ``logdir``."""
    logdir.mkdir(parents=True, exist_ok=True)
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(logdir)
    trackio = require("trackio", "trackers")
    trackio_folders(
        {"TRACKIO_DIR": logdir, "MEDIA_DIR": logdir / "media", "ARTIFACTS_DIR": logdir / "artifacts"}
    )
    return trackio


class TrackioSink(RunSink):
    """Log each step with ``run.log(metrics, step=step)``; ``close()`` finishes the run."""

    tracker = "trackio"
    background = True  # written from its own thread (Tracking)

    folder_files = ("trackio",)
    takes_config = catches_up = True

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, **options: Any
    ) -> TrackioSink:
        return cls(project, run_name, logdir=out_dir / "trackio", resume=resume_id(resume), **options)

    def __init__(
        self,
        project: str = "rlmetrics",
        name: str | None = None,
        logdir: str | os.PathLike = "trackio",
        resume: str | None = None,
        config: Any = None,
    ) -> None:
        remote = [v for v in _REMOTE if os.environ.get(v)]
        if remote:
            raise RuntimeError(
                f"trackio: {', '.join(remote)} set: the run would leave this machine; unset it"
            )
        self.project, self.logdir = project, Path(logdir)
        trackio = _use_dir(self.logdir)
        if resume:
            name = resume
        run = trackio.init(
            project=project,
            name=name,
            config=run_config(config),
            resume="allow" if resume else "never",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )
        super().__init__(run)
        if resume:
            logs = trackio.SQLiteStorage.get_logs(project, run.name)  # trackio's reader of its runs
            self.resumed_at = max((int(r["step"]) for r in logs), default=None)

    @property
    def run_id(self) -> str:
        """The run's name: what ``resume=`` takes (trackio resumes a run by name)."""
        return self.run.name

    def write_alert(self, alert: Alert) -> None:
        self.run.alert(title=f"alert/{alert.rule}", text=str(alert), step=alert.step)

    def __repr__(self) -> str:
        return f"TrackioSink(project={self.project!r}, logdir={str(self.logdir)!r})"
