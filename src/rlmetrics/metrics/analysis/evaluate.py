"""How the example metrics are computed: planners queue device tensors, one copy brings them to the host,
readers turn them into statistics, reported in the seed's view (floats) or the mergeable one (Stats).

A *planner* ``planner(data, call)`` looks at the inputs and queues, with ``call.add(tensors, read)``,
the device tensors its metrics need and a reader that turns their host arrays into :class:`Out`
statistics. :func:`evaluate` runs the planners of one call and moves every queued tensor to the host
in one copy (:class:`~rlmetrics.core.host.HostPlan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.core.host import HostPlan
from rlmetrics.core.reduce import resolve
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import Stat
from rlmetrics.core.summary import NAN_STRATEGIES, summarize
from rlmetrics.core.values import MetricValueError
from rlmetrics.extras import require
from rlmetrics.metrics.batch import as_batch

torch = require("torch", "torch")


@dataclass(frozen=True)
class Out:
    """One statistic on the host: the names it answers, its Stat and, if unweighted, its values."""

    names: tuple[str, ...]
    stat: Stat
    values: np.ndarray | None = None  # the observations (unit weights): exact quantiles in the dict view


def obs(names: tuple[str, ...], values: np.ndarray) -> Out:
    """The observations ``values`` (unit weights), with a sketch when a name needs quantiles."""
    sketch = any(resolve(n).needs_sketch for n in names)
    return Out(names, Stat.of(values, sketch=sketch, name=names[0]), values)


def ratio(names: tuple[str, ...], num: float, den: float) -> Out:
    """``num / den`` as one observation of weight ``den``: merged, sum(num) / sum(den) over ranks."""
    if den == 0:
        return Out(names, Stat())
    r = num / den
    return Out(names, Stat(den, num, 0.0, r, r))


def summary(x: torch.Tensor, weight: torch.Tensor | None = None, drop: bool = False) -> torch.Tensor:
    """``[count, sum, m2, min, max]`` (float64, on x's device) of ``x`` weighted by ``weight``, by
    :func:`~rlmetrics.core.summary.summarize`: values of weight 0 drop out, NaN elsewhere propagates;
    with ``drop`` non-finite values drop out too."""
    x = x.detach()
    w = None if weight is None else weight.detach().to(torch.float64).broadcast_to(x.shape).reshape(-1)
    x = x.to(torch.float64).reshape(-1)
    if x.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)  # host: no copy
    return summarize(x, weight=w, nan_strategy="drop" if drop else "propagate")


def as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def get(data: Any, key: str) -> Any:
    return data[key] if key in data else None


@dataclass
class Call:
    """One evaluation: its options, what its metrics share (``shared``: e.g. the token rows of one
    ``(responses, mask)``) and the :class:`~rlmetrics.core.host.HostPlan` of its device tensors."""

    chunk_elements: int | None = None
    drop: bool = False  # device summaries leave non-finite values out
    plan: HostPlan = field(default_factory=HostPlan)
    shared: dict[Any, Any] = field(default_factory=dict)

    def add(self, tensors: Sequence[torch.Tensor], read: Callable[..., list[Out]]) -> None:
        """``read(*host_arrays)`` (1-D float64, one per tensor) returns the statistics."""
        self.plan.add(tensors, read)


Planner = Callable[[Any, Call], None]


def evaluate(
    data: Any, planners: Sequence[Planner], chunk_elements: int | None = None, nan_strategy: str = "propagate"
) -> list[Out]:
    """The statistics of ``planners`` on ``data``, with one device-to-host copy."""
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    data = as_batch(data, "rlmetrics.metrics.analysis")
    call = Call(chunk_elements, nan_strategy == "drop")
    for planner in planners:
        planner(data, call)
    return [_finite(out, nan_strategy) for outs in call.plan.run() for out in outs]


def _finite(out: Out, nan_strategy: str) -> Out:
    """``out`` under ``nan_strategy``: non-finite observations dropped (device summaries drop them
    already, ratios drop as one) or refused."""
    if nan_strategy == "propagate" or out.stat.finite:
        return out
    if nan_strategy == "error":
        raise MetricValueError(f"metric {out.names[0]!r}: non-finite value(s) (nan_strategy='error')")
    if out.values is not None:
        return obs(out.names, out.values[np.isfinite(out.values)])
    return Out(out.names, Stat())


def stats_of(
    data: Any, planners: Sequence[Planner], chunk_elements: int | None = None, nan_strategy: str = "propagate"
) -> dict[str, Stat]:
    """The mergeable view of :func:`evaluate`: a Stat per name."""
    return as_stats(evaluate(data, planners, chunk_elements, nan_strategy))


def floats_of(
    data: Any, planners: Sequence[Planner], chunk_elements: int | None = None, nan_strategy: str = "propagate"
) -> dict[str, float]:
    """The seed's view of :func:`evaluate`: this rank's number per name."""
    return as_floats(evaluate(data, planners, chunk_elements, nan_strategy))


def as_stats(outs: list[Out]) -> dict[str, Stat]:
    """The mergeable view: a Stat per name (names of one statistic share it)."""
    return {name: out.stat for out in outs for name in out.names}


def _seed_value(name: str, out: Out) -> float:
    """The number the seed's code reports for ``name`` on this rank."""
    red = resolve(name)
    stat = out.stat
    if red.kind == "std":  # torch's .std(): unbiased
        return math.sqrt(max(stat.m2, 0.0) / (stat.count - 1)) if stat.count > 1 else math.nan
    if red.needs_sketch and out.values is not None:  # exact, however many values
        exact = Sketch.of(out.values, exact_limit=max(out.values.size, 1))
        return red.apply(Stat(*stat.to_array().tolist(), sketch=exact))
    return red.apply(stat)


def as_floats(outs: list[Out]) -> dict[str, float]:
    """The seed's view: the number the seed's code reports for each name on this rank."""
    return {name: _seed_value(name, out) for out in outs for name in out.names}


__all__ = [
    "Call", "Out", "Planner", "as_floats", "as_stats", "as_tensor", "evaluate", "floats_of", "get", "obs",
    "ratio", "stats_of", "summary",
]  # fmt: skip
