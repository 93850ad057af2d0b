"""verl 0.9.1's metric functions with verl's names and signatures, exact across data-parallel ranks.

A drop-in for ``verl.trainer.ppo.metric_utils`` and ``verl.utils.metric`` (verl is not needed)::

    from rlmetrics.integrations.verl import (
        AggregationType, Metric, compute_data_metrics, compute_throughout_metrics, compute_timing_metrics,
        compute_variance_proxy_metrics, process_validation_metrics, reduce_metrics)

On one process every function returns verl's keys and numbers (verl sums in float32, we in float64).
Across data-parallel ranks, each rank submits its shard's result through a client with verl's naming
(:func:`connect`, or ``connect(..., naming=NAMING)``) and the merged number is verl's on the full
batch (docs/verl.md, "Across ranks").

>>> import torch
>>> batch = {"prompts": torch.zeros(2, 2), "responses": torch.zeros(2, 2),
...          "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]]),
...          "response_mask": torch.tensor([[1, 1], [1, 0]]),
...          "token_level_scores": torch.tensor([[0.0, 1.0], [0.5, 0.0]]),
...          "token_level_rewards": torch.tensor([[0.0, 1.0], [0.5, 0.0]]),
...          "advantages": torch.tensor([[1.0, 2.0], [3.0, 9.0]]), "returns": torch.ones(2, 2)}
>>> m = compute_data_metrics(batch, use_critic=False)
>>> m["critic/advantages/mean"], m["response_length/mean"], m["prompt_length/clip_ratio"]
(2.0, 1.5, 0.5)
>>> m["critic/advantages/mean"].stat.count  # what a rank submits: 3 response tokens
3.0

Modules: ``batch`` (batch functions, :class:`Value`), ``worker`` (:class:`Metric`,
``reduce_metrics``), ``naming``, ``tracking`` (verl's :class:`Tracking` over rlmetrics' sinks).
"""

from __future__ import annotations

from rlmetrics.integrations.verl.batch import (
    VERL_REDUCTIONS,
    Value,
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    compute_variance_proxy_metrics,
    process_validation_metrics,
)
from rlmetrics.integrations.verl.naming import NAMING, Naming, connect, submit_validation_metrics
from rlmetrics.integrations.verl.tracking import Tracking
from rlmetrics.integrations.verl.worker import AggregationType, Metric, reduce_metrics

__all__ = [
    "NAMING", "VERL_REDUCTIONS", "AggregationType", "Metric", "Naming", "Tracking", "Value",
    "compute_data_metrics", "compute_throughout_metrics", "compute_timing_metrics",
    "compute_variance_proxy_metrics", "connect", "process_validation_metrics", "reduce_metrics",
    "submit_validation_metrics",
]  # fmt: skip
