"""What every sink shares: metric-name adaptation per tracker, float values, the ``Sink`` base.

Trackers restrict metric names; rlmetrics names (``val-core/gsm8k/acc/mean@4``, ``pass@k``) must
reach each of them readable, never as a path outside the run directory, and never two names onto
one series. :func:`adapt_name` is the pure rule; :class:`NameMap` adds collision handling and is what
the sinks use.

============  ==================================================================================
tracker       what changes (in this order)
============  ==================================================================================
jsonl         nothing (names are JSON strings, never paths)
console       nothing (printed as plain text, rich markup is not interpreted)
tensorboard   *path-safe*: control characters and lone surrogates → ``_``; empty segments dropped
              (``/abs/x`` → ``abs/x``, ``a//b`` → ``a/b``); segments made of dots → as many ``_``
              (``../../x`` → ``__/__/x``); leading/trailing spaces and dots → ``_``; ``""`` → ``_``.
              ``@`` and everything else stay (tags are free strings in the event file)
wandb         path-safe; a leading ``_`` becomes ``metric_`` (``_step``/``_runtime``/``_timestamp``
              are W&B's own keys); collisions are checked case-insensitively (W&B metric names are)
mlflow        path-safe; ``@`` → ``_at_`` (``mean@4`` → ``mean_at_4``); any other character outside
              MLflow's set (letters, digits, ``_ - . space : /``) → ``_``; at most 250 characters
swanlab       path-safe (SwanLab itself would silently strip leading/trailing ``.`` and ``/``); at
              most 512 characters
============  ==================================================================================

A name longer than the tracker's limit keeps its head and ends with ``-`` and 8 hex digits of a hash
of the full name, so long names stay distinct. Two different names that adapt to the same string do
not share a series: the first one seen keeps the adapted name, later ones get ``__2``, ``__3`` … and
one warning each; a :class:`NameMap` keeps its mapping for the life of the sink, so every name maps
to the same series at every step.

>>> adapt_name("val-core/math/acc/mean@4", "mlflow")
'val-core/math/acc/mean_at_4'
>>> adapt_name("val-core/math/acc/mean@4", "tensorboard")
'val-core/math/acc/mean@4'
>>> adapt_name("../../escape", "swanlab"), adapt_name("/abs/x", "wandb"), adapt_name("_step", "wandb")
('__/__/escape', 'abs/x', 'metric_step')
>>> names = NameMap("mlflow")
>>> names("pass@k"), names("pass_at_k"), names("pass@k")
('pass_at_k', 'pass_at_k__2', 'pass_at_k')
"""

from __future__ import annotations

import hashlib
import logging
import operator
import re
from collections.abc import Mapping
from typing import Any

from rlmetrics.health import Alert

logger = logging.getLogger(__name__)

TRACKERS = ("jsonl", "console", "tensorboard", "wandb", "mlflow", "swanlab")
_MAX_LEN = {"mlflow": 250, "swanlab": 512}
_CONTROL = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
_MLFLOW_BAD = re.compile(r"[^\w/.\- :]")  # the complement of MLflow's own check (str patterns: \w is Unicode)
_EDGE_HEAD = re.compile(r"^[ .]+")
_EDGE_TAIL = re.compile(r"[ .]+$")


def _underscores(m: re.Match) -> str:
    return "_" * len(m.group())


def _path_safe(name: str) -> str:
    name = _CONTROL.sub("_", name)
    segments = ["_" * len(s) if s.strip(".") == "" else s for s in name.split("/") if s]
    name = "/".join(segments)
    name = _EDGE_TAIL.sub(_underscores, _EDGE_HEAD.sub(_underscores, name))
    return name or "_"


def _fit(name: str, limit: int | None) -> str:
    if limit is None or len(name) <= limit:
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return name[: limit - 9] + "-" + digest


def adapt_name(name: str, tracker: str) -> str:
    """``name`` as ``tracker`` gets it (the table above); pure, without collision handling.

    >>> adapt_name("response/length/p95", "mlflow"), adapt_name("a\\tb", "tensorboard")
    ('response/length/p95', 'a_b')
    """
    if tracker not in TRACKERS:
        raise ValueError(f"unknown tracker {tracker!r}; known: {', '.join(TRACKERS)}")
    if tracker in ("jsonl", "console"):
        return name
    name = _path_safe(name)
    if tracker == "wandb" and name.startswith("_"):
        name = "metric" + name
    elif tracker == "mlflow":
        name = _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))
    return _fit(name, _MAX_LEN.get(tracker))


