"""Weights & Biases, offline by default: the run is written under ``<dir>/wandb/offline-run-*``.

Needs the ``trackers`` extra. Upload later with ``wandb sync <dir>/wandb/offline-run-*``. The run is
started with ``reinit="create_new"`` and logged through its own handle, so a W&B run the user has open
is left alone. Unless ``settings`` is given, console capture, system metrics, git and code saving are
off (the sink logs metrics, nothing else). W&B only appends: a step lower than one already logged
is dropped by W&B with a warning. Names are adapted by :func:`rlmetrics.sinks.names.adapt_name`.

``resume=<run id>`` continues that run (``wandb.init(id=..., resume="allow")``): offline, each session
writes its own ``offline-run-<time>-<id>`` directory, and ``wandb sync <dir>/wandb/offline-run-*-<id>``
uploads them as one run, in order. The sink first reads the run files of the earlier sessions (and,
online, the run's step) and skips every step up to the last one they hold, so no step is written
twice and none below a committed one (W&B would drop it). A step's histograms
(:attr:`StepResult.histograms <rlmetrics.StepResult>`) are logged as
``wandb.Histogram(np_histogram=(counts, edges))`` in the step's row. A health alert is a W&B alert
(``run.alert``, titled with the rule and the metric; W&B sends an online run's alerts by e-mail or
Slack) and ``alert/<rule> = 1`` in the step's history.

``run.finish()`` can return before W&B's service has written the run file (``run-<id>.wandb``, a
leveldb-log framed stream of wandb ``Record`` protobufs): ``close()`` then waits, up to
``close_timeout`` seconds, until the file ends with W&B's ``exit`` record, so the run is complete on
disk (ready for ``wandb sync``) when ``close()`` returns.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.names import RunSink

logger = logging.getLogger(__name__)

_HEADER, _BLOCK = 7, 32768  # leveldb log format: 7-byte file and record headers, 32 KiB blocks


def _run_records(path: Path) -> Iterator[bytes]:
    """The payloads of the complete records of a W&B run file, in order (none if it is missing)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    pos, chunks = _HEADER, []
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # block trailer
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if pos + _HEADER + length > len(data):
            break
        chunks.append(data[pos + _HEADER : pos + _HEADER + length])
        pos += _HEADER + length
        if kind in (1, 4):  # FULL or LAST
            yield b"".join(chunks)
            chunks = []


def _logged(key: str) -> bool:
    """``key`` of a history row is a metric this sink logged (not W&B's own, not an alert's)."""
    return not key.startswith(("_", "alert/"))


def _last_record(path: Path) -> bytes | None:
    """The payload of the last complete record of a W&B run file (None if there is none)."""
    records = list(_run_records(path))
    return records[-1] if records else None


class WandbSink(RunSink):
    """Log each step with ``run.log(metrics, step=step)``; ``close()`` finishes the run."""

    def __init__(
        self,
        project: str = "rlmetrics",
        name: str | None = None,
        dir: str | os.PathLike | None = None,
        mode: str = "offline",
        close_timeout: float = 30.0,
        resume: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        wandb = require("wandb", "trackers")
        self._Record = require("wandb.proto.wandb_internal_pb2", "trackers").Record
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
        super().__init__("wandb", wandb.init(project=project, name=name, dir=dir, mode=mode, **init_kwargs))
        if resume:
            self._read_back()

    def _read_back(self) -> None:
        """The last step and the alerts of this run in the run files of its earlier sessions (online,
        the step W&B resumed it at)."""
        run_file = Path(self.run.settings.sync_file)
        files = [f for f in run_file.parent.parent.glob(f"*-{self.run.id}/{run_file.name}") if f != run_file]
        steps = [self.run.step - 1] if self.run.step else []
        self._alerted = set()
        for path in files:
            for payload in _run_records(path):
                record = self._Record()
                record.ParseFromString(payload)
                kind = record.WhichOneof("record_type")
                if kind == "history" and any(
                    _logged(i.key or "/".join(i.nested_key)) for i in record.history.item
                ):
                    steps.append(record.history.step.num)
                elif kind == "alert":
                    self._alerted.add(record.alert.text)
        self.resumed_at = max(steps, default=None)

    def media(self, histogram: Any) -> Any:
        return self._Histogram(np_histogram=(histogram.counts, histogram.edges))

    def alert(self, alert: Alert) -> None:
        if not self._open:
            raise ValueError(f"{self!r} is closed")
        if not self.new_alert(str(alert)):
            return
        level = "ERROR" if alert.level == "error" else "WARN"
        title = f"{alert.rule}: {alert.metric}" if alert.metric else alert.rule
        self.run.alert(title=title[:63], text=str(alert), level=level)
        self.run.log({self.names(f"alert/{alert.rule}"): 1.0}, step=alert.step)

    def finish(self) -> None:
        run_file = Path(self.run.settings.sync_file)
        self.run.finish()
        if self.mode != "disabled":
            self._wait_written(run_file)

    def _wait_written(self, run_file: Path) -> None:
        deadline = time.monotonic() + self.close_timeout
        while True:
            payload = _last_record(run_file)
            if payload is not None:
                record = self._Record()
                record.ParseFromString(payload)
                if record.WhichOneof("record_type") == "exit":
                    return
            if time.monotonic() > deadline:
                logger.warning("W&B run file %s incomplete %.0f s after finish", run_file, self.close_timeout)
                return
            time.sleep(0.02)

    def __repr__(self) -> str:
        return f"WandbSink(project={self.project!r}, id={getattr(self.run, 'id', None)!r})"
