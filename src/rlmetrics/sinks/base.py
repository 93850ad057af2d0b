"""The ``Sink`` base: every method :class:`~rlmetrics.sinks.Tracking` calls, with defaults.

A tracker declares its name rules and writes a step's :class:`Row` in :meth:`Sink.write`; the rest:
docs/architecture.md, "Where a change goes".

>>> class Printer(Sink):
...     tracker = "printer"
...     map_name = staticmethod(str.upper)
...     def write(self, row):
...         print(row.step, row.scalars)
>>> with Printer() as sink:
...     sink.log({"critic/score/mean": 0.5}, 3)
...     sink.log_axis({"reward": 0.25}, 7, "policy_version")
3 {'CRITIC/SCORE/MEAN': 0.5}
7 {'POLICY_VERSION/REWARD': 0.25}
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from rlmetrics.health import Alert
from rlmetrics.sinks.names import NameMap, as_floats, as_step, axis_names, fit, histograms_of, texts_of

_AXIS_CALL = threading.local()  # .sink: the sink whose log_axis calls its own log() on this thread


@dataclass(frozen=True)
class Row:
    """A step under the tracker's names (``texts``: lists of names joined; ``axis``: None for train steps)."""

    step: int
    scalars: dict[str, float]
    histograms: dict[str, Any]
    texts: dict[str, str]
    axis: str | None = None
    meta: Any = None


