"""Sinks of step results: JSONL, console, TensorBoard, W&B, MLflow, SwanLab, trackio, ClearML, Prometheus.

Over 400 lines on purpose: ``Tracking`` and ``make_sinks`` decide together what a resumed or rerun
folder holds. docs/trackers.md.

>>> import tempfile
>>> out = tempfile.mkdtemp()
>>> with make_sinks(["jsonl"], out) as tracking:
...     for step in range(3):
...         tracking.log({"critic/score/mean": step / 2}, step)
>>> read_jsonl(f"{out}/metrics.jsonl").series("critic/score/mean")[1]
array([0. , 0.5, 1. ])
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rlmetrics.globs import did_you_mean
from rlmetrics.health import Alert, Monitor, coverage_metrics, rule_name
from rlmetrics.messages import DEFAULT_AXIS, StepResult
from rlmetrics.sinks.base import Sink, resume_id
from rlmetrics.sinks.clearml import ClearMLSink
from rlmetrics.sinks.console import ConsoleSink, format_value, render_table, summary_table
from rlmetrics.sinks.jsonl import JsonlRun, JsonlSink, read_jsonl, record_result, run_config
from rlmetrics.sinks.keys import CORE_KEYS, LIMITS, OVERVIEW, KeyLimits, KeyView
from rlmetrics.sinks.mlflow import MLflowSink
from rlmetrics.sinks.names import NameMap, as_floats, as_step, axis_names
from rlmetrics.sinks.prometheus import PROMETHEUS_PORT, PrometheusSink
from rlmetrics.sinks.swanlab import SwanLabSink
from rlmetrics.sinks.tensorboard import TensorBoardSink
from rlmetrics.sinks.trackio import TrackioSink
from rlmetrics.sinks.wandb import WandbSink
from rlmetrics.sinks.writer import Task, Writer

logger = logging.getLogger(__name__)

TRACKERS: dict[str, type[Sink]] = {
    sink.tracker: sink
    for sink in (
        JsonlSink, ConsoleSink, TensorBoardSink, WandbSink, MLflowSink, SwanLabSink, TrackioSink, ClearMLSink,
        PrometheusSink,
    )
}  # fmt: skip
"""Tracker name → its sink class, which declares the tracker's name rules (:class:`Sink`)."""


def adapt_name(name: str, tracker: str) -> str:
    """``name`` as ``tracker`` gets it (docs/trackers.md, "Metric names per tracker").

    Without :class:`NameMap`'s handling of two names that adapt to one.

    Args:
        name: a metric name.
        tracker: a tracker name, a key of :data:`TRACKERS` (``"mlflow"``, ``"wandb"``, ...).

    Returns:
        The name the tracker gets: its characters mapped, cut to the tracker's length limit.

    Raises:
        ValueError: an unknown ``tracker``.

    Example:
    >>> name = "val-core/math/acc/mean@4"
    >>> adapt_name(name, "mlflow"), adapt_name(name, "tensorboard")
    ('val-core/math/acc/mean_at_4', 'val-core/math/acc/mean@4')
    >>> adapt_name("../../escape", "swanlab"), adapt_name("_step", "wandb"), adapt_name("a\\tb", "jsonl")
    ('__/__/escape', 'metric_step', 'a\\tb')
    """
    if tracker not in TRACKERS:
        raise ValueError(f"unknown tracker {tracker!r}; known: {', '.join(TRACKERS)}")
    return TRACKERS[tracker].adapt_name(name)


