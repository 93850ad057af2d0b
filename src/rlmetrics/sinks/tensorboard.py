"""TensorBoard event files, written with the ``tensorboard`` package alone (no torch, no TensorFlow).

Needs the ``tensorboard`` extra. Each step is one event holding every metric as a scalar summary
(``simple_value``: float32, what TensorBoard's scalar dashboard and ``EventAccumulator.Scalars``
read) and is flushed at once. Names are adapted by :func:`rlmetrics.sinks.names.adapt_name`; tags
live inside the event file, the file name never contains a metric name. View with
``tensorboard --logdir <log_dir>``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from rlmetrics.extras import require
from rlmetrics.sinks.names import NameMap, Sink, as_floats, as_step


class TensorBoardSink(Sink):
    """Write scalars to an event file in ``log_dir`` (created)."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        writer = require("tensorboard.summary.writer.event_file_writer", "tensorboard")
        self._event_pb2 = require("tensorboard.compat.proto.event_pb2", "tensorboard")
        self._summary_pb2 = require("tensorboard.compat.proto.summary_pb2", "tensorboard")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.names = NameMap("tensorboard")
        self._writer = writer.EventFileWriter(str(self.log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            raise ValueError(f"{self!r} is closed")
        step = as_step(step)
        summary = self._summary_pb2.Summary(
            value=[
                self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
                for tag, value in self.names.adapt(as_floats(metrics)).items()
            ]
        )
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.log_dir)!r})"
