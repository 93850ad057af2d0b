"""verl 0.9.1's metric functions with verl's names and signatures, exact across data-parallel ranks.

A drop-in for ``verl.trainer.ppo.metric_utils`` and ``verl.utils.metric`` (verl is not needed)::

    from rlmetrics.integrations.verl import (
        AggregationType, Metric, compute_data_metrics, compute_throughout_metrics, compute_timing_metrics,
        compute_variance_proxy_metrics, process_validation_metrics, reduce_metrics)

On one process every function returns verl's keys and numbers (float rounding aside: verl sums in
float32, we in float64). Batches are recognised by shape: a ``DataProto`` (an object with ``.batch``,
a TensorDict, ``.non_tensor_batch``, a dict of numpy arrays, and ``.meta_info``), its TensorDict, or a
plain dict of tensors and arrays.

**Across ranks.** The batch functions return :class:`Value` floats: verl's number, carrying the
mergeable summary behind it. Each data-parallel rank calls the same function on its own shard and
submits the result through a client with verl's naming (:func:`connect`, or any backend's
``connect(..., naming=NAMING)``); merged, the result is verl's number for the full batch under verl's
name: token- and sequence-weighted means, global min/max, ``critic/vf_explained_var``,
``timing_per_token_ms/*``, ``perf/throughput`` and ``variance_proxy/proxy3_pure_noise`` derived from
merged sums. ``timing_s/*`` keeps its name. Validation samples go with
:func:`submit_validation_metrics`; the merged keys are those verl's trainer logs
(``val-core/{source}/{var}/{metric}``, ``val-aux/...``).

Worker metrics submitted with verl's naming: a verl :class:`Metric` (ours or verl's own, recognised by
shape) merges as verl's ``Metric.aggregate_dp`` does (mean over ranks and micro-batches; ``SUM``:
the mean over ranks of each rank's sum; min/max over all values); a list of per-micro-batch values
merges as ``reduce_metrics`` of the concatenated lists, a list under a ``.../std`` name included
(the mean of the stds); a ``(value, tokens)`` pair per micro-batch merges to the value over all
tokens of all ranks (``actor/pg_loss``, ``actor/entropy``, ...). Reductions are resolved from whole
tokens of the name (``actor/minibatch_loss`` is a mean), with verl's exceptions in
:data:`VERL_REDUCTIONS`.

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

The code: :mod:`~rlmetrics.integrations.verl.batch` (the batch functions and :class:`Value`),
:mod:`~rlmetrics.integrations.verl.worker` (:class:`Metric`, ``reduce_metrics``),
:mod:`~rlmetrics.integrations.verl.naming` (submitting with verl's naming),
:mod:`~rlmetrics.integrations.verl.tracking` (:class:`Tracking`, verl's logger over rlmetrics' sinks).
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
