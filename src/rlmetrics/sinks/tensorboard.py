"""TensorBoard event files, written with the ``tensorboard`` package alone (no torch, no TensorFlow)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.base import Row, Sink
from rlmetrics.sinks.names import path_safe


class TensorBoardSink(Sink):
    """Write scalars to an event file in ``log_dir`` (created)."""

    tracker = "tensorboard"
    background = True  # written from its own thread (Tracking)
    map_name = staticmethod(path_safe)

    folder_files = ("tensorboard",)
    catches_up = rebuilds = folder_run = True

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, log_dir: Any = None
    ) -> TensorBoardSink:
        """In ``log_dir`` when given (verl's ``TENSORBOARD_DIR``), else ``out_dir/tensorboard``."""
        return cls(log_dir or out_dir / "tensorboard", resume=bool(resume))

    def __init__(self, log_dir: str | os.PathLike, *, resume: bool = False) -> None:
        writer = require("tensorboard.summary.writer.event_file_writer", "tensorboard")
        self._event_pb2 = require("tensorboard.compat.proto.event_pb2", "tensorboard")
        self._summary_pb2 = require("tensorboard.compat.proto.summary_pb2", "tensorboard")
        self._text_pb = require("tensorboard.plugins.text.summary_v2", "tensorboard").text_pb
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.held = any(self.log_dir.glob("*tfevents*"))  # from earlier sessions (none is read)
        if self.held and not resume:
            raise FileExistsError(
                f"{self.log_dir} holds TensorBoard event files: pass resume=True to continue that run, "
                "or use another log_dir"
            )
        if self.held:  # TensorBoard reads files by name: a new one of the same second could sort first
            stamps = [f.name.split(".")[3] for f in self.log_dir.glob("events.out.tfevents.*")]
            newest = max((int(t) for t in stamps if t.isdigit()), default=0)
            time.sleep(max(0.0, newest + 1 - time.time()))
        self._writer = writer.EventFileWriter(str(self.log_dir))
        self._restart = self.held  # a START at the first train step written (torch's purge_step)
        if not self.held:  # the run's first START, which TensorBoard's readers take for no restart
            self.replay_from(0)

    def replay_from(self, step: int) -> None:
        """TensorBoard's session START event at ``step``: its readers drop what earlier files hold from it."""
        self._restart = False
        start = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, session_log=start))

    def write(self, row: Row) -> None:
        Value = self._summary_pb2.Summary.Value
        out = [Value(tag=tag, simple_value=value) for tag, value in row.scalars.items()]
        for tag, h in row.histograms.items():
            histo = self._summary_pb2.HistogramProto(
                min=h.edges[0], max=h.edges[-1], num=h.count, sum=h.sum, sum_squares=h.sum_squares,
                bucket_limit=h.edges[1:].tolist(), bucket=h.counts.tolist(),
            )  # fmt: skip
            out.append(Value(tag=tag, histo=histo))
        for tag, text in row.texts.items():
            out.extend(self._text_pb(tag, text).value)
        if self._restart and row.axis is None:
            self.replay_from(row.step)
        self._write(row.step, out)

    def alert_key(self, alert: Alert) -> Any:
        return alert.step, str(alert)

    def write_alert(self, alert: Alert) -> None:
        if self._restart:
            self.replay_from(alert.step)
        self._write(alert.step, self._text_pb(self.names(f"alert/{alert.rule}"), str(alert)).value)

    def _write(self, step: int, values: list) -> None:
        summary = self._summary_pb2.Summary(value=values)
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def finish(self) -> None:
        self._writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.log_dir)!r})"
