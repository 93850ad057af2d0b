"""Histograms of all ranks' data: what a ``hist`` reduction reports, read from a merged quantile sketch.

Edges and counts, and how close they are to numpy's: docs/histograms.md, "Accuracy".

>>> from rlmetrics.core.stat import Stat
>>> h = Histogram.of(Stat.of([1.0, 2.0, 2.0, 5.0], sketch=True), bins=4)
>>> h.edges.tolist(), h.counts.tolist()
([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 0.0, 1.0])
>>> Histogram.from_dict(h.to_dict()) == h
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlmetrics.core.stat import Stat

HIST_BINS = 64
"""Bins of a reported histogram (W&B's default)."""


@dataclass(frozen=True, eq=False)
class Histogram:
    """``counts[i]``: weight in ``[edges[i], edges[i + 1])`` (the last bin closed); the data's sums."""

    edges: np.ndarray
    counts: np.ndarray
    sum: float = math.nan
    sum_squares: float = math.nan

    @classmethod
    def of(cls, stat: Stat, bins: int = HIST_BINS) -> Histogram | None:
        """The histogram of a merged Stat with a sketch; None without observations or with a non-finite."""
        if stat.sketch is None:
            raise ValueError("a histogram needs a quantile sketch (Stat.of(..., sketch=True))")
        if not (stat.count > 0 and math.isfinite(stat.min) and math.isfinite(stat.max)):
            return None
        edges = np.histogram_bin_edges(np.array([stat.min, stat.max]), bins)
        sum_squares = stat.m2 + stat.sum * stat.sum / stat.count
        return cls(edges, stat.sketch.histogram(edges), stat.sum, sum_squares)

    @property
    def count(self) -> float:
        """Total weight in the bins."""
        return float(self.counts.sum())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"edges": [...], "counts": [...], "sum": s, "sum_squares": s2}``."""
        return {
            "edges": self.edges.tolist(),
            "counts": self.counts.tolist(),
            "sum": self.sum,
            "sum_squares": self.sum_squares,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Histogram:
        """Inverse of :meth:`to_dict`."""
        edges = np.asarray(d["edges"], dtype=np.float64)
        counts = np.asarray(d["counts"], dtype=np.float64)
        if edges.ndim != 1 or counts.shape != (edges.size - 1,):
            raise ValueError(f"a histogram needs n + 1 edges for n counts: {edges.size} and {counts.size}")
        return cls(edges, counts, float(d.get("sum", math.nan)), float(d.get("sum_squares", math.nan)))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Histogram)
            and np.array_equal(self.edges, other.edges)
            and np.array_equal(self.counts, other.counts)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        lo, hi = self.edges[0], self.edges[-1]
        return f"Histogram(bins={self.counts.size}, count={self.count:g}, range=[{lo:g}, {hi:g}])"


__all__ = ["HIST_BINS", "Histogram"]