class Tracking(Sink):
    """Each step to every one of ``sinks`` (the journal first, the trackers from threads), with the
    ``health`` rules, ``meta/*`` and each tracker's ``keys`` view (docs/trackers.md)."""

    def __init__(
        self,
        sinks: Iterable[Sink],
        health: Monitor | bool | None = True,
        *,
        keys: str | Sequence[str] = "all",
        core: Sequence[str] = CORE_KEYS,
        overview: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        close_timeout: float = 60.0,
        queue: int = 1000,
        retry: tuple[float, float] = (1.0, 60.0),
    ) -> None:
        self.sinks = list(sinks)
        self.failed: dict[int, BaseException] = {}  # index in ``sinks`` → the exception that disabled it
        self.journal = next((s for s in self.sinks if isinstance(s, JsonlSink)), None)
        if not (isinstance(close_timeout, (int, float)) and 0 <= close_timeout < math.inf):
            raise ValueError(
                f"close_timeout={close_timeout!r}: the seconds close() waits for the trackers, >= 0"
            )
        self.close_timeout = close_timeout
        options = {"bound": queue, "retry": retry[0], "most": retry[1], "journal": self.journal is not None}
        self.writers = {
            i: Writer(
                _name(s),
                partial(self._refill, i),
                transient=s.transient,
                fatal=partial(self._fatal, i),
                **options,
            )  # fmt: skip
            for i, s in enumerate(self.sinks)
            if s.background
        }
        # the journal first: a tracker behind reads back steps the journal holds
        self._order = sorted(range(len(self.sinks)), key=lambda i: self.sinks[i] is not self.journal)
        self._left: dict[int, list[tuple[str, int]]] | None = None  # what the queues could not deliver
        if self.writers:  # registered after the sinks: it runs before their trackers' exit hooks (W&B's)
            self._exit_hook = partial(_at_exit, weakref.ref(self))
            atexit.register(self._exit_hook)
        # (sink, axis) → the journal's last step queued to it (catch_up)
        self._caught_up: dict[tuple[int, str], int] = {}
        self._journal_down = False
        self.health = Monitor() if health is True else (health or None)
        if self.health is not None:
            for sink in self.sinks:
                sink.expect_alerts([rule_name(rule) for rule in self.health.rules])
        if overview is None:
            overview = not isinstance(keys, str)
        self.view = KeyView(keys, core, overview=overview)
        self.limits = {
            i: KeyLimits(t, clock=clock)
            for i, s in enumerate(self.sinks)
            if (t := getattr(s, "tracker", None)) in LIMITS
        }
        self._views: tuple[Any, dict[bool, Mapping[str, float]]] = (None, {})  # the last step's views
        self._logged: set[tuple[str, int]] = set()  # (axis, step) given to log() or log_axis()
        self._closed = False

    @property
    def active(self) -> list[Sink]:
        """The sinks still receiving steps."""
        return [s for i, s in enumerate(self.sinks) if i not in self.failed]

    @property
    def resumed_at(self) -> int | None:
        """The last step every resumed sink holds (None: nothing resumed)."""
        steps = [
            self._caught_up.get((i, DEFAULT_AXIS), s.resumed_at)
            for i, s in enumerate(self.sinks)
            if i not in self.failed
        ]
        return min((s for s in steps if s is not None), default=None)

    @property
    def undelivered(self) -> dict[str, list[int]]:
        """Tracker name → the train steps its queue could not deliver by :meth:`close` (empty before)."""
        return {
            _name(self.sinks[i]): [s for axis, s in left if axis == DEFAULT_AXIS]
            for i, left in (self._left or {}).items()
        }

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log train step ``step`` to every active sink, the journal first (docs/trackers.md, "Sinks").

        Args:
            metrics: a :class:`~rlmetrics.StepResult` (its ``meta``, histograms and lists go too) or a
                mapping of name → number.
            step: the train step; a step logged already is skipped, with a logged warning.

        Raises:
            ValueError: the Tracking is closed.
            TypeError: a name that is not a str, a value that is no real number, a step that is no int.

        Example:
        >>> import tempfile
        >>> from rlmetrics.sinks import make_sinks, read_jsonl
        >>> out = tempfile.mkdtemp()
        >>> tracking = make_sinks(["jsonl"], out)
        >>> tracking.log({"critic/score/mean": 0.5}, step=0)
        >>> tracking.log({"critic/score/mean": 0.7}, step=0)  # skipped: step 0 is logged already
        >>> tracking.close()
        >>> read_jsonl(f"{out}/metrics.jsonl").series("critic/score/mean")
        (array([0]), array([0.5]))
        """
        if self._closed:
            raise ValueError("Tracking is closed")
        values = as_floats(metrics)
        step = as_step(step)
        if self._repeated(DEFAULT_AXIS, step):
            return
        meta = getattr(metrics, "meta", None)
        values.update(coverage_metrics(meta))
        metrics = self._frozen(metrics, values, step)
        alerts = self.health.observe(step, metrics) if self.health is not None else []
        writing = [i for i in self._order if self._writes(i, step)]
        if not writing:
            return
        for alert in alerts:
            logger.warning("health alert: %s", alert)
        for i in writing:
            self._write(i, metrics, step, alerts)
        if self.health is not None and self.health.on_alert is not None:
            for alert in alerts:
                self.health.on_alert(alert)

    def log_axis(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        """Log ``step`` of the step axis ``axis`` (:mod:`rlmetrics.axes`) to every active sink."""
        if axis == DEFAULT_AXIS:
            return self.log(metrics, step)
        if self._closed:
            raise ValueError("Tracking is closed")
        values = as_floats(metrics)
        step = as_step(step)
        if self._repeated(axis, step):
            return
        meta = getattr(metrics, "meta", None)
        values.update(coverage_metrics(meta))
        result = StepResult(values, step, meta)
        for i in self._order:
            sink = self.sinks[i]
            if i not in self.failed and step > self._caught_up.get((i, axis), -1):
                self._send(
                    i, axis, step, partial(sink.log_axis, self._viewed(i, result, copies=False), step, axis)
                )

    def _repeated(self, axis: str, step: int) -> bool:
        """``step`` of ``axis`` was logged already: warned about, to be skipped; else recorded."""
        if (axis, step) not in self._logged:
            self._logged.add((axis, step))
            return False
        where = "" if axis == DEFAULT_AXIS else f" of axis {axis!r}"
        logger.warning(
            "step %d%s is logged already: this log() is skipped and the trackers keep its first values "
            "(a retried iteration, or a step read twice?); log each step once",
            step,
            where,
        )
        return True

    def write(
        self, sink: Sink, metrics: Mapping[str, float], step: int, alerts: Sequence[Alert] = ()
    ) -> None:
        """``alerts``, then ``metrics``, to ``sink``, without :meth:`log`'s checks: a step's later calls."""
        i = self.sinks.index(sink)
        if self._writes(i, step):
            self._write(i, self._frozen(metrics, as_floats(metrics), step), step, alerts)

    def _writes(self, i: int, step: int) -> bool:
        """Sink ``i`` is active and did not hold ``step`` before a resume."""
        return (
            i not in self.failed
            and not self.sinks[i].skips(step)
            and step > self._caught_up.get((i, DEFAULT_AXIS), step - 1)
        )

    @staticmethod
    def _frozen(metrics: Mapping[str, float], values: dict[str, float], step: int) -> StepResult:
        """``metrics`` with ``values``, a copy its caller cannot change (a tracker may write it later)."""
        get = partial(getattr, metrics)
        return StepResult(values, step, get("meta", None), get("histograms", None), get("lists", None))

    def _write(self, i: int, metrics: Mapping[str, float], step: int, alerts: Sequence[Alert]) -> None:
        """The step's alerts, then the step, to sink ``i`` (the alerts first: docs/resume.md)."""
        metrics = self._viewed(i, metrics)
        if i in self.limits:  # the rate the run logs at, whenever the tracker gets the steps
            self.limits[i].observe(metrics)
        self._send(i, DEFAULT_AXIS, step, partial(_deliver, self.sinks[i], metrics, step, alerts))

    def _fatal(self, i: int, exc: BaseException, task: Task) -> None:
        """Sink ``i``'s writer met an error that is not transient: the sink is disabled."""
        self.failed[i] = exc
        where = (
            f" (they are in {self.journal.path}: once it is fixed, make_sinks(..., resume=True) on that "
            "folder catches it up)"
            if self.journal is not None
            else ""
        )
        logger.error("sink %r failed at %s %d and is disabled: %r; the steps of its queue are not written%s",
                     self.sinks[i], task.axis, task.step, exc, where, exc_info=exc)  # fmt: skip

    def _send(self, i: int, axis: str, step: int, call: Callable[[], object]) -> None:
        """Make sink ``i``'s ``call`` in its writer or now (one that raises is disabled, but the journal)."""
        if i in self.writers:
            return self.writers[i].put(axis, step, call)
        sink = self.sinks[i]
        where = f"step {step}" if axis == DEFAULT_AXIS else f"{axis} {step}"
        try:
            call()
        except Exception as exc:
            if sink is not self.journal:
                self.failed[i] = exc
                logger.error("sink %r failed at %s and is disabled: %r", sink, where, exc, exc_info=exc)
            elif not self._journal_down:
                self._journal_down = True
                logger.error(
                    "the journal %r failed at %s: %r; it is tried again at each step", sink, where, exc
                )
            return
        if sink is self.journal and self._journal_down:
            self._journal_down = False
            logger.warning("the journal %r writes again from %s", sink, where)

    def _refill(self, i: int, steps: list[tuple[str, int]]) -> list[Task]:
        """Sink ``i``'s tasks for ``steps`` (``(axis, step)``), read back from the journal."""
        if self.journal is None:
            return []
        records, alerts = _journal(self.journal.path)
        sink, tasks = self.sinks[i], []
        for axis, step in steps:
            if (axis, step) not in records:
                continue
            result = record_result(records[axis, step])
            if axis == DEFAULT_AXIS:
                call = partial(
                    _deliver, sink, self._viewed(i, result, cache=False), step, alerts.get(step, [])
                )
            else:
                call = partial(sink.log_axis, self._viewed(i, result, copies=False, cache=False), step, axis)
            tasks.append(Task(axis, step, call))
        return tasks

    def _viewed(
        self, i: int, metrics: Mapping[str, float], copies: bool = True, cache: bool = True
    ) -> Mapping[str, float]:
        """What sink ``i`` gets of ``metrics``; ``cache``: on the caller's thread, not a writer's."""
        sink = self.sinks[i]
        if sink.all_keys:
            return metrics
        copies = copies and sink.overview_copies
        if not cache:
            return self.view(metrics, copies=copies)
        if self._views[0] is not metrics:  # one view per step and kind, whatever the number of sinks
            self._views = (metrics, {})
        made = self._views[1]
        if copies not in made:
            made[copies] = self.view(metrics, copies=copies)
        return made[copies]

    def catch_up(self, journal: JsonlSink, sinks: Iterable[Sink]) -> None:
        """Log to each of ``sinks`` the journal's steps it lacks, then resume it after the journal's last."""
        if journal.resumed_at is None:
            return
        records, alerts = _journal(journal.path)
        first = min((step for _, step in records), default=0)
        for sink in sinks:
            i, whole = self.sinks.index(sink), sink.resumed_at is None
            if whole:
                sink.replay_from(first)
            else:  # its names as its earlier sessions adapted them, before any step is queued
                sink.row(self._viewed(i, _first_seen(records), cache=False), 0)
            for (axis, step), record in records.items():
                if axis == DEFAULT_AXIS:
                    self.write(sink, record_result(record), step, alerts.get(step, []))
                elif whole and sink.takes_axes and i not in self.failed:
                    viewed = self._viewed(i, record_result(record), copies=False, cache=False)
                    self._send(i, axis, step, partial(sink.log_axis, viewed, step, axis))
                    self._caught_up[i, axis] = max(step, self._caught_up.get((i, axis), -1))
            # later steps: after the journal's (its own resumed_at stays: a writer may still deliver)
            held = -1 if sink.resumed_at is None else sink.resumed_at
            self._caught_up[i, DEFAULT_AXIS] = max(journal.resumed_at, held)

    def close(self) -> None:
        """Deliver the trackers' queues, then close every sink (docs/trackers.md, "A tracker that is down").

        The queues get ``close_timeout`` seconds in all; a tracker still behind is named in
        :attr:`undelivered` and a logged error, and not closed. A second call does nothing.

        Example:
        >>> import tempfile
        >>> from rlmetrics.sinks import make_sinks
        >>> tracking = make_sinks(["jsonl"], tempfile.mkdtemp())
        >>> tracking.close()
        >>> tracking.undelivered, tracking.failed
        ({}, {})
        >>> tracking.log({"critic/score/mean": 0.5}, step=0)
        Traceback (most recent call last):
        ...
        ValueError: Tracking is closed
        """
        if self._closed:
            return
        self._closed = True
        for glob in self.view.unmatched():
            hint = did_you_mean(self.view.seen, [glob]) or " (a typo?)"
            logger.warning("keys: the glob %r matched no key of this run%s", glob, hint)
        left = self._deliver_queues("close()")
        for i, sink in enumerate(self.sinks):
            if i in left:  # not closed: its close would wait on what holds the steps
                continue
            try:
                sink.close()  # on the caller's thread (SwanLab's finish sets a signal handler)
            except Exception as exc:
                logger.error("sink %r failed to close: %r", sink, exc, exc_info=exc)

    def _deliver_queues(self, when: str) -> dict[int, list[tuple[str, int]]]:
        """Let the trackers' threads deliver their queues, ``close_timeout`` s in all, once; what's left."""
        if self._left is None:
            if self.writers:
                atexit.unregister(self._exit_hook)
            deadline = time.monotonic() + self.close_timeout
            for i, writer in self.writers.items():
                writer.finish()
                if writer.down:
                    logger.warning(
                        "tracker %s is down with %d steps to deliver: %s waits up to %g s for it",
                        _name(self.sinks[i]), len(writer.pending()), when, self.close_timeout,
                    )  # fmt: skip
            left = {i: w.join(deadline - time.monotonic()) for i, w in self.writers.items()}
            self._left = {i: steps for i, steps in left.items() if steps}
            for i, steps in self._left.items():
                self._report_undelivered(self.sinks[i], steps, when)
        return self._left

    def _report_undelivered(self, sink: Sink, left: list[tuple[str, int]], when: str) -> None:
        steps = [s for _, s in left]
        where = (
            f"; they are in {self.journal.path}: make_sinks(..., resume=True) on that folder catches it up"
            if self.journal is not None
            else ""
        )
        logger.error(
            "tracker %s: %d steps (%d to %d) not delivered %g s after %s (down or slow), and it is "
            "not closed%s",
            _name(sink), len(steps), steps[0], steps[-1], self.close_timeout, when, where,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"Tracking({self.sinks!r})"


def _journal(path: Path) -> tuple[dict[tuple[str, int], dict], dict[int, list[Alert]]]:
    """A JSONL file's last record of each ``(axis, step)``, and its alerts by step."""
    run = read_jsonl(path)
    records = {(r.get("axis", DEFAULT_AXIS), r["step"]): r for r in run.records + run.axis_records}
    alerts: dict[int, list[Alert]] = {}
    for e in run.events:
        alerts.setdefault(e["step"], []).append(Alert(step=e["step"], **e["event"]))
    return records, alerts


def _first_seen(records: Mapping[tuple[str, int], dict]) -> StepResult:
    """Every name of the journal's ``records`` (an axis's under ``<axis>/``), in the order they first came."""
    merged: dict[str, dict] = {"metrics": {}, "histograms": {}, "lists": {}}
    for (axis, _), record in records.items():
        for part, names in merged.items():
            got = record.get(part) or {}
            for name, value in (got if axis == DEFAULT_AXIS else axis_names(got, axis)).items():
                names.setdefault(name, 0.0 if part == "metrics" else value)
    return record_result({"step": 0, **merged})


def _name(sink: Sink) -> str:
    return getattr(sink, "tracker", type(sink).__name__)


def _deliver(sink: Sink, metrics: Mapping[str, float], step: int, alerts: Sequence[Alert]) -> None:
    for alert in alerts:
        sink.alert(alert)
    sink.log(metrics, step)


def _at_exit(ref: weakref.ref) -> None:
    """At the process's exit, deliver what the queues of a ``Tracking`` never closed hold."""
    tracking = ref()
    if tracking is not None:
        tracking._deliver_queues("the process's exit")


SINKS: dict[str, Callable[..., Sink]] = {name: sink.in_folder for name, sink in TRACKERS.items()}
"""Sink name → the factory :func:`make_sinks` calls (:meth:`Sink.in_folder`)."""

RUN_IDS = "run_ids.json"
"""The file of the run folder holding each tracker's run id (and :data:`WHOLE_JOURNAL`)."""

WHOLE_JOURNAL = "journal"
"""The key of :data:`RUN_IDS` listing the tracker runs ``metrics.jsonl`` holds whole (docs/resume.md)."""

RUN_FILES = (
    *(pattern for sink in TRACKERS.values() for pattern in sink.folder_files),
    RUN_IDS,
    "run_ids.tmp",
)
"""What :func:`make_sinks` writes in its folder (glob patterns)."""

CONFIG_SINKS = tuple(name for name, sink in TRACKERS.items() if sink.takes_config)
"""The sinks :func:`make_sinks` gives the run's ``config`` (the trackers that store one)."""

CATCH_UP = tuple(name for name, sink in TRACKERS.items() if sink.catches_up)
"""The sinks a resumed :func:`make_sinks` catches up from the JSONL file."""


def make_sinks(
    names: Sequence[str] | str,
    out_dir: str | os.PathLike,
    *,
    project: str = "rlmetrics",
    run_name: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    health: Monitor | bool | None = True,
    axes: bool = False,
    config: Any = None,
    keys: str | Sequence[str] = "all",
    core: Sequence[str] = CORE_KEYS,
    overview: bool | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Tracking:
    """A :class:`Tracking` over the sinks ``names`` in the run folder ``out_dir`` (docs/trackers.md,
    "Sinks"; resuming: docs/resume.md).

    Args:
        names: sink names (:data:`SINKS`), a list or one comma-separated str.
        out_dir: the run folder (created), which holds one run.
        project, run_name: the trackers' project and run name.
        resume: continue the folder's run (a folder holding none starts one).
        overwrite: replace the folder's run (its :data:`RUN_FILES` only).
        health, keys, core, overview: as :class:`Tracking` takes them.
        axes: the run logs other step axes too.
        config: the run's config, for the sinks of :data:`CONFIG_SINKS`.
        options: a sink's :meth:`~Sink.in_folder` keyword arguments, by sink name.

    Raises:
        FileExistsError: ``out_dir`` holds a run, and neither ``resume`` nor ``overwrite`` is given.
        ValueError, TypeError: a bad argument (before any file is made); a sink's own error when it
            cannot be created.

    Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from rlmetrics.sinks import make_sinks
    >>> out = Path(tempfile.mkdtemp())
    >>> make_sinks(["jsonl"], out).close()
    >>> make_sinks(["jsonl"], out)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileExistsError: ... holds a run (metrics.jsonl): pass resume=True to continue it, overwrite=True ...
    >>> with make_sinks(["jsonl"], out, overwrite=True) as tracking:
    ...     tracking.log({"critic/score/mean": 0.5}, step=0)
    >>> with make_sinks(["jsonl"], out, resume=True) as tracking:  # a restarted driver
    ...     tracking.resumed_at
    0
    """
    config = run_config(config)
    keys = KeyView(keys, core).keys  # a bad keys= or core= raises here, before any file
    if isinstance(names, str):
        names = names.split(",")
    wanted = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in wanted if n not in SINKS]
    if unknown:
        raise ValueError(f"unknown sink(s) {', '.join(map(repr, unknown))}; valid: {', '.join(SINKS)}")
    if resume and overwrite:
        raise ValueError("resume=True continues the run in out_dir, overwrite=True replaces it: pass one")
    out = Path(out_dir)
    held_before = bool(run_files(out))
    held = [] if resume else run_files(out)
    if held and not overwrite:
        raise FileExistsError(
            f"{out} holds a run ({', '.join(p.name for p in held)}): pass resume=True to continue it, "
            "overwrite=True to replace it, or use another folder"
        )
    aside = _set_aside(out, held)  # the replaced run, until the new one started
    out.mkdir(parents=True, exist_ok=True)
    ids_file = out / RUN_IDS
    ids = json.loads(ids_file.read_text()) if resume and ids_file.exists() else {}
    sinks: list[Sink] = []
    continuing = resume and held_before  # a first start: new runs
    journal = "jsonl" in wanted
    covered = ids.get(WHOLE_JOURNAL) if continuing else None  # the tracker runs the journal holds whole
    covered = set(covered) if isinstance(covered, list) else set()
    rebuilt: list[str] = []  # the sinks whose run the journal rebuilds
    kept: list[str] = []  # resumed in their folder as it is: not caught up
    try:
        for name in wanted:
            extra: dict[str, Any] = {"axes": True} if axes and name == "wandb" else {}
            extra.update((options or {}).get(name, {}))
            if config is not None and name in CONFIG_SINKS:
                extra["config"] = config
            run_id = ids.get(name, True) if continuing else False
            kind = TRACKERS[name]
            if kind.rebuilds and resume_id(run_id):
                if journal and name in covered:
                    rebuilt.append(name)
                else:
                    logger.warning(
                        "%s: the folder's metrics.jsonl does not hold the whole offline run %s (\"jsonl\" "
                        "was not among the sinks at each of its starts), so it cannot be rebuilt from it: "
                        "a new run continues from the steps logged now, and %s's folders stay as they are "
                        "(docs/resume.md: uploading it); with \"jsonl\" among the sinks, the next restart "
                        "continues the new run",
                        name, run_id, run_id,
                    )  # fmt: skip
                    run_id = True
            sinks.append(SINKS[name](out, project, run_name, run_id, **extra))
            if kind.folder_run and continuing and sinks[-1].held and not (journal and name in covered):
                kept.append(name)  # the journal lacks some of what it holds: it goes on as it is
                logger.warning(
                    "%s: the folder's metrics.jsonl does not hold the whole run (\"jsonl\" was not "
                    "among the sinks at each of its starts), so it is not rebuilt nor caught up from it: "
                    "it goes on as it is, and TensorBoard drops the points it holds from the first "
                    "train step logged now on (its restart semantics)",
                    name,
                )  # fmt: skip
    except BaseException:
        Tracking(sinks, health=None).close()
        if not resume:  # a run that never started leaves no run behind, and a replaced one comes back
            _remove(run_files(out))
            if aside is not None:
                for path in aside.iterdir():
                    os.replace(path, out / path.name)
                aside.rmdir()
        raise
    if aside is not None:
        shutil.rmtree(aside)
    ids.update({name: sink.run_id for name, sink in zip(wanted, sinks) if sink.run_id is not None})
    rebuilds = {n for n in wanted if TRACKERS[n].rebuilds}  # with jsonl: rebuilt, or new + caught up
    if ids or rebuilds:
        ids[WHOLE_JOURNAL] = sorted((covered | rebuilds) - set(kept) if journal else covered - rebuilds)
        _save_ids(ids_file, ids)
    for name, sink in zip(wanted, sinks):
        sink.on_run_id = partial(_save_run_id, ids_file, name)  # a run made later (a server was down)
        if name in rebuilt:
            _rebuild(name, sink)
    tracking = Tracking(sinks, health=health, keys=keys, core=core, overview=overview)
    if resume and "jsonl" in wanted:
        catching = [s for n, s in zip(wanted, sinks) if n in CATCH_UP and n not in kept]
        tracking.catch_up(sinks[wanted.index("jsonl")], catching)
    return tracking


def _save_ids(ids_file: Path, ids: Mapping[str, Any]) -> None:
    tmp = ids_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ids, indent=1))
    os.replace(tmp, ids_file)


