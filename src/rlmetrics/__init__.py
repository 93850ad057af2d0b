"""rlmetrics: exact, fast, fault-tolerant distributed metrics for RL post-training of LLMs.

>>> import rlmetrics
>>> s = rlmetrics.Stat.of([1.0, 2.0]).merge(rlmetrics.Stat.of([3.0]))
>>> s.mean, rlmetrics.resolve("critic/score/max").name
(2.0, 'max')
"""

from importlib import import_module as _import_module

from rlmetrics import metrics as _metrics  # noqa: F401  the built-in families plug their metrics in
from rlmetrics.backends import MetricClient, connect
from rlmetrics.backends.local import LocalMetricWorker
from rlmetrics.core.reduce import (
    COUNT,
    MAX,
    MEAN,
    MEDIAN,
    MIN,
    SPECIAL_METRICS,
    STD,
    SUM,
    MaxMetric,
    MeanMetric,
    MedianMetric,
    Metric,
    MetricFunc,
    MinMetric,
    PercentileMetric,
    Reduction,
    SumMetric,
    percentile,
    register_reduction,
    resolve,
    unregister_reduction,
)
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import MetricValueError, Stat
from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.messages import (
    ApproximateWarning,
    LateDataWarning,
    NonFiniteWarning,
    PartialStepWarning,
    ProvisionalWarning,
    RayStartedWarning,
    RLMetricsWarning,
    StepMeta,
    StepResult,
    StepWarning,
    SubmissionError,
    ValueWarning,
    WorldSizeWarning,
)
from rlmetrics.packing import pack

__version__ = "0.1.0"


_SUBPACKAGES = ("axes", "health", "integrations", "sinks")


def __getattr__(name: str):
    """``MetricWorker`` and ``get_metric_worker`` need Ray: imported on first use (extra ``ray``);
    so are the subpackages the docs name as ``rlmetrics.sinks`` etc."""
    if name in ("MetricWorker", "get_metric_worker"):
        from rlmetrics.backends import ray as ray_backend

        return getattr(ray_backend, name)
    if name in _SUBPACKAGES:
        return _import_module(f"rlmetrics.{name}")
    raise AttributeError(f"module 'rlmetrics' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What a user of ``rlmetrics`` needs (:data:`__all__`); the submodules are importable by name."""
    return sorted(__all__)


__all__ = [
    "COUNT", "MAX", "MEAN", "MEDIAN", "MIN", "SPECIAL_METRICS", "STD", "SUM", "Aggregator",
    "ApproximateWarning",
    "LateDataWarning", "LocalMetricWorker", "MaxMetric", "MeanMetric", "MedianMetric", "Metric",
    "MetricClient", "MetricFunc", "MetricValueError", "MetricWorker", "MinMetric", "NonFiniteWarning",
    "PartialStepWarning", "PercentileMetric", "ProvisionalWarning", "RLMetricsWarning", "RayStartedWarning",
    "Reduction", "Sketch", "Stat", "StepMeta", "StepResult", "StepWarning", "SubmissionError", "SumMetric",
    "ValueWarning", "WorldSizeWarning", "connect", "get_metric_worker", "pack", "percentile",
    "register_reduction", "resolve", "unregister_reduction",
]  # fmt: skip
