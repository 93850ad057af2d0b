"""The seed's example metrics ("Custom Metrics Implementation"), vectorised and exact under merging.

Every example function of the seed keeps its name, its metric names and its per-rank numbers, without
a Python loop over the batch or the sequence: per-row statistics come from masks and cumsums, distinct
tokens and bigrams from one sort of packed keys, policy entropy from row chunks of bounded size.

Each family has two views of **one** computation:

* ``compute_*(data) -> dict[str, float]`` -- the seed's function: the numbers one rank reports.
* ``compute_*_stats(data) -> dict[str, Stat]`` -- what a rank submits: one
  :class:`~rlmetrics.core.stat.Stat` per name (names of one statistic share the same Stat), so the
  aggregator reports the statistic of all ranks' data together. Per-sequence metrics carry the
  per-sequence values, token metrics the token values (summarized on the device), ratios their
  numerator and denominator.

All device tensors a call needs go to the host in **one** copy, and on an accelerator nothing is read
earlier (no ``.item()``, no data-dependent shape), so the device is never synchronized mid-way.

**std.** The dict view returns torch's ``.std()`` as the seed does (unbiased, ``n - 1``; NaN for a
single value). The Stat view, merged and reduced by ``STD``, gives the *population* std (``n``) of the
values of all ranks -- the pooled std rlmetrics reports for every ``.../std`` name.

**Medians and percentiles.** The dict view is exact (``torch.median``: the lower middle value,
``torch.quantile``: linear). The Stat view carries a quantile sketch: exact while the merged values are
at most 4096 unit-weight values, within 0.5 % relative error beyond.

**Policy entropy.** ``-sum(p * log(p + 1e-8))`` with ``p = softmax(logits)``, the seed's definition, not
``logsumexp``-based ``-sum(p * log p)``: the ``1e-8`` adds up to ``V * 1e-8`` nats (1.5e-3 at a
150k vocabulary with near-uniform ``p``), far from a tight match. It is computed in row chunks of at
most ``chunk_elements`` logits (by default 256 Ki on the CPU, 16 Mi on an accelerator), so the
temporaries stay near ``3 * chunk_elements`` floats whatever the batch. Per row the arithmetic is the
seed's, bit for bit, in float32 for float16/bfloat16 logits (the seed would stay in the low
precision) and in the logits' dtype otherwise. The mean weights positions by ``response_mask``; on
the CPU, where a data-dependent shape costs no synchronization, positions with mask 0 are not
computed at all (a NaN there does not reach the result, as it would through the seed's
``entropy * mask``).

**Token transitions.** Transitions are bigrams of consecutive *unmasked* response tokens of one
sequence (masked positions are skipped, as the seed's ``responses[i][mask[i].bool()]``).
``analysis/unique_transitions/total`` is the number of distinct transitions on a rank; merged, it is
the **sum of the per-rank counts** -- an upper bound on the distinct transitions of all ranks together
(exact when no transition occurs on two ranks; exact merging would need the key sets themselves).
``analysis/total_transitions/total`` merges exactly. ``analysis/transition_diversity/mean`` is the
rank's ``unique / max(total, 1)`` with weight ``max(total, 1)``, so the merged value is
``sum(unique) / sum(max(total, 1))`` -- consistent with the two totals.

**Reward distribution** (``analyze_reward_distribution``; the seed names the function but not its
metrics). A sequence's reward is the sum of its ``token_level_rewards`` over the sequence (as
``critic/rewards``: rewards outside the response are zero).

* ``analysis/reward_distribution/mean|std|median|min|max|p25|p75`` -- of the sequence rewards;
* ``analysis/reward_positive_ratio/mean``, ``analysis/reward_negative_ratio/mean``,
  ``analysis/reward_zero_ratio/mean`` -- share of sequences with reward > 0, < 0, == 0;
* ``analysis/reward_nonzero_token_ratio/mean`` -- share of response tokens (``response_mask`` when
  present, else all) with a non-zero token reward: ~1/length for outcome rewards, ~1 for dense ones.

Other deviations from the seed's code: ``model/prompt_attention_ratio/mean`` splits the *last*
(key) dimension of the attention weights at ``keys - response_length`` (the seed's ``[:, :, :-R]``
is that for 3-D weights, but slices queries for ``(batch, heads, query, key)`` weights, and gives 0
for ``R == 0``) and adds float32 row sums in float64 (the seed sums all in float32); hidden-state norms of float16/bfloat16 states are taken in float32; an empty batch
gives NaN where the seed would raise. Token ids must fit in 32 bits (bigram keys pack two ids in one
int64); larger ids raise ``ValueError``.

>>> import torch
>>> data = {"responses": torch.tensor([[5, 6, 5, 6, 0], [7, 7, 7, 0, 0]]),
...         "response_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])}
>>> analyze_token_transitions(data)
{'analysis/transition_diversity/mean': 0.6, 'analysis/unique_transitions/total': 3.0, 'analysis/total_transitions/total': 5.0}
>>> compute_token_transition_stats(data)["analysis/unique_transitions/total"].sum
3.0

The code: :mod:`~rlmetrics.metrics.analysis.evaluate` (planners, one host copy, the two views),
:mod:`~rlmetrics.metrics.analysis.tokens` (distinct tokens and bigrams),
:mod:`~rlmetrics.metrics.analysis.entropy`, and one module per example of the seed:
:mod:`~rlmetrics.metrics.analysis.custom` (Method 1), :mod:`~rlmetrics.metrics.analysis.advanced`
(Method 4), :mod:`~rlmetrics.metrics.analysis.model` (Example 1),
:mod:`~rlmetrics.metrics.analysis.conversation` (Example 2); the whole pack here.
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlmetrics.core.stat import Stat
from rlmetrics.extras import require
from rlmetrics.metrics.analysis.advanced import (
    ADVANCED,
    analyze_reward_distribution,
    analyze_token_transitions,
    compute_advanced_metrics,
    compute_advanced_stats,
    compute_reward_distribution_stats,
    compute_sequence_coherence,
    compute_token_transition_stats,
)
from rlmetrics.metrics.analysis.conversation import (
    TARGET_LENGTH,
    compute_conversation_quality_metrics,
    compute_conversation_quality_stats,
    compute_length_appropriateness,
    compute_repetition_score,
    conversation_quality_scores,
    plan_conversation,
)
from rlmetrics.metrics.analysis.custom import (
    compute_custom_data_metrics,
    compute_custom_data_stats,
    compute_custom_training_metrics,
    compute_custom_training_stats,
    compute_response_quality_score,
    plan_custom_data,
    plan_custom_training,
)
from rlmetrics.metrics.analysis.entropy import (
    ATTENTION_ENTROPY_EPS,
    CPU_CHUNK_ELEMENTS,
    DEVICE_CHUNK_ELEMENTS,
    POLICY_ENTROPY_EPS,
    attention_entropy,
    policy_entropy,
)
from rlmetrics.metrics.analysis.evaluate import Planner, floats_of, stats_of
from rlmetrics.metrics.analysis.model import (
    compute_model_performance_metrics,
    compute_model_performance_stats,
    plan_model,
)

torch = require("torch", "torch")  # (the doctests use it)

__all__ = [
    "ATTENTION_ENTROPY_EPS", "CPU_CHUNK_ELEMENTS", "DEVICE_CHUNK_ELEMENTS", "POLICY_ENTROPY_EPS",
    "TARGET_LENGTH",
    "analyze_reward_distribution", "analyze_token_transitions", "attention_entropy",
    "compute_advanced_metrics", "compute_advanced_stats", "compute_conversation_quality_metrics",
    "compute_conversation_quality_stats", "compute_custom_data_metrics", "compute_custom_data_stats",
    "compute_custom_training_metrics", "compute_custom_training_stats", "compute_example_metrics",
    "compute_example_stats", "compute_length_appropriateness", "compute_model_performance_metrics",
    "compute_model_performance_stats", "compute_repetition_score", "compute_response_quality_score",
    "compute_reward_distribution_stats", "compute_sequence_coherence", "compute_token_transition_stats",
    "conversation_quality_scores", "policy_entropy",
]  # fmt: skip


# ---------------------------------------------------------------------------------- the whole pack
def _pack_planners(model_outputs: Mapping[str, Any] | None, target_length: int) -> list[Planner]:
    return [
        plan_custom_data,
        plan_custom_training,
        *ADVANCED,
        lambda d, c: plan_model(d, model_outputs, c),
        lambda d, c: plan_conversation(d, c, target_length),
    ]


def compute_example_stats(
    data: Any,
    model_outputs: Mapping[str, Any] | None = None,
    *,
    chunk_elements: int | None = None,
    target_length: int = TARGET_LENGTH,
    nan_strategy: str = "propagate",
) -> dict[str, Stat]:
    """Stats of every example metric the inputs allow, with one device-to-host copy; submit these.

    >>> sorted(compute_example_stats({"responses": torch.tensor([[1, 2]]), "prompts": torch.ones(1, 1)}))[:2]
    ['analysis/total_transitions/total', 'analysis/transition_diversity/mean']
    """
    return stats_of(
        data, _pack_planners(model_outputs, target_length), chunk_elements, nan_strategy=nan_strategy
    )


def compute_example_metrics(
    data: Any,
    model_outputs: Mapping[str, Any] | None = None,
    *,
    chunk_elements: int | None = None,
    target_length: int = TARGET_LENGTH,
    nan_strategy: str = "propagate",
) -> dict[str, float]:
    """Every example metric of the seed the inputs allow, as this rank's numbers (one host copy).

    The union of :func:`compute_custom_data_metrics`, :func:`compute_custom_training_metrics`,
    :func:`compute_advanced_metrics`, :func:`compute_model_performance_metrics` (when
    ``model_outputs`` is given) and :func:`compute_conversation_quality_metrics`.

    >>> m = compute_example_metrics({"responses": torch.tensor([[1, 2]]), "prompts": torch.ones(1, 1)})
    >>> m["analysis/total_transitions/total"], m["conversation/quality/min"]
    (1.0, 0.712)
    """
    return floats_of(
        data, _pack_planners(model_outputs, target_length), chunk_elements, nan_strategy=nan_strategy
    )
