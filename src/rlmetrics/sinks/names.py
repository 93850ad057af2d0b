"""What every sink shares: metric-name adaptation per tracker, float values, steps.

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
