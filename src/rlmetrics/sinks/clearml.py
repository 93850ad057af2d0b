"""ClearML in offline mode: the session is a folder (and its zip) in the sink's folder; docs/trackers.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.base import Row, Sink, resume_id
from rlmetrics.sinks.compat import clearml_no_reporter
from rlmetrics.sinks.jsonl import run_config


def clearml_name(name: str) -> str:
    """``name`` as ``<title>/<series>``: a name without ``/`` is both (``loss`` → ``loss/loss``)."""
    return name if "/" in name else f"{name}/{name}"


class ClearMLSink(Sink):
    """Each metric as ``logger.report_scalar(title, series, value, iteration=step)``."""

    tracker = "clearml"
    background = True  # written from its own thread (Tracking)
    map_name = staticmethod(clearml_name)

    folder_files = ("clearml",)
    takes_config = True

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, **options: Any
    ) -> ClearMLSink:
        """A saved task id raises: an offline session is not continued."""
        return cls(project, run_name, logdir=out_dir / "clearml", resume=resume_id(resume), **options)

    def __init__(
        self,
        project: str = "rlmetrics",
        name: str | None = None,
        logdir: str | os.PathLike = "clearml",
        resume: str | bool | None = None,
        config: Any = None,
    ) -> None:
        if resume:
            raise ValueError(
                "clearml: an offline ClearML session cannot be continued (resume=); start a new folder"
            )
        clearml = require("clearml", "trackers")
        Task = clearml.Task
        if Task.current_task() is not None:  # Task.init would hand back that task: two sinks, one session
            raise RuntimeError(
                "clearml: a ClearML task is open in this process (one per process); close it first"
            )
        self.project, self.logdir = project, Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        Task.set_offline(True)
        clearml_no_reporter(Task)
        cache = os.environ.get("CLEARML_CACHE_DIR")
        os.environ["CLEARML_CACHE_DIR"] = str(self.logdir.resolve())
        try:
            self.task = Task.init(
                project_name=project,
                task_name=name or "rlmetrics",
                reuse_last_task_id=False,
                auto_connect_frameworks=False,
                auto_connect_arg_parser=False,
                auto_connect_streams=False,
                auto_resource_monitoring=False,
            )
            self.folder = Path(self.task.get_offline_mode_folder())
        finally:
            if cache is None:
                os.environ.pop("CLEARML_CACHE_DIR", None)
            else:
                os.environ["CLEARML_CACHE_DIR"] = cache
        config = run_config(config)
        if config is not None:
            self.task.connect_configuration(config, name="config")
        self.logger = self.task.get_logger()

    def write(self, row: Row) -> None:
        for name, value in row.scalars.items():
            title, _, series = name.rpartition("/")
            self.logger.report_scalar(title, series, value, iteration=row.step)
        for name, text in row.texts.items():
            self.logger.report_text(f"{name}: {text}", iteration=row.step, print_console=False)

    def write_alert(self, alert: Alert) -> None:
        self.logger.report_text(f"alert/{alert.rule}: {alert}", iteration=alert.step, print_console=False)

    @property
    def run_id(self) -> str:
        """The offline task's id (``offline-<hex>``, the session folder's name)."""
        return self.task.id

    def finish(self) -> None:
        self.task.close()

    def __repr__(self) -> str:
        return f"ClearMLSink(project={self.project!r}, logdir={str(self.logdir)!r})"
