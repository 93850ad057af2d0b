"""Mergeable summary statistics: :class:`Stat` and the merges of ``(5, M)`` stat arrays (rows :data:`FIELDS`).

Merged by Chan et al.'s parallel formula (no sum of squares cancels); 400+ lines: every input form,
the merge and the reduction share one layout. What a value may be: docs/reductions.md, "The value policy".

>>> a, b = Stat.of([1.0, 2.0]), Stat.of([3.0, 4.0, 5.0])
>>> m = a.merge(b)
>>> (m.count, m.mean, m.min, m.max)
(5.0, 3.0, 1.0, 5.0)
>>> round(m.var, 12)
2.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlmetrics.core.host import HostPlan, to_host
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.summary import NAN_STRATEGIES, nonfinite, stats_of_rows, summarize
from rlmetrics.core.values import (
    MetricValueError,
    and_mask,
    as_float_array,
    bad_weights_error,
    check_tensor,
    check_weights,
    is_dataless,
    is_torch,
    scalar_value,
    stack_tensors,
    weights,
)

FIELDS = ("count", "sum", "m2", "min", "max")
"""Rows of a stat array, in order."""


def empty_arrays(m: int) -> np.ndarray:
    """The identity of :func:`merge_arrays`: ``m`` empty summaries.
    >>> empty_arrays(2)[:, 0].tolist()
    [0.0, 0.0, 0.0, inf, -inf]
    """
    out = np.zeros((5, m))
    out[3] = np.inf
    out[4] = -np.inf
    return out


def merge_arrays(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Merge two stat arrays of shape ``(5, ...)`` column by column (a new array).
    >>> merge_arrays(Stat.of([1.0]).to_array(), Stat.of([3.0]).to_array()).tolist()
    [2.0, 4.0, 2.0, 1.0, 3.0]
    """
    na, nb = a[0], b[0]
    n = na + nb
    with np.errstate(invalid="ignore", divide="ignore"):
        delta = np.where(nb > 0, b[1] / np.where(nb > 0, nb, 1), 0.0) - np.where(
            na > 0, a[1] / np.where(na > 0, na, 1), 0.0
        )
        extra = np.where((na > 0) & (nb > 0), delta * delta * (na * nb / np.where(n > 0, n, 1)), 0.0)
        return np.stack([n, a[1] + b[1], a[2] + b[2] + extra, np.minimum(a[3], b[3]), np.maximum(a[4], b[4])])


def reduce_parts(parts: np.ndarray) -> np.ndarray:
    """Merge ``k`` stat arrays stacked field-major, shape ``(5, k, M)``, into one ``(5, M)`` array.
    >>> parts = np.stack([Stat.of(p).to_array()[:, None] for p in ([1.0, 2.0], [3.0], [4.0, 5.0])], axis=1)
    >>> reduce_parts(parts)[:, 0].tolist()
    [5.0, 15.0, 10.0, 1.0, 5.0]
    """
    counts, sums = parts[0], parts[1]
    n = counts.sum(axis=0)
    s = sums.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.divide(s, n, out=np.zeros_like(s), where=n > 0)
    m2 = parts[2].sum(axis=0) + spread(counts, sums, mean).sum(axis=0)
    return np.stack([n, s, m2, parts[3].min(axis=0), parts[4].max(axis=0)])


