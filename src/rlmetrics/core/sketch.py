"""Mergeable quantile sketch: exact while small, relative-error log buckets beyond.

:class:`Sketch` and :class:`BucketWindow` (merging by sums): docs/reductions.md, "The sketch". One
module of 700+ lines: the representation is read nowhere else; split, its helpers would become an API.

>>> s = Sketch.of([1.0, 2.0, 3.0, 4.0])
>>> s.median(), s.quantile(0.5)
(2.0, 2.5)
>>> big = Sketch.of(np.arange(1.0, 10002.0), exact_limit=10_000)  # 10001 values > exact_limit: buckets
>>> big.is_exact
False
>>> abs(big.median() - 5001.0) <= 0.005 * 5001.0
True
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["EXACT_QUANTILES_ENV", "BucketWindow", "Sketch", "default_exact_limit"]

EXACT_QUANTILES_ENV = "RLMETRICS_EXACT_QUANTILES"
"""The environment variable that sets :func:`default_exact_limit` (read at each use)."""
_DEFAULT_EXACT = 1_000_000

_TINY = 1e-300  # smaller magnitudes count as zero
_MAGIC = 1397444683.0  # first element of Sketch.to_array: b"SKTK" as a big-endian int

_VERSION = 1.0
_HEADER = 15
_MODE_EXACT = 0.0
_MODE_BUCKETS = 1.0
_MAX_INT_FLOAT = 2**53
_MAX_STORE = 1 << 16  # most buckets per store of a sketch from another process (a merge: <= 1 MiB more)
_FLOAT_MAX = float(np.finfo(np.float64).max)
_EMPTY = np.zeros(0, dtype=np.float64)
_EMPTY.flags.writeable = False


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _fma(x: float, y: float, z: float) -> float:
    """``x * y + z`` with a single rounding (``math.fma`` from Python 3.13 on, exact rationals before)."""
    fma = getattr(math, "fma", None)
    if fma is not None:
        return float(fma(x, y, z))
    return float(Fraction(x) * Fraction(y) + Fraction(z))


def _lerp(a: float, b: float, t: float) -> float:
    """``torch.lerp`` arithmetic (fused multiply-add, as its vectorised CPU kernel), total for infinities."""
    if t == 0.0 or a == b:
        return a
    if a == -math.inf or b == math.inf:
        if a == -math.inf and b == math.inf:
            return math.nan
        return a if a == -math.inf else b
    diff = b - a
    if math.isinf(diff):  # finite neighbours more than the float range apart: no exact product exists
        return a + t * diff if t < 0.5 else b - diff * (1.0 - t)
    return _fma(t, diff, a) if t < 0.5 else _fma(-diff, 1.0 - t, b)


def _build_store(k: np.ndarray, w: np.ndarray | None, max_buckets: int) -> tuple[int, np.ndarray]:
    """Dense store of bucket indices ``k`` (weights ``w`` all > 0), folded to ``max_buckets``."""
    if k.size == 0:
        return 0, _EMPTY
    hi = int(k.max())
    lo = int(k.min())
    if hi - lo + 1 > max_buckets:  # fold before counting: the dense range stays <= max_buckets
        lo = hi - max_buckets + 1
        k = np.maximum(k, lo)
    counts = np.bincount(k - lo, weights=w, minlength=hi - lo + 1).astype(np.float64, copy=False)
    return lo, _frozen(counts)


def _merge_store(
    o1: int, c1: np.ndarray, o2: int, c2: np.ndarray, max_buckets: int
) -> tuple[int, np.ndarray]:
    """The sum of two stores, lowest buckets folded so that at most ``max_buckets`` are allocated."""
    if c1.size == 0:
        return o2, c2
    if c2.size == 0:
        return o1, c1
    hi = max(o1 + c1.size, o2 + c2.size)
    lo = max(min(o1, o2), hi - max_buckets)
    return lo, _frozen(_fold_store(o1, c1, lo, hi - lo) + _fold_store(o2, c2, lo, hi - lo))


def _fold_store(offset: int, counts: np.ndarray, lo: int, width: int) -> np.ndarray:
    """Counts of buckets ``offset + i`` on the window ``[lo, lo + width)``, lower ones folded into ``lo``."""
    if counts.size == 0:
        return np.zeros(width)
    if offset + counts.size > lo + width:
        raise ValueError(
            f"bucket window [{lo}, {lo + width}) does not cover buckets up to {offset + counts.size - 1}"
        )
    idx = np.maximum(np.arange(offset, offset + counts.size), lo) - lo
    return np.bincount(idx, weights=counts, minlength=width)


def _unfold_store(lo: int, counts: np.ndarray) -> tuple[int, np.ndarray]:
    """A store from window counts, without empty buckets at either end."""
    nonzero = np.flatnonzero(counts)
    if nonzero.size == 0:
        return 0, _EMPTY
    first, last = int(nonzero[0]), int(nonzero[-1])
    return lo + first, _frozen(counts[first : last + 1].copy())


def default_exact_limit() -> int:
    """``RLMETRICS_EXACT_QUANTILES`` if set (an integer >= 0, ``_`` allowed; else ValueError), or 1,000,000.
    >>> default_exact_limit()
    1000000
    """
    raw = os.environ.get(EXACT_QUANTILES_ENV)
    if raw is None or not raw.strip():
        return _DEFAULT_EXACT
    try:
        n = int(raw.strip())
    except ValueError:
        n = -1
    if not 0 <= n <= _MAX_INT_FLOAT:
        raise ValueError(
            f"{EXACT_QUANTILES_ENV}={raw!r}: expected the number of values a quantile is exact for "
            f"(an integer >= 0, e.g. {_DEFAULT_EXACT}); unset it for the default"
        )
    return n


def _check_params(rel_err: float, exact_limit: int | None, max_buckets: int) -> tuple[float, int, int]:
    if exact_limit is None:
        exact_limit = default_exact_limit()
    rel_err = float(rel_err)
    if not 0.0 < rel_err < 1.0:
        raise ValueError(f"rel_err must be in (0, 1), got {rel_err!r}")
    if int(exact_limit) != exact_limit or not 0 <= exact_limit <= _MAX_INT_FLOAT:
        raise ValueError(f"exact_limit must be an integer in [0, 2**53], got {exact_limit!r}")
    if int(max_buckets) != max_buckets or not 1 <= max_buckets <= _MAX_INT_FLOAT:
        raise ValueError(f"max_buckets must be an integer >= 1, got {max_buckets!r}")
    return rel_err, int(exact_limit), int(max_buckets)


Span = tuple[int, int]
"""Lowest and highest bucket index of a store (inclusive)."""


@dataclass(frozen=True)
class BucketWindow:
    """The buckets sketches fold onto to merge by sums: ``*_width`` buckets from ``*_lo`` per store.
    >>> a, b = Sketch.of([1.0, 2.0], exact_limit=0), Sketch.of([-3.0, 40.0], exact_limit=0)
    >>> w = BucketWindow.of([a, b])
    >>> merged = Sketch.from_folded(a.fold(w) + b.fold(w), w, **a.params)
    >>> merged.to_array().tolist() == a.merge(b).to_array().tolist()
    True
    """

    neg_lo: int = 0
    neg_width: int = 0
    pos_lo: int = 0
    pos_width: int = 0

    @classmethod
    def covering(cls, neg: Span | None, pos: Span | None, max_buckets: int) -> BucketWindow:
        """The window :meth:`Sketch.merge` keeps for stores spanning ``neg`` and ``pos`` (None: empty).
        >>> BucketWindow.covering(None, (-5, 20), max_buckets=10)
        BucketWindow(neg_lo=0, neg_width=0, pos_lo=11, pos_width=10)
        """

        def window(span: Span | None) -> tuple[int, int]:
            if span is None:
                return 0, 0
            lo, hi = int(span[0]), int(span[1])
            if lo > hi:
                raise ValueError(f"bucket span {span!r}: lowest above highest")
            lo = max(lo, hi - int(max_buckets) + 1)
            return lo, hi - lo + 1

        return cls(*window(neg), *window(pos))

    @classmethod
    def of(cls, sketches: Iterable[Sketch]) -> BucketWindow:
        """The window that covers ``sketches`` (of one parameter set) as their merge does.
        >>> BucketWindow.of([Sketch.of([1.0]), Sketch.of([-1.0, 1.5])])
        BucketWindow(neg_lo=0, neg_width=1, pos_lo=0, pos_width=42)
        """
        sketches = list(sketches)
        if not sketches:
            return cls()
        spans = [sk.bucket_span() for sk in sketches]

        def union(k: int) -> Span | None:
            s = [sp[k] for sp in spans if sp[k] is not None]
            return (min(lo for lo, _ in s), max(hi for _, hi in s)) if s else None

        return cls.covering(union(0), union(1), sketches[0].max_buckets)

    @property
    def size(self) -> int:
        """Length of a folded vector: NaN, -inf, +inf and zero weights, then both windows."""
        return 4 + self.neg_width + self.pos_width


class Sketch:
    """Immutable mergeable quantile sketch; ``Sketch()`` is the empty one, the identity of :meth:`merge`.
    >>> Sketch().count
    0.0
    >>> Sketch.of([3.0, 1.0, 2.0]).merge(Sketch.of([5.0])).median()
    2.0
    """

    __slots__ = (
        "_rel_err",
        "_exact_limit",
        "_max_buckets",
        "_exact",
        "_values",
        "_runs",
        "_n",
        "_nan",
        "_neg_inf",
        "_pos_inf",
        "_zero",
        "_neg_off",
        "_neg",
        "_pos_off",
        "_pos",
        "_buckets",
    )

    def __init__(
        self, rel_err: float = 0.005, exact_limit: int | None = None, max_buckets: int = 4096
    ) -> None:
        self._rel_err, self._exact_limit, self._max_buckets = _check_params(rel_err, exact_limit, max_buckets)
        self._exact = True
        self._values: np.ndarray | None = _EMPTY  # exact: sorted non-NaN values (infinities included)
        self._runs: tuple[np.ndarray, ...] = ()  # exact, while _values is None: sorted runs to merge
        self._n = 0  # exact: the number of values
        self._nan = 0.0
        self._neg_inf = 0.0  # bucket mode only, like the fields below
        self._pos_inf = 0.0
        self._zero = 0.0
        self._neg_off = 0
        self._neg = _EMPTY
        self._pos_off = 0
        self._pos = _EMPTY
        self._buckets: Sketch | None = None  # exact mode: the bucket form, made on demand

    # ------------------------------------------------------------------ construction
    def _empty_like(self) -> Sketch:
        return Sketch(self._rel_err, self._exact_limit, self._max_buckets)

    @classmethod
    def of(
        cls,
        values: ArrayLike,
        weights: ArrayLike | None = None,
        *,
        rel_err: float = 0.005,
        exact_limit: int | None = None,
        max_buckets: int = 4096,
    ) -> Sketch:
        """Sketch of 1-D ``values``, optional finite non-negative ``weights`` of their shape, else ValueError.
        >>> Sketch.of([1.0, 2.0, 3.0, 4.0]).median()
        2.0
        >>> round(Sketch.of([2.0, 10.0], weights=[3.0, 1.0]).median(), 1)  # weighted: bucket mode
        2.0
        """
        out = cls(rel_err, exact_limit, max_buckets)
        v = np.asarray(values, dtype=np.float64)
        if v.ndim == 0:
            v = v.reshape(1)
        elif v.ndim != 1:
            raise ValueError(f"values must be 1-D, got shape {v.shape}")
        w: np.ndarray | None = None
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            if w.ndim == 0 and v.size == 1:
                w = w.reshape(1)
            if w.shape != v.shape:
                raise ValueError(f"weights must have the shape of values {v.shape}, got {w.shape}")
            if w.size and not (np.isfinite(w).all() and (w >= 0).all()):
                raise ValueError("weights must be finite and non-negative")
            if (w == 1.0).all():
                w = None  # unit weights: same as unweighted, may stay exact
        nan_mask = np.isnan(v)
        n_nan = int(np.count_nonzero(nan_mask))
        if w is None and v.size - n_nan <= out._exact_limit:
            out._nan = float(n_nan)
            out._values = _frozen(np.sort(v[~nan_mask]) if n_nan else np.sort(v))
            out._n = out._values.size
            return out
        out._fill_buckets(v, w)
        return out

    def _fill_buckets(self, v: np.ndarray, w: np.ndarray | None) -> None:
        """Switch this (fresh) sketch to bucket mode holding ``v`` with weights ``w`` (None: all 1)."""
        self._exact = False
        self._values, self._n = _EMPTY, 0
        if w is not None:
            keep = w > 0
            if not keep.all():
                v, w = v[keep], w[keep]

        def total(mask: np.ndarray) -> float:
            return float(np.count_nonzero(mask)) if w is None else float(w[mask].sum())

        a = np.abs(v)
        self._nan = total(np.isnan(v))
        self._zero = total(a < _TINY)
        inf = a == np.inf
        if inf.any():
            self._pos_inf = total(inf & (v > 0))
            self._neg_inf = total(inf & (v < 0))
        finite = (a >= _TINY) & ~inf  # NaN compares False
        wf = None if w is None else w[finite]
        k = np.ceil(np.log(a[finite]) / math.log(self._gamma())).astype(np.int64)
        neg = v[finite] < 0
        cap = self._max_buckets
        if neg.any():
            pos = ~neg
            wn, wp = (None, None) if wf is None else (wf[neg], wf[pos])
            self._neg_off, self._neg = _build_store(k[neg], wn, cap)
            self._pos_off, self._pos = _build_store(k[pos], wp, cap)
        else:
            self._pos_off, self._pos = _build_store(k, wf, cap)

    def _gamma(self) -> float:
        return (1.0 + self._rel_err) / (1.0 - self._rel_err)

    def _as_buckets(self) -> Sketch:
        if not self._exact:
            return self
        if self._buckets is None:
            out = self._empty_like()
            out._fill_buckets(self._sorted(), None)
            out._nan = self._nan
            self._buckets = out
        return self._buckets

    # ------------------------------------------------------------------ merging
    kind: ClassVar[str] = "sketch"
    """The state kind (:mod:`rlmetrics.core.states`)."""

    def reduce(self, name: str, reduction: Any, stat: Any) -> dict[str, float]:
        """``{name: value}`` of quantile ``reduction`` on ``stat`` with this sketch (the state protocol)."""
        with_sketch = type(stat)(stat.count, stat.sum, stat.m2, stat.min, stat.max, self)  # not the caller's
        return {name: reduction.apply(with_sketch)}

    def merge(self, other: Sketch) -> Sketch:
        """A new sketch of both inputs' data. ``rel_err`` and ``max_buckets`` must match (ValueError).
        >>> a, b = Sketch.of([1.0, 2.0]), Sketch.of([3.0, 4.0, 5.0])
        >>> a.merge(b).quantile(0.25), a.count
        (2.0, 2.0)
        >>> a.merge(Sketch.of([3.0], exact_limit=2)).is_exact  # 3 values, more than the smaller limit
        False
        """
        if not isinstance(other, Sketch):
            raise TypeError(f"can only merge a Sketch, got {type(other).__name__}")
        if (self._rel_err, self._max_buckets) != (other._rel_err, other._max_buckets):
            raise ValueError(
                f"cannot merge sketches with different parameters: {self._params()} vs {other._params()}"
            )
        limit = min(self._exact_limit, other._exact_limit)
        out = Sketch(self._rel_err, limit, self._max_buckets)
        if self._exact and other._exact and self._n + other._n <= limit:
            out._nan = self._nan + other._nan
            out._n = self._n + other._n
            runs = self._parts() + other._parts()  # sorted once, when read: k merges cost one sort
            out._values, out._runs = (runs[0] if runs else _EMPTY, ()) if len(runs) < 2 else (None, runs)
            return out
        a, b = self._as_buckets(), other._as_buckets()
        out._exact = False
        out._nan = a._nan + b._nan
        out._neg_inf = a._neg_inf + b._neg_inf
        out._pos_inf = a._pos_inf + b._pos_inf
        out._zero = a._zero + b._zero
        out._neg_off, out._neg = _merge_store(a._neg_off, a._neg, b._neg_off, b._neg, self._max_buckets)
        out._pos_off, out._pos = _merge_store(a._pos_off, a._pos, b._pos_off, b._pos, self._max_buckets)
        return out

    def _parts(self) -> tuple[np.ndarray, ...]:
        """Exact mode: the sorted runs of values (``_runs`` read first: :meth:`_sorted` drops them last)."""
        runs, values = self._runs, self._values
        return runs if values is None else ((values,) if values.size else ())

    def _sorted(self) -> np.ndarray:
        """The sorted values (exact mode; empty in bucket mode), the pending runs merged once."""
        runs, values = self._runs, self._values
        if values is None:
            values = _frozen(np.sort(np.concatenate(runs), kind="stable"))
            self._values = values
            self._runs = ()
        return values

    # ------------------------------------------------------------------ queries
    @property
    def count(self) -> float:
        """Total weight, NaN values included (their weight: :attr:`nan_count`).
        >>> Sketch.of([1.0, float("nan")]).count, Sketch.of([1.0, float("nan")]).nan_count
        (2.0, 1.0)
        """
        if self._exact:
            return float(self._n) + self._nan
        stores = float(self._neg.sum() + self._pos.sum())
        return self._nan + self._neg_inf + self._zero + stores + self._pos_inf

    @property
    def is_exact(self) -> bool:
        """Whether the raw values are held (exact mode).
        >>> Sketch.of([1.0]).is_exact, Sketch.of([1.0], weights=[2.0]).is_exact
        (True, False)
        """
        return self._exact

    @property
    def rel_err(self) -> float:
        """Relative error bound of bucket mode."""
        return self._rel_err

    @property
    def exact_limit(self) -> int:
        """Most values held exactly (unit weights) before switching to buckets."""
        return self._exact_limit

    @property
    def max_buckets(self) -> int:
        """Most buckets per signed store in bucket mode."""
        return self._max_buckets

    @property
    def params(self) -> dict[str, float | int]:
        """The parameters, as keywords of :class:`Sketch` and :meth:`Sketch.of`.
        >>> Sketch().params
        {'rel_err': 0.005, 'exact_limit': 1000000, 'max_buckets': 4096}
        >>> Sketch.of([2.0], **Sketch(rel_err=0.01).params).rel_err
        0.01
        """
        return {"rel_err": self._rel_err, "exact_limit": self._exact_limit, "max_buckets": self._max_buckets}

    @property
    def nan_count(self) -> float:
        """Weight of the NaN values seen."""
        return self._nan

    @property
    def values(self) -> np.ndarray:
        """Exact mode: the sorted non-NaN values (read-only). Raises ValueError in bucket mode.
        >>> Sketch.of([3.0, float("nan"), 1.0]).values.tolist()
        [1.0, 3.0]
        """
        if not self._exact:
            raise ValueError("a bucket-mode sketch does not hold its values")
        return self._sorted()

    def bucket_span(self) -> tuple[Span | None, Span | None]:
        """``(lowest, highest)`` bucket of the negative and the positive store in bucket mode; None: empty.
        >>> Sketch.of([1.0, 2.0]).bucket_span()
        (None, (0, 70))
        """
        b = self._as_buckets()
        return (
            (b._neg_off, b._neg_off + b._neg.size - 1) if b._neg.size else None,
            (b._pos_off, b._pos_off + b._pos.size - 1) if b._pos.size else None,
        )

    def fold(self, window: BucketWindow) -> np.ndarray:
        """This sketch's weights on ``window`` (reaching its highest buckets) as a vector of ``window.size``.
        >>> Sketch.of([-0.0, 1.0, 1.0]).fold(BucketWindow(pos_width=1)).tolist()
        [0.0, 0.0, 0.0, 1.0, 2.0]
        """
        b = self._as_buckets()
        return np.concatenate(
            [
                [b._nan, b._neg_inf, b._pos_inf, b._zero],
                _fold_store(b._neg_off, b._neg, window.neg_lo, window.neg_width),
                _fold_store(b._pos_off, b._pos, window.pos_lo, window.pos_width),
            ]
        )

    @classmethod
    def from_folded(
        cls,
        vector: ArrayLike,
        window: BucketWindow,
        *,
        rel_err: float = 0.005,
        exact_limit: int | None = None,
        max_buckets: int = 4096,
    ) -> Sketch:
        """The bucket-mode sketch of a (summed) :meth:`fold` vector on ``window``.
        >>> w = BucketWindow(pos_lo=0, pos_width=1)
        >>> Sketch.from_folded(Sketch.of([1.0]).fold(w) * 3, w).count
        3.0
        """
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != (window.size,):
            raise ValueError(f"folded vector of shape {v.shape}, the window needs ({window.size},)")
        out = cls(rel_err, exact_limit, max_buckets)
        if max(window.neg_width, window.pos_width) > out._max_buckets:
            raise ValueError(f"bucket window wider than max_buckets={out._max_buckets}: {window}")
        out._exact = False
        out._nan, out._neg_inf, out._pos_inf, out._zero = v[:4].tolist()
        split = 4 + window.neg_width
        out._neg_off, out._neg = _unfold_store(window.neg_lo, v[4:split])
        out._pos_off, out._pos = _unfold_store(window.pos_lo, v[split:])
        return out

    def quantile(self, q: float) -> float:
        """The ``q``-quantile, ``q`` in [0, 1]; NaN when empty or when NaN values were seen.
        >>> Sketch.of([1.0, 2.0, 3.0, 4.0]).quantile(0.25), Sketch().quantile(0.5)
        (1.75, nan)
        """
        try:
            qf = float(q) if not isinstance(q, (str, bytes)) else math.nan
        except (TypeError, ValueError):
            qf = math.nan
        if not 0.0 <= qf <= 1.0:
            raise ValueError(f"q must be a real number in [0, 1], got {q!r}")
        q = qf
        if self._nan > 0:
            return math.nan
        if self._exact:
            vals = self._sorted()
            n = vals.size
            if n == 0:
                return math.nan
            rank = q * (n - 1)
            lo = int(math.floor(rank))
            hi = min(lo + 1, n - 1)
            return float(_lerp(float(vals[lo]), float(vals[hi]), rank - lo))
        return self._bucket_quantile(q)

    def _bucket_quantile(self, q: float) -> float:
        weights = np.concatenate([[self._neg_inf], self._neg[::-1], [self._zero], self._pos, [self._pos_inf]])
        cum = np.cumsum(weights)
        total = float(cum[-1])
        if not total > 0.0:
            return math.nan
        rank = max(q * (total - 1.0), 0.0)
        i = int(np.searchsorted(cum, rank, side="right"))
        if i >= cum.size:  # float round-off at the very top: take the last non-empty slot
            i = int(np.flatnonzero(weights)[-1])
        n_neg = self._neg.size
        if i == 0:
            return -math.inf
        if i <= n_neg:
            return -self._representative(self._neg_off + (n_neg - i))
        if i == n_neg + 1:
            return 0.0
        if i <= n_neg + 1 + self._pos.size:
            return self._representative(self._pos_off + (i - n_neg - 2))
        return math.inf

    def _representative(self, k: int) -> float:
        gamma = self._gamma()
        # 2 * gamma**k / (gamma + 1) in log space: gamma**k alone may overflow for the largest floats
        try:
            return min(math.exp(k * math.log(gamma) + math.log(2.0 / (gamma + 1.0))), _FLOAT_MAX)
        except OverflowError:
            return _FLOAT_MAX

    def histogram(self, edges: ArrayLike) -> np.ndarray:
        """``numpy.histogram(finite values, edges)[0]`` as float64 (bucket mode: docs/histograms.md).
        >>> edges = [1.0, 2.0, 3.0, 4.0]  # exact mode, then bucket mode
        >>> [Sketch.of([1.0, 2.0, 2.5, 4.0], exact_limit=n).histogram(edges).tolist() for n in (None, 0)]
        [[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]
        """
        e = np.asarray(edges, dtype=np.float64)
        if e.ndim != 1 or e.size < 2 or not (np.diff(e) > 0).all() or not np.isfinite(e).all():
            raise ValueError("histogram edges must be a 1-D increasing finite array of at least 2 values")
        if self._exact:
            return np.histogram(self._sorted(), e)[0].astype(np.float64)
        log_g = math.log(self._gamma())
        pos_k = np.arange(self._pos_off, self._pos_off + self._pos.size)
        neg_k = np.arange(self._neg_off, self._neg_off + self._neg.size)
        scale = 2.0 / (self._gamma() + 1.0)
        reps = np.concatenate([-np.exp(neg_k * log_g) * scale, [0.0], np.exp(pos_k * log_g) * scale])
        weights = np.concatenate([self._neg, [self._zero], self._pos])
        # a bucket k holds (gamma**(k-1), gamma**k] (mirrored for the negative store)
        upper = np.concatenate([-np.exp((neg_k - 1) * log_g), [0.0], np.exp(pos_k * log_g)])
        lower = np.concatenate([-np.exp(neg_k * log_g), [0.0], np.exp((pos_k - 1) * log_g)])
        inside = (upper >= e[0]) & (lower <= e[-1])
        return np.histogram(np.clip(reps[inside], e[0], e[-1]), e, weights=weights[inside])[0]

    def median(self) -> float:
        """Median: the lower middle value in exact mode (like ``torch.median``), else ``quantile(0.5)``.
        >>> Sketch.of([4.0, 1.0, 3.0, 2.0]).median()
        2.0
        """
        if self._exact and self._nan == 0 and self._n:
            return float(self._sorted()[(self._n - 1) // 2])
        return self.quantile(0.5)

    # ------------------------------------------------------------------ serialisation
    def _params(self) -> str:
        return f"rel_err={self._rel_err}, exact_limit={self._exact_limit}, max_buckets={self._max_buckets}"

    def to_array(self) -> np.ndarray:
        """Flat float64 array: a 15-element header, then the values or the bucket counts (docs/reductions.md).
        >>> Sketch.of([2.0, 1.0]).to_array()[-2:].tolist()
        [1.0, 2.0]
        """
        header = np.array(
            [
                _MAGIC,
                _VERSION,
                _MODE_EXACT if self._exact else _MODE_BUCKETS,
                self._rel_err,
                self._exact_limit,
                self._max_buckets,
                self._nan,
                self._neg_inf,
                self._pos_inf,
                self._zero,
                self._n,
                self._neg_off,
                self._neg.size,
                self._pos_off,
                self._pos.size,
            ],
            dtype=np.float64,
        )
        return np.concatenate([header, self._sorted(), self._neg, self._pos])

    @classmethod
    def from_array(cls, arr: ArrayLike) -> Sketch:
        """Inverse of :meth:`to_array`.
        >>> Sketch.from_array(Sketch.of([1.0, 5.0, 2.0]).to_array()).median()
        2.0
        """
        a = np.asarray(arr, dtype=np.float64)
        if a.ndim != 1 or a.size < _HEADER or a[0] != _MAGIC:
            raise ValueError("not a Sketch array (bad shape or magic number)")
        if a[1] != _VERSION:
            raise ValueError(f"unsupported Sketch array version {a[1]!r}")
        if not (np.isfinite(a[2:6]).all() and np.isfinite(a[10:_HEADER]).all()):
            raise ValueError("corrupt Sketch array header (a parameter, size or offset is not finite)")
        mode, rel_err, exact_limit, max_buckets = a[2:6].tolist()
        nan, neg_inf, pos_inf, zero, n_values, neg_off, n_neg, pos_off, n_pos = a[6:_HEADER].tolist()
        sizes = (n_values, n_neg, n_pos)
        if mode not in (_MODE_EXACT, _MODE_BUCKETS) or any(s < 0 or s != int(s) for s in sizes):
            raise ValueError("corrupt Sketch array header")
        n_values, n_neg, n_pos = (int(s) for s in sizes)
        if a.size != _HEADER + n_values + n_neg + n_pos:
            raise ValueError(
                f"Sketch array has {a.size} elements, header says {_HEADER + n_values + n_neg + n_pos}"
            )
        if neg_off != int(neg_off) or pos_off != int(pos_off):
            raise ValueError("corrupt Sketch array header (non-integer offset)")
        out = cls(rel_err, int(exact_limit), int(max_buckets))
        body = a[_HEADER:].copy()
        out._exact = mode == _MODE_EXACT
        out._nan = nan
        out._neg_inf, out._pos_inf, out._zero = neg_inf, pos_inf, zero
        out._values = _frozen(body[:n_values]) if n_values else _EMPTY
        out._n = n_values
        out._neg_off, out._pos_off = int(neg_off), int(pos_off)
        out._neg = _frozen(body[n_values : n_values + n_neg]) if n_neg else _EMPTY
        out._pos = _frozen(body[n_values + n_neg :]) if n_pos else _EMPTY
        return out

    def validate(self) -> None:
        """ValueError unless data can give it (docs/reliability.md, "Contributions from other processes").
        >>> Sketch.of([1.0, 2.0]).validate()
        >>> bad = Sketch.of([1.0], weights=[2.0]).to_array()
        >>> bad[13] = 1e7  # the positive store's offset
        >>> Sketch.from_array(bad).validate()
        Traceback (most recent call last):
        ...
        ValueError: sketch: 1 positive buckets from 10000000 outside [-69077, 70979] (rel_err=0.005)
        """
        weights = np.concatenate(
            [[self._nan, self._neg_inf, self._pos_inf, self._zero], self._neg, self._pos]
        )
        if not (np.isfinite(weights).all() and (weights >= 0).all()):
            raise ValueError("sketch: a weight is negative or not finite")
        lo, hi = self._indices()
        width = min(self._max_buckets, hi - lo + 1)
        if width > _MAX_STORE:
            raise ValueError(
                f"sketch ({self._params()}): stores up to {width} buckets, more than {_MAX_STORE}"
            )
        for sign, off, store in (
            ("negative", self._neg_off, self._neg),
            ("positive", self._pos_off, self._pos),
        ):
            if store.size > self._max_buckets:
                raise ValueError(
                    f"sketch: {store.size} {sign} buckets, more than max_buckets={self._max_buckets}"
                )
            if off < lo or off + store.size - 1 > hi:
                raise ValueError(
                    f"sketch: {store.size} {sign} buckets from {off} outside [{lo}, {hi}] "
                    f"(rel_err={self._rel_err})"
                )
        v = self._sorted()
        if not self._exact:
            if v.size:
                raise ValueError("sketch: a bucket-mode sketch has exact values")
            return
        if v.size > self._exact_limit:
            raise ValueError(f"sketch: {v.size} exact values, more than {self._exact_limit}")
        if np.isnan(v).any() or (v[1:] < v[:-1]).any():
            raise ValueError("sketch: exact values must be sorted, without NaN")
        if weights[1:].any() or self._neg.size or self._pos.size:
            raise ValueError("sketch: an exact sketch has buckets")

    def _indices(self) -> tuple[int, int]:
        """The lowest and highest bucket index of a finite magnitude, widened by one against rounding."""
        k = np.ceil(np.log([_TINY, _FLOAT_MAX]) / math.log(self._gamma()))
        return int(k[0]) - 1, int(k[1]) + 1

    def __repr__(self) -> str:
        if self._exact:
            return f"Sketch(exact, n={self._n}, count={self.count:g}, {self._params()})"
        return (
            f"Sketch(buckets, count={self.count:g}, neg_buckets={self._neg.size}, "
            f"pos_buckets={self._pos.size}, {self._params()})"
        )
