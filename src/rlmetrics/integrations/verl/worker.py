"""verl's worker metrics: :class:`Metric`, :class:`AggregationType` and :func:`reduce_metrics`
(docs/verl.md, "What changes in the numbers, and why")."""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np

from rlmetrics.core.reduce import MAX, MEAN, MIN, SUM, Reduction
from rlmetrics.core.stat import Stat


class AggregationType(Enum):
    """How a :class:`Metric` aggregates its values (verl's)."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_BY_AGGREGATION = {
    AggregationType.MEAN: MEAN,
    AggregationType.SUM: SUM,
    AggregationType.MIN: MIN,
    AggregationType.MAX: MAX,
}


class Metric:
    """verl's ``Metric``: one metric's values (one per micro-batch) and how they aggregate.

    >>> m = Metric(aggregation="mean", value=1.0)
    >>> m.append(2.0); m.extend([3.0])
    >>> float(m.aggregate())
    2.0
    >>> rank0, rank1 = Metric("sum", 1.0), Metric("sum", 3.0)
    >>> rank0.append(2.0); rank1.append(6.0)
    >>> float(Metric.aggregate_dp([rank0, rank1]))  # sum over micro-batches of the mean over ranks
    6.0
    """

    def __init__(self, aggregation: str | AggregationType, value: Any = None) -> None:
        self.aggregation = AggregationType(aggregation) if isinstance(aggregation, str) else aggregation
        if not isinstance(self.aggregation, AggregationType):
            raise ValueError(f"Unsupported aggregation type: {aggregation}")
        self.values: list[Any] = []
        if value is not None:
            self.append(value)

    def append(self, value: Any) -> None:
        """Add one value (a number, a one-element tensor or an array), or every value of a Metric."""
        if is_metric(value):
            self.extend(value)
            return
        if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
            if value.numel() != 1:
                raise ValueError("Only scalar tensors can be converted to float")
            value = value.detach().item()
        if not isinstance(value, (numbers.Number, np.ndarray)) or isinstance(value, complex):
            raise ValueError(f"Unsupported value type: {type(value)}")
        self.values.append(value)

    def extend(self, values: Any) -> None:
        """Add every value of ``values`` (a list, or a Metric of the same aggregation)."""
        if is_metric(values):
            if aggregation_of(values) != self.aggregation:
                raise ValueError(f"Aggregation type mismatch: {self.aggregation} != {values.aggregation}")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        """The values' mean, sum, min or max."""
        return _BY_AGGREGATION[self.aggregation].apply(Stat.of(self.values))

    @classmethod
    def aggregate_dp(cls, metric_lists: Sequence[Any]) -> float:
        """One value from each dp rank's Metric, as verl's (ValueError unless they hold as many values)."""
        if not metric_lists:
            raise ValueError("Cannot aggregate an empty list of metrics.")
        lengths = [len(m.values) for m in metric_lists]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"All Metric instances must have the same number of values for dp aggregation: {lengths}"
            )
        aggregation = aggregation_of(metric_lists[0])
        table = np.asarray([m.values for m in metric_lists], dtype=np.float64)  # (ranks, micro-batches)
        if aggregation in (AggregationType.MEAN, AggregationType.SUM):
            table = table.mean(axis=0)
        return _BY_AGGREGATION[aggregation].apply(Stat.of(table))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], aggregation: str | AggregationType) -> dict[str, Metric]:
        """A Metric per entry of ``data``, all of ``aggregation``."""
        return {key: cls(aggregation=aggregation, value=value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty Metric of the same aggregation."""
        return type(self)(aggregation=self.aggregation)

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value!r}, values={self.values!r})"


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's ``reduce_metrics``, into a new dict: a :class:`Metric` aggregates, a list is reduced by
    the name's whole tokens (``max``/``maximum``, else ``min``/``minimum``, else the mean).

    >>> reduce_metrics({"loss": [1.0, 2.0], "max_reward": [5.0, 8.0], "actor/minibatch_loss": [1.0, 3.0]})
    {'loss': 1.5, 'max_reward': 8.0, 'actor/minibatch_loss': 2.0}
    """
    out = {}
    for key, value in metrics.items():
        if is_metric(value):
            out[key] = float(value.aggregate())
        else:
            out[key] = _list_reduction(key).apply(Stat.of(value, name=key))
    return out


def _list_reduction(key: str) -> Reduction:
    tokens = set(re.split(r"[/_@.\-]", key.lower()))
    if tokens & {"max", "maximum"}:
        return MAX
    return MIN if tokens & {"min", "minimum"} else MEAN


def is_metric(value: Any) -> bool:
    """A verl ``Metric`` (ours or verl's): ``values`` and an ``aggregation`` of verl's kinds."""
    aggregation = getattr(value, "aggregation", None)
    return hasattr(value, "values") and getattr(aggregation, "value", None) in ("mean", "sum", "min", "max")


def aggregation_of(metric: Any) -> AggregationType:
    return AggregationType(metric.aggregation.value)


def metric_stat(metric: Any) -> tuple[Stat, Reduction]:
    """What a rank submits for a Metric, and its reduction (``SUM``: its sum, averaged over ranks)."""
    aggregation = aggregation_of(metric)
    if aggregation is AggregationType.SUM:
        return Stat.of(float(np.sum(np.asarray(metric.values, dtype=np.float64)))), MEAN
    return Stat.of(metric.values), _BY_AGGREGATION[aggregation]


__all__ = ["AggregationType", "Metric", "aggregation_of", "is_metric", "metric_stat", "reduce_metrics"]