class NameMap:
    """Adapted names for one sink: stable per name, never two names on one series (see above)."""

    def __init__(self, tracker: str) -> None:
        adapt_name("", tracker)  # validates the tracker
        self.tracker = tracker
        self._fold = str.lower if tracker == "wandb" else str
        self._names: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, name: str) -> str:
        adapted = self._names.get(name)
        if adapted is not None:
            return adapted
        adapted = candidate = adapt_name(name, self.tracker)
        k = 1
        while self._fold(candidate) in self._taken:
            k += 1
            candidate = _fit(f"{adapted}__{k}", _MAX_LEN.get(self.tracker))
        if k > 1:
            logger.warning(
                "%s: metric %r adapts to %r, already used by another metric; logged as %r",
                self.tracker,
                name,
                adapted,
                candidate,
            )
        self._names[name] = candidate
        self._taken.add(self._fold(candidate))
        return candidate

    def adapt(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """``{adapted name: value}``."""
        return {self(name): value for name, value in metrics.items()}


def as_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{name: float(value)}``; a name that is not a str or a value that is not a real number raises.

    >>> as_floats({"a": 1, "b": True})
    {'a': 1.0, 'b': 1.0}
    >>> as_floats({"a": "x"})
    Traceback (most recent call last):
    ...
    TypeError: metric 'a': value 'x' is not a real number
    """
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names must be str, got {name!r}")
        if isinstance(value, (str, bytes)):
            raise TypeError(f"metric {name!r}: value {value!r} is not a real number")
        try:
            out[name] = float(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"metric {name!r}: value {value!r} is not a real number") from exc
    return out


def histograms_of(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~rlmetrics.histogram.Histogram` s of a logged step (a
    :class:`~rlmetrics.StepResult`'s ``histograms``; none for a plain mapping)."""
    return dict(getattr(metrics, "histograms", None) or {})


def axis_names(metrics: Mapping[str, float], axis: str) -> dict[str, float]:
    """``metrics`` of a step of ``axis`` (:mod:`rlmetrics.axes`) as a tracker without step axes
    logs them: each name under ``<axis>/``.

    >>> axis_names({"reward/mean": 0.5}, "policy_version")
    {'policy_version/reward/mean': 0.5}
    """
    return {f"{axis}/{name}": value for name, value in metrics.items()}


def as_step(step: Any) -> int:
    """The step as an int (``bool`` and floats are refused)."""
    if isinstance(step, bool):
        raise TypeError(f"step must be an int, got {step!r}")
    return operator.index(step)


class Sink:
    """Base of the sinks: ``log(metrics, step)``, ``alert(alert)``, ``close()`` and a context manager.

    ``resumed_at``: the last step the tracker held when this sink was opened to continue a run (None:
    nothing to skip); ``log`` skips every step up to it (:meth:`skips`), so a driver restarted from an
    older training checkpoint never writes a step twice, nor a lower step after a higher one.
    """

    resumed_at: int | None = None
    _alerted: set | None = None

    def log(self, metrics: Mapping[str, float], step: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def log_axis(self, metrics: Mapping[str, float], step: int, axis: str) -> None:
        """Log ``step`` of the step axis ``axis`` (:mod:`rlmetrics.axes`). The base class logs
        :func:`axis_names` at ``step`` (a series per name, its steps the axis's values: TensorBoard,
        MLflow, SwanLab, the console); the skip of a resumed run is about ``train_step`` only."""
        resumed, self.resumed_at = self.resumed_at, None
        try:
            self.log(axis_names(metrics, axis), step)
        finally:
            self.resumed_at = resumed

    def alert(self, alert: Alert) -> None:
        """Write a health alert of a step this sink logged (the base class ignores it)."""

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def skips(self, step: int) -> bool:
        """``step`` was logged before this sink resumed the run."""
        return self.resumed_at is not None and step <= self.resumed_at

    def new_alert(self, key: Any) -> bool:
        """The alert ``key`` (what identifies an alert in this sink's files) was not written yet
        (in this session, or before a resume when the sink read its files); it is now recorded."""
        if self._alerted is None:
            self._alerted = set()
        if key in self._alerted:
            return False
        self._alerted.add(key)
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunSink(Sink):
    """A sink around a tracker's run object with ``run.log(dict, step=...)`` (W&B, SwanLab): names
    adapted for ``tracker``; ``close()`` runs :meth:`finish` once. A step's histograms go in the same
    ``run.log`` call, as :meth:`media` makes them (the base: none, the tracker has no histogram)."""

    def __init__(self, tracker: str, run: Any) -> None:
        self.names = NameMap(tracker)
        self.run = run
        self._open = True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._open:
            raise ValueError(f"{self!r} is closed")
        step = as_step(step)
        values: dict[str, Any] = self.names.adapt(as_floats(metrics))
        if not self.skips(step):
            for name, histogram in histograms_of(metrics).items():
                media = self.media(histogram)
                if media is not None:
                    values[self.names(name)] = media
            self.run.log(values, step=step)

    def media(self, histogram: Any) -> Any:
        """The tracker's object for a :class:`~rlmetrics.histogram.Histogram` (None: not logged)."""
        return None

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
