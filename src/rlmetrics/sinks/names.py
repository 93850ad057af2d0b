"""What every sink shares: the mechanics of metric-name adaptation (docs/trackers.md), float values, steps.

>>> path_safe("../../escape"), path_safe("/abs//x"), path_safe(".hidden.")
('__/__/escape', 'abs/x', '_hidden_')
>>> from rlmetrics.sinks import MLflowSink
>>> names = NameMap(MLflowSink)
>>> names("pass@k"), names("pass_at_k"), names("pass@k")
('pass_at_k', 'pass_at_k__2', 'pass_at_k')
"""

from __future__ import annotations

import hashlib
import logging
import operator
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlmetrics.messages import MAX_STEP

if TYPE_CHECKING:
    from rlmetrics.sinks.base import Sink

logger = logging.getLogger(__name__)

_CONTROL = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
_EDGE_HEAD = re.compile(r"^[ .]+")
_EDGE_TAIL = re.compile(r"[ .]+$")


def _underscores(m: re.Match) -> str:
    return "_" * len(m.group())


def path_safe(name: str) -> str:
    """``name`` as no file path (docs/trackers.md; lone surrogates → ``_`` too, ``""`` → ``_``)."""
    name = _CONTROL.sub("_", name)
    segments = ["_" * len(s) if s.strip(".") == "" else s for s in name.split("/") if s]
    name = "/".join(segments)
    name = _EDGE_TAIL.sub(_underscores, _EDGE_HEAD.sub(_underscores, name))
    return name or "_"


def fit(name: str, limit: int | None) -> str:
    """``name``, or past ``limit`` characters (None: no limit) its head, ``-`` and 8 hex digits of its hash.

    >>> fit("x" * 20, 16), fit("x" * 20, None) == "x" * 20
    ('xxxxxxx-111cb193', True)
    """
    if limit is None or len(name) <= limit:
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return name[: limit - 9] + "-" + digest


class NameMap:
    """The adapted names of one sink (``rules``: its class), never two on one series; ``limit`` names checked.

    >>> class Rules:
    ...     tracker, name_limit, case_insensitive_names = "demo", None, False
    ...     adapt_name = staticmethod(lambda name: name.replace("@", "_at_"))
    >>> names = NameMap(Rules, limit=2)
    >>> names("acc@4"), names("acc_at_4"), names("c"), len(names._names)
    ('acc_at_4', 'acc_at_4__2', 'c', 2)
    """

    def __init__(self, rules: type[Sink], limit: int = 100_000) -> None:
        self.rules, self.limit = rules, limit
        self._fold = str.lower if rules.case_insensitive_names else str
        self._names: dict[str, str] = {}
        self._taken: set[str] = set()
        self._full = False  # said once: the names past the limit are not checked

    def __call__(self, name: str) -> str:
        adapted = self._names.get(name)
        if adapted is not None:
            return adapted
        if len(self._names) >= self.limit:
            if not self._full:
                self._full = True
                logger.warning(
                    "%s: more than %d metric names in this run; later new names are not checked for "
                    "collisions (two names that adapt alike may share one series)",
                    self.rules.tracker,
                    self.limit,
                )
            return self.rules.adapt_name(name)
        adapted = candidate = self.rules.adapt_name(name)
        k = 1
        while self._fold(candidate) in self._taken:
            k += 1
            candidate = fit(f"{adapted}__{k}", self.rules.name_limit)
        if k > 1:
            logger.warning(
                "%s: metric %r adapts to %r, already used by another metric; logged as %r",
                self.rules.tracker,
                name,
                adapted,
                candidate,
            )
        self._names[name] = candidate
        self._taken.add(self._fold(candidate))
        return candidate

    def reserve(self, *adapted: str) -> None:
        """Take the names ``adapted`` for the sink's own series (a metric adapting to one gets ``__2``)."""
        self._taken.update(map(self._fold, adapted))

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
    """The histograms of a logged step (a :class:`~rlmetrics.StepResult`'s; none for a mapping)."""
    return dict(getattr(metrics, "histograms", None) or {})


def axis_names(metrics: Mapping[str, float], axis: str) -> dict[str, float]:
    """``metrics`` of a step of ``axis`` as a tracker without step axes logs them: under ``<axis>/``.

    >>> axis_names({"reward/mean": 0.5}, "policy_version")
    {'policy_version/reward/mean': 0.5}
    """
    return {f"{axis}/{name}": value for name, value in metrics.items()}


def as_step(step: Any) -> int:
    """The step as an int in ``[0, MAX_STEP]`` (``bool``, floats and None are refused, naming it).

    >>> as_step(-1)
    Traceback (most recent call last):
    ...
    ValueError: step must be an int in [0, 9007199254740992], got -1
    """
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, got {step!r:.40}") from None
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step}")
    return step


def lists_of(metrics: Mapping[str, Any]) -> dict[str, list[str]]:
    """The lists of names of a logged step (a :class:`~rlmetrics.StepResult`'s; none for a mapping)."""
    return {k: list(v) for k, v in (getattr(metrics, "lists", None) or {}).items()}


def texts_of(metrics: Mapping[str, Any]) -> dict[str, str]:
    """:func:`lists_of` as the text a tracker shows, the names joined by ``", "``."""
    return {k: ", ".join(v) for k, v in lists_of(metrics).items()}
