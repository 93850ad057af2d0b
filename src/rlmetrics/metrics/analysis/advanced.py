"""The seed's "Method 4" examples (``compute_advanced_metrics``): sequence coherence, token transitions,
reward distribution (names and merge semantics in :mod:`rlmetrics.metrics.analysis`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlmetrics.core.stat import Stat
from rlmetrics.extras import require
from rlmetrics.metrics.analysis.evaluate import Call, Out, as_tensor, floats_of, get, obs, ratio, stats_of
from rlmetrics.metrics.analysis.tokens import rows_of
from rlmetrics.metrics.batch import as_batch

torch = require("torch", "torch")

COHERENCE = ("analysis/coherence/mean", "analysis/coherence/std", "analysis/coherence/median")
TRANSITION_DIVERSITY = ("analysis/transition_diversity/mean",)
UNIQUE_TRANSITIONS = ("analysis/unique_transitions/total",)
TOTAL_TRANSITIONS = ("analysis/total_transitions/total",)
REWARD_DISTRIBUTION = tuple(
    f"analysis/reward_distribution/{s}" for s in ("mean", "std", "median", "min", "max", "p25", "p75")
)
REWARD_POSITIVE = ("analysis/reward_positive_ratio/mean",)
REWARD_NEGATIVE = ("analysis/reward_negative_ratio/mean",)
REWARD_ZERO = ("analysis/reward_zero_ratio/mean",)
REWARD_NONZERO_TOKENS = ("analysis/reward_nonzero_token_ratio/mean",)


# --------------------------------------------------------------------------- Method 4: advanced
def compute_sequence_coherence(data: Any) -> torch.Tensor:
    """Per sequence ``1 / (1 + var)`` of its first ``attention_mask.sum()`` response tokens (float64).

    ``var`` is the unbiased variance of the token ids; a sequence of 0 or 1 tokens scores 1. (The
    seed takes the length from ``attention_mask``, prompt included, and clips it to the response.)

    >>> compute_sequence_coherence({"responses": torch.tensor([[1, 3, 8], [5, 5, 5]]),
    ...                             "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
    tensor([0.3333, 1.0000], dtype=torch.float64)
    """
    data = as_batch(data, "compute_sequence_coherence")
    responses = as_tensor(data["responses"])
    r = responses.shape[-1]
    lengths = as_tensor(data["attention_mask"]).sum(-1).long().clamp(max=r)
    keep = torch.arange(r, device=responses.device) < lengths[:, None]
    x = responses.to(torch.float64)
    n = lengths.to(torch.float64)
    mean = torch.where(keep, x, 0.0).sum(1) / n.clamp(min=1.0)
    dev = torch.where(keep, x - mean[:, None], 0.0)
    var = (dev * dev).sum(1) / (n - 1.0).clamp(min=1.0)
    return torch.where(lengths > 1, 1.0 / (1.0 + var), 1.0)


def plan_coherence(data: Any, call: Call) -> None:
    if "responses" in data and "attention_mask" in data:
        call.add((compute_sequence_coherence(data),), lambda v: [obs(COHERENCE, v)])


def check_ids(overflow: np.ndarray) -> None:
    if overflow[0]:
        raise ValueError("token ids must fit in 32 bits (-2**31 .. 2**31 - 1) for bigram metrics")


def plan_transitions(data: Any, call: Call) -> None:
    responses = get(data, "responses")
    if responses is None:
        return
    rows = rows_of(call, responses, get(data, "response_mask"))
    total = (rows.lengths - 1).clamp(min=0).sum()

    def read(unique: np.ndarray, total: np.ndarray, overflow: np.ndarray) -> list[Out]:
        check_ids(overflow)
        diversity = ratio(TRANSITION_DIVERSITY, float(unique[0]), max(float(total[0]), 1.0))
        return [diversity, obs(UNIQUE_TRANSITIONS, unique), obs(TOTAL_TRANSITIONS, total)]

    call.add((rows.distinct_pairs_overall, total, rows.id_overflow), read)


def plan_rewards(data: Any, call: Call) -> None:
    rewards = get(data, "token_level_rewards")
    if rewards is None:
        return
    rewards = as_tensor(rewards)
    per_seq = rewards.reshape(rewards.shape[0], math.prod(rewards.shape[1:])).to(torch.float64).sum(-1)
    mask = get(data, "response_mask")
    keep = torch.ones_like(rewards, dtype=torch.bool) if mask is None else (as_tensor(mask) != 0)
    nonzero, tokens = ((rewards != 0) & keep).sum(), keep.broadcast_to(rewards.shape).sum()

    def read(r: np.ndarray, nonzero: np.ndarray, tokens: np.ndarray) -> list[Out]:
        return [
            obs(REWARD_DISTRIBUTION, r),
            obs(REWARD_POSITIVE, (r > 0).astype(np.float64)),
            obs(REWARD_NEGATIVE, (r < 0).astype(np.float64)),
            obs(REWARD_ZERO, (r == 0).astype(np.float64)),
            ratio(REWARD_NONZERO_TOKENS, float(nonzero[0]), float(tokens[0])),
        ]

    call.add((per_seq, nonzero, tokens), read)


ADVANCED = (plan_coherence, plan_transitions, plan_rewards)


def compute_token_transition_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`analyze_token_transitions` (see the module docs for their merge).

    >>> compute_token_transition_stats({"responses": torch.tensor([[1, 2, 1, 2]])})["analysis/total_transitions/total"].sum
    3.0
    """  # noqa: E501
    return stats_of(data, [plan_transitions], nan_strategy=nan_strategy)


def analyze_token_transitions(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """The seed's transition analysis: distinct and total bigrams of unmasked response tokens.

    ``analysis/transition_diversity/mean`` = distinct / max(total, 1) over the whole batch.

    >>> analyze_token_transitions({"responses": torch.tensor([[1, 2, 1, 2]])})["analysis/transition_diversity/mean"]
    0.6666666666666666
    """  # noqa: E501
    return floats_of(data, [plan_transitions], nan_strategy=nan_strategy)


def compute_reward_distribution_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`analyze_reward_distribution` (sketches for the quantile names).

    >>> rewards = torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    >>> s = compute_reward_distribution_stats({"token_level_rewards": rewards})
    >>> s["analysis/reward_distribution/median"].sketch.median()
    -1.0
    """
    return stats_of(data, [plan_rewards], nan_strategy=nan_strategy)


def analyze_reward_distribution(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """Distribution of sequence rewards (sum of ``token_level_rewards``); names in the module docs.

    >>> m = analyze_reward_distribution({"token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
    ...                                  "response_mask": torch.tensor([[1, 1], [1, 0]])})
    >>> m["analysis/reward_distribution/mean"], m["analysis/reward_positive_ratio/mean"]
    (0.5, 0.5)
    >>> round(m["analysis/reward_nonzero_token_ratio/mean"], 4)  # 1 of 3 response tokens
    0.3333
    """
    return floats_of(data, [plan_rewards], nan_strategy=nan_strategy)


def compute_advanced_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`compute_advanced_metrics`.

    >>> s = compute_advanced_stats({"responses": torch.tensor([[1, 3]]), "attention_mask": torch.ones(1, 2)})
    >>> s["analysis/coherence/median"] is s["analysis/coherence/mean"]
    True
    """
    return stats_of(data, ADVANCED, nan_strategy=nan_strategy)


def compute_advanced_metrics(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """The seed's ``compute_advanced_metrics``: coherence, token transitions, reward distribution.

    ``analysis/coherence/mean|std|median`` of :func:`compute_sequence_coherence` (std unbiased, median
    the lower middle value), plus :func:`analyze_token_transitions` and
    :func:`analyze_reward_distribution`.

    >>> m = compute_advanced_metrics({"responses": torch.tensor([[1, 3], [2, 2]]), "attention_mask": torch.ones(2, 2)})
    >>> m["analysis/coherence/mean"], m["analysis/coherence/median"], m["analysis/unique_transitions/total"]
    (0.6666666666666666, 0.3333333333333333, 2.0)
    """  # noqa: E501
    return floats_of(data, ADVANCED, nan_strategy=nan_strategy)


__all__ = [
    "ADVANCED", "analyze_reward_distribution", "analyze_token_transitions", "check_ids",
    "compute_advanced_metrics", "compute_advanced_stats", "compute_reward_distribution_stats",
    "compute_sequence_coherence", "compute_token_transition_stats", "plan_coherence", "plan_rewards",
    "plan_transitions",
]  # fmt: skip
