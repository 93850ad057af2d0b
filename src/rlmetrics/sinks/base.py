"""The ``Sink`` base: every method :class:`~rlmetrics.sinks.Tracking` calls, and the sink's name rules.

A sink declares ``tracker`` (its name) and implements ``log(metrics, step)`` and ``close()``; the
base gives the rest a default that a sink may override: ``log_axis`` (the axis's names at its step),
``alert`` (ignored), ``skips`` and ``resumed_at`` (the steps a resumed run holds), ``run_id`` (None:
no tracker run to continue). So ``Tracking`` calls these methods on every sink and never asks which
ones it has.

A tracker that :func:`~rlmetrics.sinks.make_sinks` builds by name also declares how it lives in a
run folder: :meth:`Sink.in_folder` (the sink in ``out_dir``; resumed, it reads its own files and
sets ``resumed_at``), ``folder_files`` (what it writes there, which a rerun refuses and
``overwrite=True`` removes), ``takes_config`` and ``catches_up``, and which keys of a step it gets
(``all_keys``, ``overview_copies``); it is listed in :data:`~rlmetrics.sinks.TRACKERS`
(docs/architecture.md, "Where a change goes").

Name rules: a tracker restricts metric names, and each sink class declares what its tracker takes:
``map_name`` (how a name is rewritten; the base keeps it), ``name_limit`` (the longest name,
:func:`~rlmetrics.sinks.names.fit` cuts a longer one) and ``case_insensitive_names`` (two names equal
but for case are one series). :meth:`Sink.adapt_name` applies them;
:class:`~rlmetrics.sinks.names.NameMap` adds collision handling.

>>> class Printer(Sink):
...     tracker = "printer"
...     map_name = staticmethod(str.upper)
...     def log(self, metrics, step):
...         print(step, {self.adapt_name(k): v for k, v in metrics.items()})
...     def close(self):
...         print("closed")
>>> with Printer() as sink:
...     sink.log({"critic/score/mean": 0.5}, 3)
...     sink.log_axis({"reward": 0.25}, 7, "policy_version")
3 {'CRITIC/SCORE/MEAN': 0.5}
7 {'POLICY_VERSION/REWARD': 0.25}
closed
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from rlmetrics.health import Alert
from rlmetrics.sinks.names import NameMap, as_floats, as_step, axis_names, fit, histograms_of, texts_of

_AXIS_CALL = threading.local()  # .sink: the sink whose base log_axis runs on this thread


class Sink:
    """Base of the sinks: ``log(metrics, step)``, ``alert(alert)``, ``close()`` and a context manager.

    ``resumed_at``: the last step the tracker held when this sink was opened to continue a run (None:
    nothing to skip), which the sink reads from its own files; its ``log`` skips every step up to it
    (:meth:`skips`; :class:`~rlmetrics.sinks.Tracking` skips them too), so a driver restarted from an
    older training checkpoint never writes a step twice, nor a lower step after a higher one.
    """

    tracker: ClassVar[str]
    """The tracker's name (a key of :data:`~rlmetrics.sinks.TRACKERS`)."""
    name_limit: ClassVar[int | None] = None
    """The longest metric name the tracker takes (None: any length)."""
    case_insensitive_names: ClassVar[bool] = False
    """The tracker takes two names that differ only in case as one metric."""

    folder_files: ClassVar[tuple[str, ...]] = ()
    """What :meth:`in_folder` writes in a run folder (glob patterns): what
    :func:`~rlmetrics.sinks.make_sinks` refuses to write over, and replaces with ``overwrite=True``."""
    takes_config: ClassVar[bool] = False
    """:meth:`in_folder` takes the run's ``config=`` (the tracker stores one)."""
    catches_up: ClassVar[bool] = False
    """A resumed :func:`~rlmetrics.sinks.make_sinks` first logs to it the steps of the JSONL file
    that its own files lack (:meth:`~rlmetrics.sinks.Tracking.catch_up`)."""
    all_keys: ClassVar[bool] = False
    """It gets every key of a step, whatever :class:`~rlmetrics.sinks.Tracking`'s ``keys=`` (the
    JSONL file: the record a resumed run catches up from)."""
    background: ClassVar[bool] = False
    """:class:`~rlmetrics.sinks.Tracking` makes its calls from a thread of its own, through a bounded
    queue (:mod:`rlmetrics.sinks.writer`): a tracker down, frozen or slow never holds a training step."""
    overview_copies: ClassVar[bool] = True
    """It gets the ``overview/`` copies of the core keys when ``Tracking`` makes them (the console
    shows each key once)."""

    resumed_at: int | None = None
    run_id: str | None = None
    """The tracker's id of the run, what ``resume=`` takes to continue it (None: the sink has none)."""
    _alerted: set | None = None

    @classmethod
    def in_folder(cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str) -> Sink:
        """The sink :func:`~rlmetrics.sinks.make_sinks` makes in its run folder ``out_dir``;
        ``resume``: False (a new run), True (continue what is in ``out_dir``) or the id of the
        tracker's run to continue (:func:`resume_id`)."""
        raise NotImplementedError(f"{cls.__name__} has no in_folder(), which make_sinks needs to make it")

    @staticmethod
    def map_name(name: str) -> str:
        """``name`` rewritten for the tracker, before :attr:`name_limit` (the base keeps it)."""
        return name

    @classmethod
    def adapt_name(cls, name: str) -> str:
        """``name`` as the tracker gets it: :meth:`map_name`, cut to :attr:`name_limit`."""
        return fit(cls.map_name(name), cls.name_limit)

    def log(self, metrics: Mapping[str, float], step: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def log_axis(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        """Log ``step`` of the step axis ``axis`` (:mod:`rlmetrics.axes`). The base class logs
        :func:`~rlmetrics.sinks.names.axis_names` at ``step`` (a series per name, its steps the
        axis's values: TensorBoard, MLflow, SwanLab, the console); the skip of a resumed run is about
        ``train_step`` only."""
        _AXIS_CALL.sink = self  # this thread's skips() lets the axis's steps through
        try:
            self.log(axis_names(metrics, axis), step)
        finally:
            _AXIS_CALL.sink = None

    def expect_alerts(self, rules: Sequence[str]) -> None:
        """The names of the health rules whose alerts may come (the base class ignores them; a
        counter per rule starts at 0 from them)."""

    def alert(self, alert: Alert) -> None:
        """Write a health alert of a step this sink logged (the base class ignores it)."""

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def skips(self, step: int) -> bool:
        """``step`` was logged before this sink resumed the run."""
        return self.resumed_at is not None and step <= self.resumed_at and not self.in_axis_call()

    def in_axis_call(self) -> bool:
        """This thread is in the base :meth:`log_axis` of this sink (whose steps are not skipped)."""
        return getattr(_AXIS_CALL, "sink", None) is self

    @contextmanager
    def alert_once(self, key: Any) -> Iterator[bool]:
        """Whether the alert ``key`` (what identifies an alert in this sink's files) was not written
        yet (in this session, or before a resume when the sink read its files); it is recorded as
        written once the ``with`` block ends without an error (a write that failed is retried)."""
        if self._alerted is None:
            self._alerted = set()
        new = key not in self._alerted
        yield new
        if new:
            self._alerted.add(key)

    @staticmethod
    def transient(exc: Exception) -> bool:
        """Whether the error a call of this sink raised may pass when made again (a server down):
        :class:`~rlmetrics.sinks.Tracking` retries a background sink's call then, and disables the
        sink otherwise. The base: any error but a caller's or a sink's bug (ValueError, TypeError,
        LookupError, AttributeError, NotImplementedError)."""
        return not isinstance(exc, (ValueError, TypeError, LookupError, AttributeError, NotImplementedError))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunSink(Sink):
    """A sink around a tracker's run object with ``run.log(dict, step=...)`` (W&B, SwanLab): names
    adapted by the sink's rules; ``close()`` runs :meth:`finish` once. A step's histograms go in the
    same ``run.log`` call, as :meth:`media` makes them (the base: none, the tracker has no histogram),
    and its lists of names (:attr:`StepResult.lists <rlmetrics.StepResult>`) as :meth:`text` makes them."""

    def __init__(self, run: Any) -> None:
        self.names = NameMap(type(self))
        self.run = run
        self._open = True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._open:
            raise ValueError(f"{self!r} is closed")
        step = as_step(step)
        if not self.skips(step):
            self.run.log(self.row(metrics), step=step)

    def row(self, metrics: Mapping[str, float]) -> dict[str, Any]:
        """What ``run.log`` gets of a step: its floats, histograms (:meth:`media`) and lists of
        names (:meth:`text`), under the tracker's names."""
        values: dict[str, Any] = self.names.adapt(as_floats(metrics))
        for name, histogram in histograms_of(metrics).items():
            media = self.media(histogram)
            if media is not None:
                values[self.names(name)] = media
        for name, text in texts_of(metrics).items():
            values[self.names(name)] = self.text(text)
        return values

    def media(self, histogram: Any) -> Any:
        """The tracker's object for a :class:`~rlmetrics.core.histogram.Histogram` (None: not logged)."""
        return None

    def text(self, text: str) -> Any:
        """The tracker's object for a list of names (the straggler report's slowest ranks) as
        :func:`~rlmetrics.sinks.names.texts_of` joins them; the base: the string itself (W&B,
        trackio: a column of the run's table, no media file, where a ``wandb.Table`` would be a file
        per step and list)."""
        return text

    @property
    def run_id(self) -> str:
        """The tracker's id of the run (what ``resume=`` takes to continue it)."""
        return self.run.id

    def close(self) -> None:
        if self._open:
            self._open = False
            self.finish()

    def finish(self) -> None:
        self.run.finish()


def resume_id(resume: bool | str) -> str | None:
    """The tracker run id that :meth:`Sink.in_folder`'s ``resume`` names (None: a new run or none saved)."""
    return resume if isinstance(resume, str) else None
