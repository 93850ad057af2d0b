"""Staleness of an asynchronous batch: policy versions the samples lag behind the trainer, token-weighted.

Rules and names: docs/axes.md, "Staleness".

>>> from rlmetrics.packing import pack
>>> m = staleness_metrics(7, min_version=[7, 6, 5], max_version=[7, 7, 6], tokens=[10, 20, 10], bins=2)
>>> from rlmetrics.engine.aggregator import Aggregator
>>> engine = Aggregator()
>>> _ = engine.submit("rank0", 0, 0, 1, pack(m))
>>> {k: round(v, 4) for k, v in engine.finalize(0).items()}  # doctest: +NORMALIZE_WHITESPACE
{'staleness/version_lag/mean': 1.0, 'staleness/version_lag/max': 2.0,
 'staleness/version_lag/share/0': 0.25, 'staleness/version_lag/share/1': 0.5,
 'staleness/version_lag/share/2+': 0.25, 'staleness/version_span/mean': 0.75}
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlmetrics.core.values import MetricValueError

LAG = "staleness/version_lag"
SPAN = "staleness/version_span/mean"


def staleness_metrics(
    current_version: int,
    min_version: Any,
    max_version: Any = None,
    tokens: Any = None,
    bins: int = 4,
) -> dict[str, Any]:
    """``{name: value}`` of the batch's staleness, for ``submit_metric``. ``min_version`` / ``max_version``:
    per sample, its tokens' oldest / newest policy version; ``tokens``: per sample (default 1 each).
    Raises ``MetricValueError`` on mismatched lengths or a version above ``current_version``."""
    lo = np.asarray(min_version, dtype=np.float64).reshape(-1)
    lag = float(current_version) - lo
    w = np.ones_like(lo) if tokens is None else np.asarray(tokens, dtype=np.float64).reshape(-1)
    if w.shape != lo.shape:
        raise MetricValueError(f"{LAG}: tokens has {w.size} samples, min_version {lo.size}")
    if lag.size and lag.min() < 0:
        raise MetricValueError(
            f"{LAG}: a sample's min_version {lo.max():g} is above current_version {current_version}"
        )
    out: dict[str, Any] = {f"{LAG}/mean": (lag, w), f"{LAG}/max": lag}
    for k in range(bins):
        out[f"{LAG}/share/{k}"] = ((lag == k).astype(np.float64), w)
    out[f"{LAG}/share/{bins}+"] = ((lag >= bins).astype(np.float64), w)
    if max_version is not None:
        hi = np.asarray(max_version, dtype=np.float64).reshape(-1)
        if hi.shape != lo.shape or (hi < lo).any():
            raise MetricValueError(f"{SPAN}: max_version must have one value per sample, each >= min_version")
        out[SPAN] = (hi - lo, w)
    return out
