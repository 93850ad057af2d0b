"""Reductions (``MEAN``, ``MAX``, :func:`percentile`, ...), the name → reduction rules and their registry.

Also the seed's callables (``Metric``, ``MetricFunc``, ``MeanMetric``, ...). The rules:
docs/reductions.md, "Reductions from names".

>>> [resolve(n).name for n in ("critic/score/max", "actor/minibatch_loss", "perf/total_num_tokens",
...                            "custom/latency/p95", "val-core/minerva_math/acc/mean@16")]
['max', 'mean', 'sum', 'p95', 'mean']
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlmetrics.core.groups import GROUP_PREFIX, split_group_name
from rlmetrics.core.histogram import Histogram
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import Stat

_FIELDS_READ = {"count": (0,), "mean": (0, 1), "sum": (0, 1), "std": (0, 1, 2), "min": (0, 3), "max": (0, 4)}


@dataclass(frozen=True)
class Reduction:
    """How a merged Stat becomes one number: ``kind`` (``mean sum min max std count quantile hist``),
    ``q`` (a quantile's, in [0, 1]), ``name`` (the spec :func:`parse_reduction` reads).
    >>> MAX.apply(Stat.of([1.0, 5.0, 3.0]))
    5.0
    >>> s = Stat.of([1.0, 2.0, 3.0, 4.0], sketch=True)
    >>> percentile(50).apply(s), MEDIAN.apply(s)
    (2.5, 2.0)
    """

    name: str
    kind: str
    q: float | None = None

    @property
    def needs_sketch(self) -> bool:
        return self.kind in ("quantile", "hist")

    @property
    def histogram(self) -> bool:
        """Whether :meth:`apply` gives a histogram, not a number."""
        return self.kind == "hist"

    @property
    def quantile(self) -> bool:
        return self.kind == "quantile"

    def apply(self, stat: Stat) -> Any:
        """The value of a merged Stat (``nan`` without observations; a Histogram or None for ``hist``)."""
        if self.needs_sketch:
            if stat.sketch is None:
                raise ValueError(
                    f"reduction {self.name!r} needs a quantile sketch (Stat.of(..., sketch=True))"
                )
            if self.kind == "hist":
                return Histogram.of(stat)
            if self.name == "median":
                return float(stat.sketch.median())
            return float(stat.sketch.quantile(self.q))
        return float(self.apply_arrays(stat.to_array()[:, None])[0])

    @property
    def fields(self) -> tuple[int, ...]:
        """The rows of a stat array (:data:`~rlmetrics.core.stat.FIELDS`) :meth:`apply` reads (a sketch: all).
        >>> STD.fields, MAX.fields
        ((0, 1, 2), (0, 4))
        """
        return _FIELDS_READ.get(self.kind, (0, 1, 2, 3, 4))

    def apply_arrays(self, arrays: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`apply` over the columns of a ``(5, M)`` stat array (not for quantiles)."""
        count = arrays[0]
        if self.kind in ("mean", "std"):
            count = np.where(count > 0, count, np.nan)  # dividing by NaN: NaN, and no warning
            return arrays[1] / count if self.kind == "mean" else np.sqrt(np.maximum(arrays[2], 0.0) / count)
        if self.kind == "sum":
            return arrays[1].copy()
        if self.kind == "count":
            return count.copy()
        if self.kind == "min":
            return np.where(count > 0, arrays[3], np.nan)
        if self.kind == "max":
            return np.where(count > 0, arrays[4], np.nan)
        raise ValueError(f"reduction {self.name!r} reads a sketch; use apply()")

    def __call__(self, metrics: Sequence[Any]) -> float:
        """The seed's aggregation signature: ``f(list[Metric]) -> float``.
        >>> MEAN([Metric("a", 1.0, 2), Metric("a", [2.0, 3.0], 2)])
        2.0
        """
        stat = Stat(sketch=Sketch() if self.needs_sketch else None)  # merge keeps a sketch if both have one
        for m in metrics:
            value = m.value if isinstance(m, Metric) else m
            stat = stat.merge(Stat.of(value, sketch=self.needs_sketch))
        return self.apply(stat)


MEAN = Reduction("mean", "mean")
SUM = Reduction("sum", "sum")
MIN = Reduction("min", "min")
MAX = Reduction("max", "max")
STD = Reduction("std", "std")
COUNT = Reduction("count", "count")
MEDIAN = Reduction("median", "quantile", 0.5)
HIST = Reduction("hist", "hist")


def percentile(p: float) -> Reduction:
    """The reduction reading the ``p``-th percentile (docs/reductions.md, "Quantiles: exact up to a bound").

    Args:
        p: the percentile, in [0, 100].

    Returns:
        A quantile :class:`Reduction` named ``p<p>``, with ``q = p / 100``.

    Raises:
        ValueError: ``p`` outside [0, 100] (NaN included).

    Example:
    >>> percentile(99.9).name, percentile(95).q
    ('p99.9', 0.95)
    """
    p = float(p) + 0.0  # -0.0 -> 0.0
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    # shortest positional repr, so parse_reduction(name) gives p back
    return Reduction(f"p{np.format_float_positional(p, trim='-')}", "quantile", p / 100.0)


_BY_NAME = {r.name: r for r in (MEAN, SUM, MIN, MAX, STD, COUNT, MEDIAN, HIST)}
_TOKENS = {
    "mean": MEAN, "avg": MEAN, "min": MIN, "minimum": MIN, "max": MAX, "maximum": MAX, "sum": SUM,
    "total": SUM, "median": MEDIAN, "std": STD, "count": SUM, "hist": HIST,
}  # fmt: skip
_TOKEN_RE = re.compile(r"p\d+(?:\.\d+)?(?![^_@.\-])|[^_@.\-]+")
_PERCENTILE_RE = re.compile(r"p(\d+(?:\.\d+)?)")


def parse_reduction(spec: str | Reduction) -> Reduction:
    """A Reduction from its spec: ``"mean"``, ``"max"``, ``"p95"``, ``"median"``, ..., or a Reduction.
    >>> parse_reduction("p99.9") == percentile(99.9)
    True
    """
    if isinstance(spec, Reduction):
        return spec
    if isinstance(spec, str):
        spec = spec.lower()
        if spec in _BY_NAME:
            return _BY_NAME[spec]
        m = _PERCENTILE_RE.fullmatch(spec)
        if m and float(m.group(1)) <= 100:
            return percentile(float(m.group(1)))
    raise ValueError(
        f"unknown reduction {spec!r}: use one of {sorted(_BY_NAME)}, 'pNN' (percentile) or a Reduction"
    )


# ---------------------------------------------------------------------------------------- registry
_BUILTIN: dict[str, Reduction] = {
    "graph_output_handling": MAX,  # only rollout tp rank 0 contributes
    "perf/max_memory_allocated_gb": MAX,  # GPU memory (rlmetrics.metrics.memory): the worst rank OOMs
    "perf/max_memory_reserved_gb": MAX,
}
_BUILTIN_GLOBS: dict[str, Reduction] = {
    "val/test_score/*": MEAN,  # the last segment is a data source
    "perf/memory/*": MAX,  # GPU memory per stage: the worst rank
}

SPECIAL_METRICS: dict[str, Reduction] = dict(_BUILTIN)
"""Exact names with a fixed reduction (the seed's ``Special_Metric``). Prefer :func:`register_reduction`:
caches miss a direct edit for names already resolved."""
_GLOBS: dict[str, Reduction] = dict(_BUILTIN_GLOBS)


_RULES = [0]  # bumped by every (un)registration: caches of resolved names key on it


def rules_version() -> int:
    """A number that changes with every (un)registration: a cache of :func:`resolve` keys on it."""
    return _RULES[0]


def register_reduction(name_or_glob: str, reduction: str | Reduction, *, glob: bool | None = None) -> None:
    """Fix the reduction of an exact name or a glob (docs/reductions.md, "Reductions from names").

    Args:
        name_or_glob: a metric name, or an ``fnmatch`` glob; the glob registered last wins.
        reduction: a spec (``"max"``, ``"p99"``, ``"count"``, ...) or a :class:`Reduction`.
        glob: whether ``name_or_glob`` is a glob (None: it is one if it holds ``*``, ``?`` or ``[``).

    Raises:
        ValueError: an unknown reduction spec (nothing is registered).

    Example:
    >>> from rlmetrics import register_reduction, resolve, unregister_reduction
    >>> register_reduction("custom/latency/*", "p99")
    >>> resolve("custom/latency/decode").name
    'p99'
    >>> unregister_reduction("custom/latency/*")
    """
    r = parse_reduction(reduction)
    _RULES[0] += 1
    if glob if glob is not None else any(c in name_or_glob for c in "*?["):
        _GLOBS.pop(name_or_glob, None)
        _GLOBS[name_or_glob] = r
        _resolve_by_rules.cache_clear()
    else:
        SPECIAL_METRICS[name_or_glob] = r


def unregister_reduction(name_or_glob: str) -> None:
    """Undo :func:`register_reduction` of ``name_or_glob`` (an unknown one: nothing happens).

    Args:
        name_or_glob: the name or glob as registered; a built-in one returns to its built-in reduction.

    Example:
    >>> from rlmetrics import register_reduction, resolve, unregister_reduction
    >>> register_reduction("graph_output_handling", "min")
    >>> unregister_reduction("graph_output_handling")
    >>> resolve("graph_output_handling").name  # built in: siiRL's special metric
    'max'
    """
    _RULES[0] += 1
    for table, builtin in ((SPECIAL_METRICS, _BUILTIN), (_GLOBS, _BUILTIN_GLOBS)):
        table.pop(name_or_glob, None)
        if name_or_glob in builtin:
            table[name_or_glob] = builtin[name_or_glob]
    _resolve_by_rules.cache_clear()


def _from_tokens(segment: str) -> Reduction | None:
    for token in reversed(_TOKEN_RE.findall(segment.lower())):
        if token in _TOKENS:
            return _TOKENS[token]
        m = _PERCENTILE_RE.fullmatch(token)
        if m and float(m.group(1)) <= 100:
            return percentile(float(m.group(1)))
    return None


def resolve(name: str) -> Reduction:
    """The reduction of a metric name (docs/reductions.md, "Reductions from names").

    Args:
        name: a metric name; a grouped one (``group/<tag>/<label>/<metric>``) resolves as its metric
            (globs included) unless registered by its exact name; a glob on the grouped name does not
            apply to it.

    Returns:
        The :class:`Reduction`: registered name, then glob, then the name's tokens, else ``MEAN``.

    Example:
    >>> from rlmetrics import resolve
    >>> resolve("critic/score/max").name, resolve("custom/latency/p95").name
    ('max', 'p95')
    >>> resolve("group/data_source/max_problems/actor/minibatch_loss").name
    'mean'
    """
    found = SPECIAL_METRICS.get(name)
    if found is not None:
        return found
    grouped = split_group_name(name) if name.startswith(GROUP_PREFIX) else None
    return _resolve_by_rules(name) if grouped is None else resolve(grouped[1])


@functools.lru_cache(maxsize=65536)
def _resolve_by_rules(name: str) -> Reduction:
    for pattern in reversed(_GLOBS):
        if fnmatch.fnmatchcase(name, pattern):
            return _GLOBS[pattern]
    for segment in reversed(name.split("/")):
        found = _from_tokens(segment)
        if found is not None:
            return found
    return MEAN


# ---------------------------------------------------------------------------------- seed's API
@dataclass
class Metric:
    """One submitted value, as in the seed: ``Metric(name, value, world_size)``."""

    name: Any
    value: Any
    world_size: Any


def MetricFunc(name: str) -> Reduction:  # noqa: N802 - the seed's name
    """The seed's aggregation function of a metric name: :func:`resolve`.

    Args:
        name: a metric name.

    Returns:
        Its :class:`Reduction`, callable on a list of :class:`Metric` (a float).

    Example:
    >>> MetricFunc("actor/minibatch_loss")([Metric("x", 1.0, 2), Metric("x", 3.0, 2)])
    2.0
    """
    return resolve(name)


MeanMetric = MEAN
MaxMetric = MAX
MinMetric = MIN
SumMetric = SUM
MedianMetric = MEDIAN


def PercentileMetric(percentile_value: float) -> Reduction:  # noqa: N802 - the seed's name
    """The seed's percentile factory: :func:`percentile`.

    Args:
        percentile_value: the percentile, in [0, 100].

    Returns:
        A quantile :class:`Reduction`, callable on a list of :class:`Metric` (a float).

    Raises:
        ValueError: ``percentile_value`` outside [0, 100].

    Example:
    >>> PercentileMetric(50)([Metric("x", [1.0, 2.0], 2), Metric("x", [3.0, 4.0], 2)])
    2.5
    """
    return percentile(percentile_value)


DEFAULT_RENAMES: dict[str, str] = {"timing_s/": "perf/delta_time/"}
"""Name prefixes renamed in results, as the seed's MetricWorker does; pass ``renames={}`` to keep names."""


def rename(name: str, renames: dict[str, str]) -> str:
    """Apply the first matching prefix rename.
    >>> rename("timing_s/gen", DEFAULT_RENAMES)
    'perf/delta_time/gen'
    """
    for prefix, new in renames.items():
        if name.startswith(prefix):
            return new + name[len(prefix) :]
    return name


__all__ = [
    "COUNT", "DEFAULT_RENAMES", "HIST", "MAX", "MEAN", "MEDIAN", "MIN", "STD", "SUM", "SPECIAL_METRICS",
    "MaxMetric", "MeanMetric", "MedianMetric", "Metric", "MetricFunc", "MinMetric", "PercentileMetric",
    "Reduction", "SumMetric", "parse_reduction", "percentile", "register_reduction", "rename",
    "resolve", "rules_version", "unregister_reduction",
]  # fmt: skip
