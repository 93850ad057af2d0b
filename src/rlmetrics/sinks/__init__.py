"""Sinks: where step results go — JSONL, the console, TensorBoard, W&B, MLflow, SwanLab.

Every sink has ``log(metrics, step)`` (``metrics``: ``{name: float}``, e.g. a
:class:`~rlmetrics.StepResult`) and ``close()``, and is a context manager. :class:`Tracking` fans a
step out to several sinks and keeps the run going when one of them fails. :func:`make_sinks` builds
the usual set in one output directory by name (see :data:`SINKS`).

Importing this package imports no tracker, torch or rich: each sink imports its library when it is
created, and a missing one raises an ImportError naming the pip extra.

>>> import tempfile
>>> out = tempfile.mkdtemp()
>>> with make_sinks(["jsonl"], out) as tracking:
...     for step in range(3):
...         tracking.log({"critic/score/mean": step / 2}, step)
>>> read_jsonl(f"{out}/metrics.jsonl").series("critic/score/mean")[1]
array([0. , 0.5, 1. ])
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from rlmetrics.sinks.console import ConsoleSink, format_value, render_table, summary_table
from rlmetrics.sinks.jsonl import JsonlRun, JsonlSink, read_jsonl
from rlmetrics.sinks.mlflow import MLflowSink
from rlmetrics.sinks.names import NameMap, Sink, adapt_name, as_floats, as_step
from rlmetrics.sinks.swanlab import SwanLabSink
from rlmetrics.sinks.tensorboard import TensorBoardSink
from rlmetrics.sinks.wandb import WandbSink

logger = logging.getLogger(__name__)


class Tracking(Sink):
    """Fan-out to ``sinks``: a sink that raises is reported once (``logging.error``) and disabled;
    every other sink still gets every step. ``close()`` closes every sink, errors isolated too.

    Metric values are checked once, before any sink sees the step: a value that is not a real number
    raises TypeError to the caller (a caller's bug, not a sink failure).
    """

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)
        self.failed: dict[int, BaseException] = {}  # index in ``sinks`` → the exception that disabled it
        self._closed = False

    @property
    def active(self) -> list[Sink]:
        """The sinks still receiving steps."""
        return [s for i, s in enumerate(self.sinks) if i not in self.failed]

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            raise ValueError("Tracking is closed")
        as_floats(metrics)
        step = as_step(step)
        for i, sink in enumerate(self.sinks):
            if i in self.failed:
                continue
            try:
                sink.log(metrics, step)
            except Exception as exc:
                self.failed[i] = exc
                logger.error("sink %r failed at step %d and is disabled: %r", sink, step, exc, exc_info=exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                logger.error("sink %r failed to close: %r", sink, exc, exc_info=exc)

    def __repr__(self) -> str:
        return f"Tracking({self.sinks!r})"


def _mlflow(out_dir: Path, project: str, run_name: str | None) -> MLflowSink:
    return MLflowSink(f"sqlite:///{(out_dir / 'mlflow.db').resolve().as_posix()}", project, run_name)


def _swanlab(out_dir: Path, project: str, run_name: str | None) -> SwanLabSink:
    extra = {"name": run_name} if run_name else {}
    return SwanLabSink(project, logdir=out_dir / "swanlab", mode="offline", **extra)


SINKS: dict[str, Callable[[Path, str, str | None], Sink]] = {
    "jsonl": lambda out_dir, project, run_name: JsonlSink(out_dir / "metrics.jsonl"),
    "console": lambda out_dir, project, run_name: ConsoleSink(),
    "tensorboard": lambda out_dir, project, run_name: TensorBoardSink(out_dir / "tensorboard"),
    "wandb": lambda out_dir, project, run_name: WandbSink(project, run_name, dir=out_dir, mode="offline"),
    "mlflow": _mlflow,
    "swanlab": _swanlab,
}
"""Sink name → factory ``(out_dir, project, run_name) -> Sink``, as :func:`make_sinks` uses them."""


def make_sinks(
    names: Sequence[str] | str,
    out_dir: str | os.PathLike,
    *,
    project: str = "rlmetrics",
    run_name: str | None = None,
) -> Tracking:
    """A :class:`Tracking` over the sinks named in ``names`` (a list, or one comma-separated str;
    blank names skipped, repeats once).

    Files go to ``out_dir`` (created): ``metrics.jsonl``, ``tensorboard/``, ``wandb/``,
    ``mlflow.db``, ``swanlab/``; trackers run offline. If one sink cannot be created, the ones
    already created are closed and the error is raised.
    """
    if isinstance(names, str):
        names = names.split(",")
    wanted = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in wanted if n not in SINKS]
    if unknown:
        raise ValueError(f"unknown sink(s) {', '.join(map(repr, unknown))}; valid: {', '.join(SINKS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sinks: list[Sink] = []
    try:
        for name in wanted:
            sinks.append(SINKS[name](out, project, run_name))
    except BaseException:
        Tracking(sinks).close()
        raise
    return Tracking(sinks)


__all__ = [
    "SINKS", "ConsoleSink", "JsonlRun", "JsonlSink", "MLflowSink", "NameMap", "Sink", "SwanLabSink",
    "TensorBoardSink", "Tracking", "WandbSink", "adapt_name", "format_value", "make_sinks", "read_jsonl",
    "render_table", "summary_table",
]  # fmt: skip
