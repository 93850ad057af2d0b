"""The one summary kernel: count, sum, M2, min and max of observations, for numpy arrays and torch tensors.

:func:`summarize` (a tensor on its own device, without a sync) and its pieces, shared with
:mod:`rlmetrics.metrics.data.tokens`. ``nan_strategy``: docs/reductions.md, "The value policy".

>>> summarize(np.array([1.0, 2.0, 3.0, 10.0]), keep=np.array([1, 1, 1, 0]) != 0).tolist()
[3.0, 6.0, 2.0, 1.0, 3.0]
>>> summarize(np.array([[1.0, 3.0], [2.0, np.nan]]), nan_strategy="drop")[:, 1].tolist()
[1.0, 2.0, 0.0, 2.0, 2.0]
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

NAN_STRATEGIES = ("propagate", "drop", "error")
"""What happens to non-finite values: kept (they reach the statistics), left out, or refused."""


def backend(x: Any) -> Any:
    """The array module of ``x``: ``torch`` for a tensor, else ``numpy`` (torch is never imported here)."""
    torch = sys.modules.get("torch")  # not imported: no tensor exists
    return torch if torch is not None and isinstance(x, torch.Tensor) else np


# ------------------------------------------------------------------------------------------ the pieces
def total(xp: Any, x: Any, levels: int = 1) -> Any:
    """Sum over the last ``levels`` axes: the last in the data's precision, the others in float64."""
    out = x.sum(-1)
    for _ in range(levels - 1):
        out = out.sum(-1, dtype=xp.float64)
    return out


def divisor(xp: Any, count: Any) -> Any:
    """What sums are divided by for a mean: ``count``, or 1 where there is no observation."""
    return count + (count == 0)


def extremes(xp: Any, x: Any, keep: Any = None) -> tuple[Any, Any]:
    """Min and max over the last axis where ``keep`` (``inf`` / ``-inf`` where nothing is); NaN propagates."""
    lo, hi = (x, x) if keep is None else (xp.where(keep, x, math.inf), xp.where(keep, x, -math.inf))
    if xp is np:
        return lo.min(-1, initial=np.inf), hi.max(-1, initial=-np.inf)
    if x.shape[-1] == 0:
        lo = xp.full(x.shape[:-1], math.inf, dtype=x.dtype, device=x.device)
        return lo, -lo
    if keep is None and (x.dim() == 1 or (x.dim() == 2 and x.shape[0] == 1)):
        lo, hi = xp.aminmax(x.reshape(-1))  # one pass for both (aminmax over a dim is slow on CPU)
        return (lo, hi) if x.dim() == 1 else (lo[None], hi[None])
    return lo.amin(-1), hi.amax(-1)


def square_(xp: Any, dev: Any, weight: Any = None) -> Any:
    """``dev ** 2 * weight`` in place (``dev`` is a temporary of the caller's)."""
    if xp is np:
        np.square(dev, out=dev)
        if weight is not None:
            dev *= weight
        return dev
    dev.mul_(dev)
    return dev if weight is None else dev.mul_(weight)


def finish(xp: Any, count: Any, sums: Any, m2: Any, mins: Any, maxs: Any) -> Any:
    """The ``(5, ...)`` float64 stat array."""
    if xp is not np:
        mins, maxs = mins.to(xp.float64), maxs.to(xp.float64)
    if tuple(count.shape) != tuple(sums.shape):
        count = xp.broadcast_to(count, sums.shape)
    return xp.stack([count, sums, m2, mins, maxs])


# ------------------------------------------------------------------------------------------ the kernel
def summarize(x: Any, keep: Any = None, weight: Any = None, *, nan_strategy: str = "propagate") -> Any:
    """The ``(5, ...)`` stat array of float64 ``x`` along its last axis; ``keep``: which values are
    observations (None: all); ``weight`` of ``x``'s shape (None: 1 each; not positive: dropped).
    >>> summarize(np.array([1.0, 3.0]), weight=np.array([3.0, 1.0])).tolist()
    [4.0, 6.0, 3.0, 1.0, 3.0]
    """
    xp = backend(x)
    if nan_strategy == "drop":
        finite = xp.isfinite(x)
        keep = finite if keep is None else keep & finite
    if weight is not None:
        keep = weight > 0 if keep is None else keep & (weight > 0)
        weight = xp.where(keep, weight, 0.0)
    if keep is None:
        shape, n = tuple(x.shape[:-1]), float(x.shape[-1])
        count = np.full(shape, n) if xp is np else xp.full(shape, n, dtype=xp.float64, device=x.device)
        sums = total(xp, x)
        mean = sums / max(n, 1.0)
        mins, maxs = extremes(xp, x)
        m2 = total(xp, square_(xp, x - mean[..., None]))
        return finish(xp, count, sums, m2, mins, maxs)
    count = keep.sum(-1, dtype=xp.float64) if weight is None else weight.sum(-1)
    masked = xp.where(keep, x, 0.0)
    sums = total(xp, masked if weight is None else masked * weight)
    mean = sums / divisor(xp, count)
    mins, maxs = extremes(xp, x, keep)
    dev = xp.where(keep, x - mean[..., None], 0.0)  # not (0 - mean)**2 * 0: nan if that overflows
    m2 = total(xp, square_(xp, dev, weight))
    return finish(xp, count, sums, m2, mins, maxs)


def nonfinite(x: Any, keep: Any = None, weight: Any = None) -> Any:
    """How many observations (as :func:`summarize` selects them) are NaN or infinite, along the last axis.
    >>> float(nonfinite(np.array([1.0, np.nan, np.inf]), keep=np.array([True, True, False])))
    1.0
    """
    xp = backend(x)
    bad = ~xp.isfinite(x)
    if keep is not None:
        bad = bad & keep
    if weight is not None:
        bad = bad & (weight > 0)
    return bad.sum(-1, dtype=xp.float64)


def stats_of_rows(rows: np.ndarray) -> np.ndarray:
    """The ``(5, M)`` stat array of ``k`` single observations per column, ``rows`` of shape ``(k, M)``.
    >>> stats_of_rows(np.array([[1.0], [3.0]]))[:, 0].tolist()
    [2.0, 4.0, 2.0, 1.0, 3.0]
    """
    return summarize(rows.T)


__all__ = [
    "NAN_STRATEGIES", "backend", "divisor", "extremes", "finish", "nonfinite", "square_", "stats_of_rows",
    "summarize", "total",
]  # fmt: skip
