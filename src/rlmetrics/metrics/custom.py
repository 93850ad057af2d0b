"""User metric functions that run with the built-ins, and the seed's ``DEBUG_METRICS`` report.

Rules: docs/metrics.md, "Data, timing and throughput metrics".

>>> def reward_spread(batch):
...     return {"custom/reward_spread/max": max(batch["rewards"]) - min(batch["rewards"])}
>>> _ = register_metric(reward_spread)
>>> run_custom_metrics({"rewards": [0.0, 1.0, 0.25]})
{'custom/reward_spread/max': 1.0}
>>> unregister_metric(reward_spread)
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from rlmetrics.core.stat import Stat
from rlmetrics.messages import NonFiniteWarning, ValueWarning, caller_level

logger = logging.getLogger(__name__)

MetricFn = Callable[[Any], Mapping[str, Any]]
_CUSTOM: dict[str, MetricFn] = {}  # a registry, like the reductions': name -> function


def _name(fn: MetricFn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_metric(fn: MetricFn, name: str | None = None) -> MetricFn:
    """Run ``fn(batch)`` in every ``compute_local_data_metric`` of this process; usable as a decorator."""
    if not callable(fn):
        raise TypeError(f"register_metric needs a callable, got {type(fn).__name__}")
    _CUSTOM[name or _name(fn)] = fn
    return fn


def unregister_metric(fn_or_name: MetricFn | str) -> None:
    """Remove a function added by :func:`register_metric` (no error when absent)."""
    _CUSTOM.pop(fn_or_name if isinstance(fn_or_name, str) else _name(fn_or_name), None)


def run_custom_metrics(batch: Any) -> dict[str, Any]:
    """The merged output of every registered function; one that raises is logged and skipped."""
    out: dict[str, Any] = {}
    for name, fn in list(_CUSTOM.items()):
        try:
            out.update(fn(batch))
        except Exception:  # a user's metric must never stop training or the other metrics
            logger.exception("custom metric function %s failed; its metrics are skipped", name)
    return out


def debug_enabled() -> bool:
    return os.environ.get("DEBUG_METRICS", "0") == "1"


def debug_report(batch: Any, metrics: Mapping[str, Any]) -> None:
    """Log the batch's keys and shapes and the metrics; warn on values of a bad type or not finite."""
    keys = list(batch.keys()) if hasattr(batch, "keys") else []
    logger.warning("DEBUG_METRICS data keys: %s", keys)
    logger.warning(
        "DEBUG_METRICS data shapes: %s",
        [(k, tuple(batch[k].shape) if hasattr(batch[k], "shape") else type(batch[k]).__name__) for k in keys],
    )
    logger.warning("DEBUG_METRICS computed metrics: %s", dict(metrics))
    for name, value in metrics.items():
        if isinstance(value, Stat):
            problem = value.count > 0 and not math.isfinite(value.mean)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            if not hasattr(value, "shape"):  # tensors and arrays are data; anything else is suspect
                msg = f"metric {name!r} has invalid type {type(value).__name__}"
                warnings.warn(msg, ValueWarning, stacklevel=caller_level())
            continue
        else:
            problem = not math.isfinite(value)
        if problem:
            msg = f"metric {name!r} is not finite: {value}"
            warnings.warn(msg, NonFiniteWarning, stacklevel=caller_level())