def _save_run_id(ids_file: Path, name: str, run_id: str) -> None:
    """Add the id of ``name``'s run, created after :func:`make_sinks` returned, to :data:`RUN_IDS`."""
    ids = json.loads(ids_file.read_text()) if ids_file.exists() else {}
    _save_ids(ids_file, {**ids, name: run_id})


def _rebuild(name: str, sink: Sink) -> None:
    """Move the earlier sessions of ``sink``'s offline run into ``replaced/``, out of the uploader's way."""
    earlier = sink.earlier_sessions()
    for folder in earlier:
        (folder.parent / "replaced").mkdir(exist_ok=True)
        target, n = folder.parent / "replaced" / folder.name, 1
        while target.exists():  # a name the tracker gave again (a restart within the second)
            n += 1
            target = target.with_name(f"{folder.name}.{n}")
        os.replace(folder, target)
        logger.info("%s: %s set aside in replaced/: the run is rebuilt from metrics.jsonl", name, folder)
    for link in earlier[0].parent.iterdir() if earlier else ():  # the tracker's links into them (logs)
        if link.is_symlink() and not link.exists():
            link.unlink()


def _set_aside(out: Path, paths: list[Path]) -> Path | None:
    if not paths:
        return None
    aside = Path(tempfile.mkdtemp(prefix=".replaced-", dir=out))
    for path in paths:
        os.replace(path, aside / path.name)
    return aside


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def run_files(out_dir: str | os.PathLike) -> list[Path]:
    """The files and folders of the run :func:`make_sinks` wrote in ``out_dir`` (docs/trackers.md, "Sinks").

    Args:
        out_dir: a run folder (a missing one holds none).

    Returns:
        The paths matching :data:`RUN_FILES`, sorted; other files of the folder are not listed.

    Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from rlmetrics.sinks import make_sinks, run_files
    >>> out = Path(tempfile.mkdtemp())
    >>> _ = (out / "reward.png").write_bytes(b"")  # not a sink's file
    >>> run_files(out)
    []
    >>> make_sinks(["jsonl"], out).close()
    >>> [p.name for p in run_files(out)]
    ['metrics.jsonl']
    """
    out = Path(out_dir)
    return sorted({path for pattern in RUN_FILES for path in out.glob(pattern)})


