"""The seed's "Example 1" (``compute_model_performance_metrics``): attention entropy, prompt attention
ratio and hidden-state norms from a model's outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlmetrics.core.stat import Stat
from rlmetrics.extras import require
from rlmetrics.metrics.analysis.entropy import attention_entropy
from rlmetrics.metrics.analysis.evaluate import Call, Out, as_tensor, floats_of, ratio, stats_of, summary

torch = require("torch", "torch")

ATTENTION_ENTROPY = ("model/attention_entropy/mean",)
PROMPT_ATTENTION_RATIO = ("model/prompt_attention_ratio/mean",)
HIDDEN_NORM = ("model/hidden_norm/mean", "model/hidden_norm/std")


# ------------------------------------------------------------------------ Example 1: model outputs
def plan_model(data: Any, model_outputs: Mapping[str, Any] | None, call: Call) -> None:
    model_outputs = model_outputs or {}
    weights = model_outputs.get("attention_weights")
    if weights is not None:
        weights = as_tensor(weights)
        entropy = attention_entropy(weights, chunk_elements=call.chunk_elements)
        call.add((summary(entropy, drop=call.drop),), lambda s: [Out(ATTENTION_ENTROPY, Stat(*s.tolist()))])
        if "attention_mask" in data and "responses" in data:
            split = max(weights.shape[-1] - as_tensor(data["responses"]).shape[-1], 0)
            dtype = torch.promote_types(weights.dtype, torch.float32)
            # rows summed in float32, rows added in float64: converting all weights to float64 costs more
            prompt = weights[..., :split].sum(-1, dtype=dtype).to(torch.float64).sum()
            total = prompt + weights[..., split:].sum(-1, dtype=dtype).to(torch.float64).sum()
            call.add((prompt, total), lambda p, t: [ratio(PROMPT_ATTENTION_RATIO, float(p[0]), float(t[0]))])
    hidden = model_outputs.get("hidden_states")
    if hidden is not None:
        hidden = as_tensor(hidden)
        norms = torch.linalg.vector_norm(
            hidden, dim=-1, dtype=torch.promote_types(hidden.dtype, torch.float32)
        )
        call.add((summary(norms, drop=call.drop),), lambda s: [Out(HIDDEN_NORM, Stat(*s.tolist()))])


def compute_model_performance_stats(
    data: Any,
    model_outputs: Mapping[str, Any],
    *,
    chunk_elements: int | None = None,
    nan_strategy: str = "propagate",
) -> dict[str, Stat]:
    """Stats to submit for :func:`compute_model_performance_metrics` (prompt ratio weighted by mass).

    >>> s = compute_model_performance_stats({}, {"hidden_states": torch.tensor([[3.0, 4.0], [0.0, 1.0]])})
    >>> s["model/hidden_norm/mean"].mean, s["model/hidden_norm/std"].std  # population std when merged
    (3.0, 2.0)
    """
    return stats_of(
        data, [lambda d, c: plan_model(d, model_outputs, c)], chunk_elements, nan_strategy=nan_strategy
    )


def compute_model_performance_metrics(
    data: Any,
    model_outputs: Mapping[str, Any],
    *,
    chunk_elements: int | None = None,
    nan_strategy: str = "propagate",
) -> dict[str, float]:
    """The seed's model analysis: attention entropy, prompt attention ratio, hidden-state norms.

    From ``model_outputs``: ``attention_weights`` (``[..., keys]``) give
    ``model/attention_entropy/mean`` and, when ``data`` has ``attention_mask`` and ``responses``,
    ``model/prompt_attention_ratio/mean`` (attention mass on the first ``keys - response_length``
    keys over all mass); ``hidden_states`` (``[..., hidden]``) give ``model/hidden_norm/mean|std``
    (L2 norms; std unbiased).

    >>> w = torch.tensor([[[0.25, 0.25, 0.5]]])
    >>> m = compute_model_performance_metrics({"attention_mask": torch.ones(1, 3), "responses": torch.ones(1, 1)},
    ...                                       {"attention_weights": w})
    >>> m["model/prompt_attention_ratio/mean"], round(m["model/attention_entropy/mean"], 4)
    (0.5, 1.0397)
    """  # noqa: E501
    return floats_of(
        data, [lambda d, c: plan_model(d, model_outputs, c)], chunk_elements, nan_strategy=nan_strategy
    )


__all__ = ["compute_model_performance_metrics", "compute_model_performance_stats", "plan_model"]