def reduce_runs(parts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """:func:`reduce_parts` of each non-empty run ``parts[:, starts[i]:starts[i + 1]]``, as ``(5, runs, M)``.
    >>> parts = np.stack([Stat.of(p).to_array()[:, None] for p in ([1.0, 2.0], [3.0], [4.0, 5.0])], axis=1)
    >>> reduce_runs(parts, np.array([0, 1]))[:, :, 0].T.tolist()
    [[2.0, 3.0, 0.5, 1.0, 2.0], [3.0, 12.0, 2.0, 3.0, 5.0]]
    """
    counts, sums = parts[0], parts[1]
    n = np.add.reduceat(counts, starts, axis=0)
    s = np.add.reduceat(sums, starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.divide(s, n, out=np.zeros_like(s), where=n > 0)
    lengths = np.diff(np.append(starts, counts.shape[0]))
    m2 = np.add.reduceat(parts[2] + spread(counts, sums, np.repeat(mean, lengths, axis=0)), starts, axis=0)
    lo, hi = np.minimum.reduceat(parts[3], starts, axis=0), np.maximum.reduceat(parts[4], starts, axis=0)
    return np.stack([n, s, m2, lo, hi])


def spread(counts: np.ndarray, sums: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """What parts add to the merged M2 beyond their own: ``count * (part mean - overall mean) ** 2``.
    >>> spread(np.array([2.0, 1.0, 0.0]), np.array([2.0, 4.0, 0.0]), np.array(2.0)).tolist()
    [2.0, 4.0, 0.0]
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        dev = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        dev -= mean
        np.square(dev, out=dev)
        dev *= counts  # parts without observations add nothing
    return dev


_EMPTY_TAIL = empty_arrays(1)[1:]  # sum, M2, min and max of a column without observations


def invalid_column(stats: np.ndarray) -> tuple[int, str] | None:
    """``(column, problem)`` of the first column no data can give, or None (docs/reliability.md).
    >>> good = Stat.of([1.0, 2.0]).to_array()
    >>> invalid_column(np.stack([good, [-1e9, 4.0, 0.0, 4.0, 4.0]], axis=1))
    (1, 'count -1000000000.0 < 0')
    >>> invalid_column(np.stack([good, Stat.of([np.nan]).to_array(), Stat().to_array()], axis=1)) is None
    True
    """
    c, s, m2, lo, hi = stats
    if not c.size:
        return None
    least = c.min()
    if least >= 0 and c.max() < math.inf and m2.min() >= 0:  # counts and M2 are fine (a NaN fails)
        if least > 0 and (lo <= hi).all():
            return None  # the common case, in 5 numpy calls
        empty = c == 0
        if ((lo <= hi) | empty).all() and (stats[1:, empty] == _EMPTY_TAIL).all():
            return None  # and names without observations, in 6 more
    odd = np.flatnonzero(~((c > 0) & (c < math.inf) & (m2 >= 0) & (lo <= hi)))  # only these can be bad
    c, s, m2, lo, hi = stats[:, odd]
    held = (c > 0) & (lo != math.inf) & (hi != -math.inf)
    rules = [  # in the order a column's problem is told
        (np.isnan(c), "count {0!r} is not a number"),
        (c < 0, "count {0!r} < 0"),
        (c == math.inf, "count {0!r} is not finite"),
        (m2 < 0, "M2 {2!r} < 0"),
        (np.isnan(m2) & np.isfinite(s), "M2 {2!r} with a finite sum {1!r}"),
        (
            (c == 0) & ((s != 0) | (m2 != 0) | (lo != math.inf) | (hi != -math.inf)),
            "count 0 with sum {1!r}, M2 {2!r}, min {3!r}, max {4!r} "
            "(a column without observations is (0, 0, 0, inf, -inf))",
        ),
        (held & (lo > hi), "min {3!r} > max {4!r}"),
        (held & (np.isnan(lo) != np.isnan(hi)), "min {3!r} and max {4!r}: one of them NaN"),
    ]
    bad = np.flatnonzero(np.logical_or.reduce([mask for mask, _ in rules]))
    if not len(bad):
        return None
    j = int(bad[0])
    why = next(text for mask, text in rules if mask[j])
    return int(odd[j]), why.format(*(float(v) for v in stats[:, odd[j]]))


class Stat:
    """Mergeable summary of weighted observations (a scalar is one observation of weight 1).
    >>> s = Stat.of([1.0, 2.0, 3.0, 10.0], mask=[1, 1, 1, 0])
    >>> (s.count, s.sum, s.mean, s.max)
    (3.0, 6.0, 2.0, 3.0)
    >>> Stat.of([1.0, 3.0], weight=[3.0, 1.0]).mean
    1.5
    """

    __slots__ = ("count", "sum", "m2", "min", "max", "sketch")

    def __init__(
        self,
        count: float = 0.0,
        sum: float = 0.0,
        m2: float = 0.0,
        min: float = math.inf,
        max: float = -math.inf,
        sketch: Sketch | None = None,
    ) -> None:
        self.count = float(count)
        self.sum = float(sum)
        self.m2 = float(m2)
        self.min = float(min)
        self.max = float(max)
        self.sketch = sketch

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(
        cls,
        values: Any,
        mask: Any = None,
        weight: Any = None,
        *,
        sketch: bool = False,
        nan_strategy: str = "propagate",
        name: str = "value",
    ) -> Stat:
        """Summarize ``values``; ``mask`` (non-zero: keep) and ``weight`` broadcast against them;
        ``sketch=True`` keeps a quantile sketch. Raises :class:`MetricValueError` (``name`` labels it).
        >>> Stat.of(2.5).to_array().tolist()
        [1.0, 2.5, 0.0, 2.5, 2.5]
        >>> Stat.of([1.0, float("nan")], nan_strategy="drop").mean
        1.0
        """
        if nan_strategy not in NAN_STRATEGIES:
            raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
        if isinstance(values, np.ma.MaskedArray):  # masked entries are not observations
            keep = ~np.ma.getmaskarray(values)
            values = np.ma.getdata(values)
            mask = keep if mask is None else and_mask(keep, mask, name)
        if mask is None and weight is None and not sketch:
            v = scalar_value(values, name)
            if v is not None:
                return cls._of_scalar(v, nan_strategy, name)
        if isinstance(values, (list, tuple)) and any(map(is_torch, values)):
            values = stack_tensors(values, name)
        if is_torch(values):
            return cls._of_torch(values, mask, weight, sketch, nan_strategy, name)
        x = as_float_array(values, name, "values")
        w = weights(np, x.shape, mask, weight, name)
        return cls._finish(x.reshape(-1), w, sketch=sketch, nan_strategy=nan_strategy, name=name)

    @classmethod
    def _of_scalar(cls, v: float, nan_strategy: str, name: str) -> Stat:
        if not math.isfinite(v):
            if nan_strategy == "error":
                raise MetricValueError(f"metric {name!r}: non-finite value {v} (nan_strategy='error')")
            if nan_strategy == "drop":
                return cls()
        return cls(1.0, v, 0.0 if math.isfinite(v) else math.nan, v, v)

    @classmethod
    def of_tensors(
        cls, metrics: Mapping[Any, Any], needs_sketch: Callable[[str], bool], nan_strategy: str = "propagate"
    ) -> dict[str, Stat | MetricValueError]:
        """``{name: Stat or MetricValueError}`` of the tensor values of ``metrics``, in one host copy.
        >>> import torch
        >>> metrics = {"a": torch.ones(3), "b": (torch.arange(2.0), 2.0), "c": 1.0}
        >>> out = Stat.of_tensors(metrics, needs_sketch=lambda name: False)
        >>> sorted(out), out["a"].count, out["b"].count
        (['a', 'b'], 3.0, 4.0)
        """
        items = []
        for name, value in metrics.items():
            values, weight = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
            if isinstance(name, str) and name and is_torch(values):
                items.append((name, values, None, weight, needs_sketch(name)))
        if not items:  # (torch may not even be installed)
            return {}
        return dict(zip((it[0] for it in items), _tensor_stats(items, nan_strategy)))

    @classmethod
    def _of_torch(
        cls, values: Any, mask: Any, weight: Any, sketch: bool, nan_strategy: str, name: str
    ) -> Stat:
        (out,) = _tensor_stats([(name, values, mask, weight, sketch)], nan_strategy)
        if isinstance(out, MetricValueError):
            raise out
        return out

    @classmethod
    def _finish(
        cls, x: np.ndarray, w: np.ndarray | None = None, *, sketch: bool, nan_strategy: str, name: str
    ) -> Stat:
        """The Stat of 1-D float64 ``x`` with weights ``w`` (None: 1 each) on the host."""
        if x.shape[0] == 0:
            return cls(sketch=Sketch() if sketch else None)
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite values follow nan_strategy
            if w is not None:
                check_weights(w, name)
            if nan_strategy == "error":
                _refuse(float(nonfinite(x, weight=w)), 0.0, name=name)
            stat = cls(*summarize(x, weight=w, nan_strategy=nan_strategy).tolist())
        if sketch:
            keep = np.ones(x.shape, dtype=bool) if w is None else w > 0
            if nan_strategy == "drop":
                keep &= np.isfinite(x)
            stat.sketch = Sketch.of(x[keep], None if w is None else w[keep])
        return stat

    @classmethod
    def _from_summary(cls, summary: np.ndarray, *, name: str) -> Stat:
        """The Stat of a :func:`_summary` moved to the host, or the error its checks call for."""
        _refuse(summary[5], summary[6], name=name)
        return cls(*summary[:5].tolist())

    # ------------------------------------------------------------------ statistics
    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else math.nan

    @property
    def var(self) -> float:
        """Population variance (``ddof=0``, as numpy)."""
        return max(self.m2, 0.0) / self.count if self.count > 0 else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation (``ddof=0``)."""
        return math.sqrt(self.var) if self.count > 0 else math.nan

    @property
    def finite(self) -> bool:
        """Whether the summarized values are all finite (an empty Stat is), read from min and max.
        >>> Stat.of([1.0, 2.0]).finite, Stat.of([1.0, float("nan")]).finite, Stat().finite
        (True, False, True)
        >>> Stat.of([-1e308, 1e308]).finite  # its sum of squares overflows, its values are finite
        True
        """
        return self.count == 0 or (math.isfinite(self.min) and math.isfinite(self.max))

    def merge(self, other: Stat) -> Stat:
        """A new Stat summarizing both (associative, commutative); a sketch only if both have one."""
        out = Stat(*merge_arrays(self.to_array(), other.to_array()).tolist())
        if self.sketch is not None and other.sketch is not None:
            out.sketch = self.sketch.merge(other.sketch)
        return out

    # ------------------------------------------------------------------ wire
    def to_array(self) -> np.ndarray:
        """``[count, sum, m2, min, max]`` as float64 (the sketch travels separately)."""
        return np.array([self.count, self.sum, self.m2, self.min, self.max])

    @classmethod
    def from_array(cls, arr: np.ndarray, sketch: Sketch | None = None) -> Stat:
        """Inverse of :meth:`to_array`.
        >>> Stat.from_array(Stat.of([1.0, 2.0]).to_array()).mean
        1.5
        """
        return cls(*np.asarray(arr, dtype=np.float64).tolist(), sketch=sketch)

    def __repr__(self) -> str:
        return (
            f"Stat(count={self.count:g}, mean={self.mean:g}, std={self.std:g}, "
            f"min={self.min:g}, max={self.max:g}{', sketch' if self.sketch is not None else ''})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stat) and np.array_equal(self.to_array(), other.to_array(), equal_nan=True)

    __hash__ = None  # type: ignore[assignment]


def _summary(torch: Any, x: Any, w: Any, nan_strategy: str) -> Any:
    """The stat array of 1-D tensor ``x`` on its device, then what :func:`_refuse` reads: one vector."""
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    bad = nonfinite(x, weight=w) if nan_strategy == "error" else zero
    bad_w = zero if w is None else (~(torch.isfinite(w) & (w >= 0))).sum(dtype=torch.float64)
    return torch.cat([summarize(x, weight=w, nan_strategy=nan_strategy), torch.stack([bad, bad_w])])


def _refuse(bad_values: float, bad_weights: float, *, name: str) -> None:
    """Raise :class:`MetricValueError` for bad weights, then for non-finite values (counted under "error")."""
    if bad_weights > 0:
        raise bad_weights_error(name, bad_weights)
    if bad_values > 0:
        raise MetricValueError(
            f"metric {name!r}: {int(bad_values)} non-finite value(s) (nan_strategy='error')"
        )


def _tensor_stats(items: Sequence[tuple], nan_strategy: str) -> list[Stat | MetricValueError]:
    """Stats of ``(name, values, mask, weight, sketch)`` tensor items, moved to the host in one copy."""
    import torch

    plan = HostPlan()
    for name, values, mask, weight, sketch in items:
        plan.add(*_queue(torch, name, values, mask, weight, sketch, nan_strategy))
    return plan.run()


def _queue(
    torch: Any, name: str, values: Any, mask: Any, weight: Any, sketch: bool, nan_strategy: str
) -> tuple[list[Any], Callable[..., Stat | MetricValueError]]:
    """What one item of :func:`_tensor_stats` moves to the host, and how its Stat is read there."""
    try:
        check_tensor(values, name, "values")
        x = values.detach()
        if x.device.type == "mps":  # no float64 there
            x = x.cpu()
        x = x.to(torch.float64).reshape(-1)
        w = weights(torch, tuple(values.shape) or (1,), mask, weight, name, device=x.device)
    except MetricValueError as exc:
        error = exc  # (exc itself is unbound after the except clause)
        return [], lambda: error
    if x.shape[0] == 0:
        empty = Stat(sketch=Sketch() if sketch else None)
        return [], lambda: empty
    options = {"nan_strategy": nan_strategy, "name": name}
    if sketch:  # the sketch needs the values themselves: move values and weights
        return [x] if w is None else [x, w], _caught(Stat._finish, sketch=True, **options)
    return [_summary(torch, x, w, nan_strategy)], _caught(Stat._from_summary, name=name)


def _caught(fn: Callable[..., Stat], **options: Any) -> Callable[..., Stat | MetricValueError]:
    """``fn(*arrays, **options)``, or the MetricValueError it raises."""

    def read(*arrays: np.ndarray) -> Stat | MetricValueError:
        try:
            return fn(*arrays, **options)
        except MetricValueError as exc:
            return exc

    return read


__all__ = [
    "FIELDS", "NAN_STRATEGIES", "MetricValueError", "Stat", "check_tensor", "empty_arrays", "invalid_column",
    "is_dataless", "merge_arrays", "reduce_parts", "reduce_runs", "scalar_value", "spread", "stats_of_rows",
    "to_host",
]  # fmt: skip