def new_run_folder(out_dir: str | os.PathLike) -> Path:
    """A folder for a new run: ``out_dir`` or ``<out_dir>-2``, ``-3``, … (docs/trackers.md, "Sinks").

    Args:
        out_dir: the folder wanted.

    Returns:
        ``out_dir`` if it holds no run (:func:`run_files`), else the first of its numbered siblings
        holding none; not created.

    Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from rlmetrics.sinks import make_sinks, new_run_folder
    >>> out = Path(tempfile.mkdtemp()) / "demo"
    >>> new_run_folder(out) == out
    True
    >>> make_sinks(["jsonl"], out).close()
    >>> new_run_folder(out).name
    'demo-2'
    """
    base = folder = Path(out_dir)
    n = 1
    while run_files(folder):
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


__all__ = [
    "CORE_KEYS", "LIMITS", "OVERVIEW", "PROMETHEUS_PORT", "RUN_FILES", "RUN_IDS", "SINKS", "TRACKERS",
    "ClearMLSink", "ConsoleSink", "JsonlRun", "JsonlSink", "KeyLimits", "KeyView", "MLflowSink", "NameMap",
    "PrometheusSink", "Sink", "SwanLabSink", "TensorBoardSink", "TrackioSink", "Tracking", "WandbSink",
    "adapt_name", "format_value", "make_sinks", "new_run_folder", "read_jsonl", "render_table", "run_files",
    "summary_table",
]  # fmt: skip
