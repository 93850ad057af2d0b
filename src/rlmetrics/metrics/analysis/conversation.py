"""The seed's "Example 2" (``compute_conversation_quality_metrics``): a per-response quality score from
its length, vocabulary and repetition.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlmetrics.core.stat import Stat
from rlmetrics.extras import require
from rlmetrics.metrics.analysis.advanced import check_ids
from rlmetrics.metrics.analysis.evaluate import Call, Out, as_tensor, floats_of, get, obs, stats_of
from rlmetrics.metrics.analysis.tokens import Rows, rows_of
from rlmetrics.metrics.batch import as_batch

torch = require("torch", "torch")

TARGET_LENGTH = 50
"""The seed's ``compute_length_appropriateness`` target length."""
CONVERSATION_QUALITY = tuple(f"conversation/quality/{s}" for s in ("mean", "std", "min", "max"))


# ----------------------------------------------------------------- Example 2: conversation quality
def compute_length_appropriateness(length: Any, target_length: int = TARGET_LENGTH) -> Any:
    """``length / target`` up to the target, ``target / length`` beyond, 0 for an empty response.

    Takes an int (returns a float) or a tensor of lengths (returns float64).

    >>> compute_length_appropriateness(25), compute_length_appropriateness(100), compute_length_appropriateness(0)
    (0.5, 0.5, 0.0)
    """  # noqa: E501
    if not isinstance(length, torch.Tensor):
        return float(compute_length_appropriateness(torch.tensor(float(length)), target_length))
    n = length.to(torch.float64)
    ratio = n / target_length
    return torch.where(n == 0, 0.0, torch.where(ratio <= 1.0, ratio, 1.0 / ratio))


def _repetition(rows: Rows) -> torch.Tensor:
    n = rows.lengths.to(torch.float64)
    repeated = n - 1.0 - rows.distinct_pairs.to(torch.float64)
    return torch.where(n <= 1, 1.0, 1.0 - repeated / (n - 1.0).clamp(min=1.0))


def compute_repetition_score(tokens: torch.Tensor) -> float:
    """``1 - repeated bigrams / bigrams`` of one token sequence (1 for fewer than two tokens).

    >>> compute_repetition_score(torch.tensor([1, 2, 1, 2, 1]))  # bigrams 12 21 12 21: two repeats
    0.5
    """
    rows = Rows(as_tensor(tokens).reshape(1, -1), None)
    return float(_repetition(rows)[0])


def _quality(rows: Rows, target_length: int) -> torch.Tensor:
    n = rows.lengths.to(torch.float64)
    length = compute_length_appropriateness(rows.lengths, target_length)
    vocab = torch.where(
        n > 0, (rows.distinct_tokens.to(torch.float64) / n.clamp(min=1.0)).clamp(max=1.0), 0.0
    )
    return 0.3 * length + 0.3 * vocab + 0.4 * _repetition(rows)


def conversation_quality_scores(data: Any, *, target_length: int = TARGET_LENGTH) -> torch.Tensor:
    """Per response ``0.3 * length + 0.3 * vocabulary + 0.4 * repetition`` score (float64).

    >>> conversation_quality_scores({"responses": torch.tensor([[7, 7, 7]])}, target_length=3)
    tensor([0.6000], dtype=torch.float64)
    """
    data = as_batch(data, "conversation_quality_scores")
    return _quality(Rows(data["responses"], get(data, "response_mask")), target_length)


def plan_conversation(data: Any, call: Call, target_length: int = TARGET_LENGTH) -> None:
    if "responses" not in data or "prompts" not in data:
        return
    rows = rows_of(call, data["responses"], get(data, "response_mask"))

    def read(q: np.ndarray, overflow: np.ndarray) -> list[Out]:
        check_ids(overflow)
        return [obs(CONVERSATION_QUALITY, q)]

    call.add((_quality(rows, target_length), rows.id_overflow), read)


def compute_conversation_quality_stats(
    data: Any, *, target_length: int = TARGET_LENGTH, nan_strategy: str = "propagate"
) -> dict[str, Stat]:
    """Stats to submit for :func:`compute_conversation_quality_metrics`.

    >>> data = {"responses": torch.tensor([[1, 2]]), "prompts": torch.ones(1, 1)}
    >>> compute_conversation_quality_stats(data)["conversation/quality/min"].count
    1.0
    """
    return stats_of(data, [lambda d, c: plan_conversation(d, c, target_length)], nan_strategy=nan_strategy)


def compute_conversation_quality_metrics(
    data: Any, *, target_length: int = TARGET_LENGTH, nan_strategy: str = "propagate"
) -> dict[str, float]:
    """The seed's conversation quality: ``conversation/quality/mean|std|min|max`` of the per-response
    :func:`conversation_quality_scores` (std unbiased). Needs ``responses`` and ``prompts``.

    >>> m = compute_conversation_quality_metrics({"responses": torch.tensor([[5, 5, 5], [1, 2, 3]]),
    ...                                           "prompts": torch.ones(2, 2)}, target_length=3)
    >>> round(m["conversation/quality/min"], 6), m["conversation/quality/max"]
    (0.6, 1.0)
    """
    return floats_of(data, [lambda d, c: plan_conversation(d, c, target_length)], nan_strategy=nan_strategy)


__all__ = [
    "TARGET_LENGTH", "compute_conversation_quality_metrics", "compute_conversation_quality_stats",
    "compute_length_appropriateness", "compute_repetition_score", "conversation_quality_scores",
    "plan_conversation",
]  # fmt: skip
