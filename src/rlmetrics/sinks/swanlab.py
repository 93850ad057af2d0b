"""SwanLab, offline by default: the run is one ``run-<id>.swanlab`` file under ``logdir``.

Needs the ``trackers`` extra. Upload later with ``swanlab sync <logdir>/run-*``. SwanLab allows one
active run per process: creating a second SwanLabSink while one is open raises SwanLab's
RuntimeError. Names are adapted by :func:`rlmetrics.sinks.names.adapt_name` before SwanLab sees
them, so SwanLab's own silent trimming of leading/trailing ``.`` and ``/`` never merges two metrics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.sinks.names import RunSink


class SwanLabSink(RunSink):
    """Log each step with ``run.log(metrics, step=step)``; ``close()`` finishes the run."""

    def __init__(
        self,
        project: str = "rlmetrics",
        logdir: str | os.PathLike | None = None,
        mode: str = "offline",
        **kw: Any,
    ) -> None:
        swanlab = require("swanlab", "trackers")
        if logdir is not None:
            Path(logdir).mkdir(parents=True, exist_ok=True)
            kw["log_dir"] = str(logdir)
        self.project, self.logdir = project, logdir
        super().__init__("swanlab", swanlab.init(project=project, mode=mode, **kw))

    def __repr__(self) -> str:
        return f"SwanLabSink(project={self.project!r}, logdir={str(self.logdir)!r})"
