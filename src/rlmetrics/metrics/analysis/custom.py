"""The seed's "Method 1" examples: ``compute_custom_data_metrics`` (token accuracy, response vocabulary
diversity) and ``compute_custom_training_metrics`` (policy entropy, grad norm, loss).
"""

from __future__ import annotations

from typing import Any

from rlmetrics.core.stat import Stat
from rlmetrics.extras import require
from rlmetrics.metrics.analysis.entropy import POLICY_ENTROPY_EPS, chunked_entropy, policy_entropy
from rlmetrics.metrics.analysis.evaluate import Call, Out, as_tensor, floats_of, get, obs, stats_of, summary
from rlmetrics.metrics.analysis.tokens import Rows, rows_of
from rlmetrics.metrics.batch import as_batch

torch = require("torch", "torch")

TOKEN_ACCURACY = ("custom/token_accuracy/mean",)
RESPONSE_QUALITY = (
    "custom/response_quality/mean",
    "custom/response_quality/max",
    "custom/response_quality/min",
)
POLICY_ENTROPY = ("training/policy_entropy/mean",)
GRAD_NORM = ("training/grad_norm/mean",)
LOSS = ("training/loss/mean", "training/loss/std")


# ---------------------------------------------------------------------------- Method 1: custom data
def plan_custom_data(data: Any, call: Call) -> None:
    correct, attention_mask = get(data, "correct_tokens"), get(data, "attention_mask")
    if correct is not None and attention_mask is not None:
        s = summary(as_tensor(correct), as_tensor(attention_mask), call.drop)
        call.add((s,), lambda s: [Out(TOKEN_ACCURACY, Stat(*s.tolist()))])
    responses, response_mask = get(data, "responses"), get(data, "response_mask")
    if responses is not None and response_mask is not None:
        counts = rows_of(call, responses, response_mask).distinct_tokens
        call.add((counts,), lambda v: [obs(RESPONSE_QUALITY, v)])


def compute_response_quality_score(data: Any) -> torch.Tensor:
    """Distinct response tokens per sequence (vocabulary diversity), float32 on the input's device.

    >>> compute_response_quality_score({"responses": torch.tensor([[3, 3, 4, 9]]),
    ...                                 "response_mask": torch.tensor([[1, 1, 1, 0]])})
    tensor([2.])
    """
    data = as_batch(data, "compute_response_quality_score")
    return Rows(data["responses"], data["response_mask"]).distinct_tokens.float()


def compute_custom_data_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`compute_custom_data_metrics` (token accuracy is token-weighted).

    >>> s = compute_custom_data_stats({"correct_tokens": torch.tensor([[1, 0, 1]]),
    ...                               "attention_mask": torch.tensor([[1, 1, 0]])})
    >>> s["custom/token_accuracy/mean"].count, s["custom/token_accuracy/mean"].mean
    (2.0, 0.5)
    """
    return stats_of(data, [plan_custom_data], nan_strategy=nan_strategy)


def compute_custom_data_metrics(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """The seed's ``compute_custom_data_metrics``: token accuracy and response vocabulary diversity.

    ``custom/token_accuracy/mean`` needs ``correct_tokens`` and ``attention_mask``;
    ``custom/response_quality/mean|max|min`` (distinct tokens per response) ``responses`` and
    ``response_mask``. A missing key skips its metrics.

    >>> compute_custom_data_metrics({"responses": torch.tensor([[1, 2, 2], [4, 4, 4]]),
    ...                              "response_mask": torch.ones(2, 3)})
    {'custom/response_quality/mean': 1.5, 'custom/response_quality/max': 2.0, 'custom/response_quality/min': 1.0}
    """  # noqa: E501
    return floats_of(data, [plan_custom_data], nan_strategy=nan_strategy)


# ------------------------------------------------------------------------ Method 1: custom training
def plan_custom_training(data: Any, call: Call) -> None:
    logits = get(data, "policy_logits")
    if logits is not None:
        logits, mask = as_tensor(logits), get(data, "response_mask")
        if mask is None:
            s = summary(policy_entropy(logits, chunk_elements=call.chunk_elements), drop=call.drop)
        else:
            w = as_tensor(mask).broadcast_to(logits.shape[:-1]).reshape(-1)
            if logits.device.type == "cpu":  # skip masked rows: a data-dependent shape syncs nothing here
                index = (w != 0).nonzero().squeeze(1)
                s = summary(
                    chunked_entropy(logits, POLICY_ENTROPY_EPS, True, call.chunk_elements, index),
                    w[index],
                    call.drop,
                )
            else:
                s = summary(
                    policy_entropy(logits, chunk_elements=call.chunk_elements).reshape(-1), w, call.drop
                )
        call.add((s,), lambda s: [Out(POLICY_ENTROPY, Stat(*s.tolist()))])
    grad_norm = get(data, "grad_norm")
    if grad_norm is not None:
        call.add((as_tensor(grad_norm),), lambda v: [obs(GRAD_NORM, v)])
    loss = get(data, "loss_values")
    if loss is not None:
        call.add((as_tensor(loss),), lambda v: [obs(LOSS, v)])


def compute_custom_training_stats(
    data: Any, *, chunk_elements: int | None = None, nan_strategy: str = "propagate"
) -> dict[str, Stat]:
    """Stats to submit for :func:`compute_custom_training_metrics` (entropy weighted by response tokens).

    >>> compute_custom_training_stats({"loss_values": torch.tensor([1.0, 3.0])})["training/loss/std"].std
    1.0
    """
    return stats_of(data, [plan_custom_training], chunk_elements, nan_strategy=nan_strategy)


def compute_custom_training_metrics(
    data: Any, *, chunk_elements: int | None = None, nan_strategy: str = "propagate"
) -> dict[str, float]:
    """The seed's ``compute_custom_training_metrics``: policy entropy, grad norm, loss mean/std.

    ``training/policy_entropy/mean`` is the ``response_mask``-weighted mean of
    :func:`policy_entropy` of ``policy_logits`` (all positions without a mask);
    ``training/grad_norm/mean`` the mean of ``grad_norm``; ``training/loss/mean|std`` the mean and the
    unbiased std (torch's ``.std()``) of ``loss_values``.

    >>> compute_custom_training_metrics({"loss_values": torch.tensor([1.0, 3.0]), "grad_norm": 0.5})
    {'training/grad_norm/mean': 0.5, 'training/loss/mean': 2.0, 'training/loss/std': 1.4142135623730951}
    """
    return floats_of(data, [plan_custom_training], chunk_elements, nan_strategy=nan_strategy)


__all__ = [
    "compute_custom_data_metrics", "compute_custom_data_stats", "compute_custom_training_metrics",
    "compute_custom_training_stats", "compute_response_quality_score", "plan_custom_data",
    "plan_custom_training",
]  # fmt: skip
