"""verl 0.9.1's data metrics as mergeable Stats, behind :mod:`rlmetrics.integrations.verl`.

verl's semantics (docs/verl.md does not list them): ``critic/score|rewards/*`` of non-empty responses,
lengths from ``attention_mask`` (:func:`verl_lengths`), ``response_length_non_aborted/*``,
``prompt_length/clip_ratio`` against ``prompts.shape[-1]``, ``critic/values/*`` and the explained
variance only with ``use_critic``; no correct/wrong lengths, no process memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rlmetrics.core.groups import GroupBy
from rlmetrics.core.host import to_host
from rlmetrics.core.stat import Stat
from rlmetrics.extras import require
from rlmetrics.metrics import VP_SEQUENCES, variance_proxy_noise
from rlmetrics.metrics.data.grouped import Breakdowns
from rlmetrics.metrics.data.sequences import (
    SEQUENCE_METRICS,
    Part,
    add_counts,
    add_sums,
    fetch,
)
from rlmetrics.metrics.data.tokens import TokenSummaries, triple
from rlmetrics.metrics.tensors import Batch, BatchTensors, last_dim

torch = require("torch", "torch")


def compute_verl_data_stats(
    batch: Batch, *, use_critic: bool = True, torch_compile: bool = False, group_by: GroupBy = None
) -> dict[str, Stat]:
    """verl's ``compute_data_metrics`` as one mergeable :class:`Stat` per name (with the explained
    variance's ingredients); ``group_by`` as :func:`~rlmetrics.metrics.data.compute_data_stats`.

    >>> import torch
    >>> attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])  # the second response is empty
    >>> scores = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    >>> batch = {"prompts": torch.zeros(2, 2), "responses": torch.zeros(2, 3),
    ...          "attention_mask": attention_mask, "token_level_scores": scores}
    >>> stats = compute_verl_data_stats(batch)
    >>> stats["critic/score/mean"].count, stats["response_length/mean"].mean  # score: 1 non-empty response
    (1.0, 1.0)
    >>> stats["response/aborted_ratio"].mean
    0.5
    """
    names, arrays = verl_data_arrays(
        batch, use_critic=use_critic, torch_compile=torch_compile, group_by=group_by
    )
    return {name: Stat(*column) for name, column in zip(names, arrays.T.tolist())}


def verl_data_arrays(
    batch: Batch, *, use_critic: bool = True, torch_compile: bool = False, group_by: GroupBy = None
) -> tuple[list[str], np.ndarray]:
    """:func:`compute_verl_data_stats` as names and their ``(5, K)`` stat array."""
    t = BatchTensors(batch)
    breakdowns = Breakdowns(group_by, t.batch, batch)
    seq: dict[str, Any] = {}
    add_sums(t, seq)
    lengths = _verl_lengths(t)
    if lengths is not None:
        seq["prompt_length"], seq["response_length"] = lengths
    tokens = None
    if t.response_mask is not None:
        keys = ("advantages", "returns", "values") if use_critic else ("advantages", "returns")
        tokens = TokenSummaries.of(t, t.response_mask, torch_compile, keys, rows=bool(breakdowns))
    add_counts(t, seq)
    host, block, moved = fetch(seq, tokens, breakdowns.tensors)
    return breakdowns.assemble(moved, _verl_parts(host, t), tokens, block, "propagate")[:2]


def verl_lengths(batch: Batch) -> tuple[Any, Any] | None:
    """verl's prompt and response lengths: the batch's, else ``attention_mask`` summed before and over the
    last ``responses.shape[-1]`` columns (tool output counts); None without either.

    >>> import torch
    >>> batch = {"responses": torch.zeros(1, 3), "attention_mask": torch.tensor([[0, 1, 1, 1, 0]])}
    >>> [x.tolist() for x in verl_lengths(batch)]
    [[1], [2]]
    """
    return _verl_lengths(BatchTensors(batch))


def compute_variance_proxy_stats(batch: Batch, gradient_norm: float | None = None) -> dict[str, Stat]:
    """verl's ``compute_variance_proxy_metrics`` as Stats: per sequence ``A**2 * W`` (off-policy with
    ``rollout_is_weights``), ``A**2``, ``W`` (``A``: masked mean advantage, ``+ 1e-8`` below; ``W``: summed
    ``1 - 2 exp(old_log_probs) + sum_pi_squared``); proxy1 ``gradient_norm**2``, proxy3 derived. Empty
    without ``sum_pi_squared``, ``old_log_probs``, ``advantages`` or a response mask.

    >>> import torch
    >>> batch = {"old_log_probs": torch.zeros(2, 2), "sum_pi_squared": torch.ones(2, 2),
    ...          "advantages": torch.tensor([[1.0, 1.0], [2.0, 0.0]]), "response_mask": torch.ones(2, 2)}
    >>> stats = compute_variance_proxy_stats(batch, gradient_norm=1.0)
    >>> round(stats["variance_proxy/expected_a_squared"].mean, 6), stats["variance_proxy/expected_w"].mean
    (1.0, 0.0)
    """
    t = BatchTensors(batch)
    old, pi2, adv, mask = (
        t.get(k) for k in ("old_log_probs", "sum_pi_squared", "advantages", "response_mask")
    )
    if old is None or pi2 is None or adv is None or mask is None:
        return {}
    f64 = torch.float64
    mask = mask.to(f64)
    on = mask != 0

    def masked_sum(x: Any) -> Any:
        return (torch.where(on, x.to(f64), 0.0) * mask).sum(-1)

    denominator = mask.sum(-1) + 1e-8
    w = 1 - 2 * torch.exp(old.to(f64)) + pi2.to(f64)
    rho = t.get("rollout_is_weights")
    if rho is not None:
        rho = rho.to(f64)
        w = w * rho**2
    a = masked_sum(adv) / denominator
    w_sum = masked_sum(w)
    if rho is None:
        power = a**2 * w_sum.clamp(min=0.0)
    else:
        w_original = masked_sum(w / (rho**2).clamp(min=1e-10)).clamp(min=0.0)
        power = (masked_sum(rho) / denominator) ** 2 * a**2 * w_original
    power, a2, w_sum = to_host([power, a**2, w_sum])
    n = float(len(power))
    stats = {
        "variance_proxy/proxy1_signal_strength": Stat.of(0.0 if gradient_norm is None else gradient_norm**2),
        "variance_proxy/proxy2_total_power": Stat.of(power),
        "variance_proxy/proxy3_pure_noise": Stat.of(0.0),
        "variance_proxy/expected_a_squared": Stat.of(a2),
        "variance_proxy/expected_w": Stat.of(w_sum),
    }
    if gradient_norm is not None:  # the full batch's value is derived from the merged values
        stats[VP_SEQUENCES] = Stat(1.0, n, 0.0, n, n)
        noise = variance_proxy_noise(
            {VP_SEQUENCES: n, **{k: v.mean for k, v in stats.items() if k != VP_SEQUENCES}}
        )
        stats["variance_proxy/proxy3_pure_noise"] = Stat.of(0.0 if noise is None else noise)
    return stats


def _verl_lengths(t: BatchTensors) -> tuple[Any, Any] | None:
    prompt, response = t.get("prompt_length"), t.get("response_length")
    if prompt is not None and response is not None:
        return prompt.reshape(-1), response.reshape(-1)
    attention, width = t.get("attention_mask"), t.response_width
    if attention is None or attention.dim() != 2 or not width or width > attention.shape[-1]:
        return None
    split = attention.shape[-1] - width
    return attention[:, :split].sum(-1), attention[:, split:].sum(-1)


def _verl_parts(seq: Mapping[str, np.ndarray], t: BatchTensors) -> list[Part]:
    """verl's per-sequence metrics as parts (:data:`~rlmetrics.metrics.data.sequences.Part`)."""
    response = seq.get("response_length")
    kept = None if response is None else response != 0
    parts = []
    for key, prefix in SEQUENCE_METRICS[:2]:
        if key in seq:
            keep = kept if kept is not None and kept.shape == seq[key].shape else None
            parts.append((triple(prefix), seq[key], keep))
    if response is not None:
        clipped = (response == t.response_width) * 1.0
        parts += [
            (triple("response_length"), response, None),
            (("response_length/clip_ratio",), clipped, None),
            (triple("response_length_non_aborted"), response, kept),
            (("response_length_non_aborted/clip_ratio",), clipped, kept),
            (("response/aborted_ratio",), (response == 0) * 1.0, None),
        ]
    prompt = seq.get("prompt_length")
    if prompt is not None:
        prompts = t.get("prompts")
        width = last_dim(prompts) if prompts is not None else t.prompt_width
        parts += [
            (triple("prompt_length"), prompt, None),
            (("prompt_length/clip_ratio",), (prompt == width) * 1.0, None),
        ]
    parts += [(triple(prefix), seq[key], None) for key, prefix in SEQUENCE_METRICS[4:] if key in seq]
    return parts


__all__ = ["compute_variance_proxy_stats", "compute_verl_data_stats", "verl_data_arrays", "verl_lengths"]