class Sink:
    """Base of the sinks; ``resumed_at``: the last step the resumed tracker held, up to which it skips."""

    tracker: ClassVar[str]
    """The tracker's name (a key of :data:`~rlmetrics.sinks.TRACKERS`)."""
    name_limit: ClassVar[int | None] = None
    """The longest metric name the tracker takes (None: any length)."""
    case_insensitive_names: ClassVar[bool] = False
    """The tracker takes two names that differ only in case as one metric."""

    folder_files: ClassVar[tuple[str, ...]] = ()
    """What :meth:`in_folder` writes in a run folder (glob patterns)."""
    takes_config: ClassVar[bool] = False
    """:meth:`in_folder` takes the run's ``config=`` (the tracker stores one)."""
    catches_up: ClassVar[bool] = False
    """A resumed :func:`~rlmetrics.sinks.make_sinks` first logs to it the journal's steps it lacks."""
    rebuilds: ClassVar[bool] = False
    """Resumed offline, it reads none of its earlier sessions: the journal replays the whole run."""
    folder_run: ClassVar[bool] = False
    """Its run is its folder (TensorBoard's), with no run id."""
    all_keys: ClassVar[bool] = False
    """It gets every key of a step, whatever :class:`~rlmetrics.sinks.Tracking`'s ``keys=``."""
    background: ClassVar[bool] = False
    """Written from a thread of its own, through a bounded queue (:mod:`rlmetrics.sinks.writer`)."""
    overview_copies: ClassVar[bool] = True
    """It gets the ``overview/`` copies of the core keys when ``Tracking`` makes them."""

    resumed_at: int | None = None
    run_id: str | None = None
    """The tracker's id of the run, what ``resume=`` takes to continue it (None: the sink has none)."""
    on_run_id: Any = None
    """Called with :attr:`run_id` when the tracker creates its run later (MLflow on a server)."""
    closed: bool = False
    _alerted: set | None = None

    @classmethod
    def in_folder(cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str) -> Sink:
        """The sink make_sinks makes in ``out_dir``; ``resume``: False, True (the folder's run) or its id."""
        raise NotImplementedError(f"{cls.__name__} has no in_folder(), which make_sinks needs to make it")

    @property
    def takes_axes(self) -> bool:
        """It takes steps of other step axes (:meth:`log_axis`)."""
        return True

    def earlier_sessions(self) -> list[Path]:
        """The folders of this tracker run's earlier offline sessions (:attr:`rebuilds`)."""
        return []

    def replay_from(self, step: int) -> None:
        """The journal is about to replay the run from ``step`` on to this sink (the base: nothing)."""

    @staticmethod
    def map_name(name: str) -> str:
        """``name`` rewritten for the tracker, before :attr:`name_limit` (the base keeps it)."""
        return name

    @classmethod
    def adapt_name(cls, name: str) -> str:
        """``name`` as the tracker gets it: :meth:`map_name`, cut to :attr:`name_limit`."""
        return fit(cls.map_name(name), cls.name_limit)

    @cached_property
    def names(self) -> NameMap:
        """The sink's adapted names, never two on one series (:class:`~rlmetrics.sinks.names.NameMap`)."""
        return NameMap(type(self))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write ``step`` (:meth:`write`) unless the resumed run holds it (:meth:`skips`)."""
        self.check_open()
        step = as_step(step)
        if not self.skips(step):
            self.write(self.row(metrics, step))

    def log_axis(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        """Write ``step`` of the step axis ``axis`` (:mod:`rlmetrics.axes`): each name under ``<axis>/``."""
        if type(self).write is Sink.write or type(self).log is not Sink.log:  # a log() of its own
            _AXIS_CALL.sink = self  # this thread's skips() lets the axis's steps through
            try:
                return self.log(axis_names(metrics, axis), step)
            finally:
                _AXIS_CALL.sink = None
        self.check_open()
        self.write(replace(self.row(axis_names(metrics, axis), as_step(step)), axis=axis))

    def row(self, metrics: Mapping[str, Any], step: int) -> Row:
        """``metrics`` (a mapping, a :class:`~rlmetrics.StepResult`) as the tracker's :class:`Row`."""
        names = self.names
        return Row(
            step,
            names.adapt(as_floats(metrics)),
            {names(n): h for n, h in histograms_of(metrics).items()},
            {names(n): t for n, t in texts_of(metrics).items()},
            meta=getattr(metrics, "meta", None),
        )

    def write(self, row: Row) -> None:  # pragma: no cover - interface
        """Write a step to the tracker (what a tracker implements, or :meth:`log`)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither write(row) nor log()")

    def expect_alerts(self, rules: Sequence[str]) -> None:
        """The names of the health rules whose alerts may come (the base ignores them)."""

    def alert(self, alert: Alert) -> None:
        """Write a health alert (:meth:`write_alert`) once per :meth:`alert_key`."""
        self.check_open()
        with self.alert_once(self.alert_key(alert)) as new:
            if new:
                self.write_alert(alert)

    def alert_key(self, alert: Alert) -> Any:
        """What identifies ``alert`` in the tracker's files."""
        return alert.step, alert.rule

    def write_alert(self, alert: Alert) -> None:
        """Write ``alert`` to the tracker (the base class ignores it)."""

    def check_open(self) -> None:
        if self.closed:
            raise ValueError(f"{self!r} is closed")

    def close(self) -> None:
        """Close the sink once (:meth:`finish`)."""
        if not self.closed:
            self.closed = True
            self.finish()

    def finish(self) -> None:
        """End the tracker's run (the base: nothing to end)."""

    def skips(self, step: int) -> bool:
        """``step`` was logged before this sink resumed the run (a step axis's steps are not)."""
        return self.resumed_at is not None and step <= self.resumed_at and not self.in_axis_call()

    def in_axis_call(self) -> bool:
        """This thread is in :meth:`log_axis` of this sink, calling its own ``log()``."""
        return getattr(_AXIS_CALL, "sink", None) is self

    @contextmanager
    def alert_once(self, key: Any) -> Iterator[bool]:
        """Whether the alert ``key`` is new; recorded once the ``with`` block ends without an error."""
        if self._alerted is None:
            self._alerted = set()
        new = key not in self._alerted
        yield new
        if new:
            self._alerted.add(key)

    @staticmethod
    def transient(exc: Exception) -> bool:
        """Whether a call that raised ``exc`` may pass when made again (the base: all but a bug's errors)."""
        return not isinstance(exc, (ValueError, TypeError, LookupError, AttributeError, NotImplementedError))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunSink(Sink):
    """A sink around a tracker's run with ``run.log(dict, step=...)`` (W&B, SwanLab, trackio)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def write(self, row: Row) -> None:
        self.run.log(self.values(row), step=row.step)

    def values(self, row: Row) -> dict[str, Any]:
        """What ``run.log`` gets of a row: its floats, histograms and texts."""
        media = {n: self.media(h) for n, h in row.histograms.items()}
        texts = {n: self.text(t) for n, t in row.texts.items()}
        return {**row.scalars, **{n: m for n, m in media.items() if m is not None}, **texts}

    def media(self, histogram: Any) -> Any:
        """The tracker's object for a :class:`~rlmetrics.core.histogram.Histogram` (None: not logged)."""
        return None

    def text(self, text: str) -> Any:
        """The tracker's object for a text (the base: the string)."""
        return text

    @property
    def run_id(self) -> str:
        return self.run.id

    def finish(self) -> None:
        self.run.finish()


def resume_id(resume: bool | str) -> str | None:
    """The tracker run id that :meth:`Sink.in_folder`'s ``resume`` names (None: a new run or none saved)."""
    return resume if isinstance(resume, str) else None
