"""The ``Sink`` base: every method :class:`~rlmetrics.sinks.Tracking` calls, with defaults.

A tracker is a translator: it declares ``tracker`` (its name) and its name rules as data
(``map_name``, ``name_limit``, ``case_insensitive_names``), and writes a step's :class:`Row` (its
scalars, histograms and texts, under the tracker's names) in :meth:`Sink.write`; the base's
:meth:`Sink.log` checks the step, skips what a resumed run holds and builds the row. Alerts go
through :meth:`Sink.write_alert`, once each (:meth:`Sink.alert_once`). A sink of one's own may
implement ``log(metrics, step)`` and ``close()`` instead. How a tracker lives in a run folder
(``in_folder``, ``folder_files``, ``takes_config``, ``catches_up``) and which keys it gets
(``all_keys``, ``overview_copies``): docs/architecture.md, "Where a change goes".

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
    """A step as a tracker writes it: ``scalars``, ``histograms``
    (:class:`~rlmetrics.core.histogram.Histogram`) and ``texts`` (a list of names joined by ``", "``:
    the slowest ranks), each under the tracker's names; ``axis``: the step's axis (``train_step``:
    None), whose names the row already carries under ``<axis>/``; ``meta``: the step's
    :class:`~rlmetrics.StepMeta` if it has one."""

    step: int
    scalars: dict[str, float]
    histograms: dict[str, Any]
    texts: dict[str, str]
    axis: str | None = None
    meta: Any = None


class Sink:
    """Base of the sinks: ``log(metrics, step)``, ``log_axis``, ``alert(alert)``, ``close()`` and a
    context manager.

    ``resumed_at``: the last step the tracker held when this sink was opened to continue a run (None:
    nothing to skip); :meth:`log` skips every step up to it (:meth:`skips`), so a driver restarted
    from an older checkpoint never writes a step twice, nor a lower step after a higher one (a
    tracker that replaces a step logged again, TensorBoard, has none).
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
    rebuilds: ClassVar[bool] = False
    """Resumed offline, it reads none of its earlier sessions: :func:`~rlmetrics.sinks.make_sinks`
    (with ``jsonl``) sets them aside (:meth:`earlier_sessions`) or drops them (:meth:`replay_from`)
    and replays the whole journal to it."""
    folder_run: ClassVar[bool] = False
    """Its run is its folder (TensorBoard's), with no run id: resumed, it continues there, rebuilt
    from the journal when it holds the run whole (:meth:`replay_from`), else as it is."""
    all_keys: ClassVar[bool] = False
    """It gets every key of a step, whatever :class:`~rlmetrics.sinks.Tracking`'s ``keys=``."""
    background: ClassVar[bool] = False
    """:class:`~rlmetrics.sinks.Tracking` makes its calls from a thread of its own, through a bounded
    queue (:mod:`rlmetrics.sinks.writer`): a tracker down, frozen or slow never holds a training step."""
    overview_copies: ClassVar[bool] = True
    """It gets the ``overview/`` copies of the core keys when ``Tracking`` makes them."""

    resumed_at: int | None = None
    run_id: str | None = None
    """The tracker's id of the run, what ``resume=`` takes to continue it (None: the sink has none)."""
    on_run_id: Any = None
    """Called with :attr:`run_id` when the tracker creates its run after the sink was made (MLflow on
    a tracking server, at its first write): :func:`~rlmetrics.sinks.make_sinks` saves the id then."""
    closed: bool = False
    _alerted: set | None = None

    @classmethod
    def in_folder(cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str) -> Sink:
        """The sink :func:`~rlmetrics.sinks.make_sinks` makes in its run folder ``out_dir``;
        ``resume``: False (a new run), True (continue what is in ``out_dir``) or the id of the
        tracker's run to continue (:func:`resume_id`)."""
        raise NotImplementedError(f"{cls.__name__} has no in_folder(), which make_sinks needs to make it")

    @property
    def takes_axes(self) -> bool:
        """It takes steps of other step axes (:meth:`log_axis`)."""
        return True

    def earlier_sessions(self) -> list[Path]:
        """The folders of this tracker run's earlier offline sessions (:attr:`rebuilds`)."""
        return []

    def replay_from(self, step: int) -> None:
        """The journal is about to give this resumed sink, which holds none of the run's steps
        (``resumed_at`` None), every record from ``step`` on (the base: nothing to do)."""

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
        """Write ``step`` of the step axis ``axis`` (:mod:`rlmetrics.axes`): the base writes each
        name under ``<axis>/`` at ``step`` (a series per name, its steps the axis's values); the skip
        of a resumed run is about ``train_step`` only (a sink with a ``log`` of its own gets them there)."""
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
        """The names of the health rules whose alerts may come (the base class ignores them; a
        counter per rule starts at 0 from them)."""

    def alert(self, alert: Alert) -> None:
        """Write a health alert of a step this sink logged: :meth:`write_alert`, once per
        :meth:`alert_key` (a resumed sink reads the keys its files hold)."""
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
        """ValueError if the sink is closed."""
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
        """Whether the alert ``key`` was not written yet (in this session, or before a resume when
        the sink read its files); recorded as written once the ``with`` block ends without an error
        (a write that failed is retried)."""
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
    """A sink around a tracker's run object with ``run.log(dict, step=...)`` (W&B, SwanLab, trackio):
    a step is one ``run.log`` call, its histograms as :meth:`media` makes them (the base: none) and
    its texts as :meth:`text` makes them; ``close()`` runs ``run.finish()`` once."""

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
        """The tracker's object for a text (the base: the string: a column of W&B's and trackio's
        run table, no media file per step)."""
        return text

    @property
    def run_id(self) -> str:
        """The tracker's id of the run (what ``resume=`` takes to continue it)."""
        return self.run.id

    def finish(self) -> None:
        self.run.finish()


def resume_id(resume: bool | str) -> str | None:
    """The tracker run id that :meth:`Sink.in_folder`'s ``resume`` names (None: a new run or none saved)."""
    return resume if isinstance(resume, str) else None
