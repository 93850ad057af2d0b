"""Entropy over the last dim in row chunks of bounded size: policy entropy from logits, attention entropy
from attention weights (the seed's definitions, ``-sum(p * log(p + eps))``; see
:mod:`seed_metrics` for why not ``logsumexp``).
"""

from __future__ import annotations

import torch

from .evaluate import as_tensor

POLICY_ENTROPY_EPS = 1e-8
ATTENTION_ENTROPY_EPS = 1e-9
CPU_CHUNK_ELEMENTS = 1 << 18
"""Entropy chunk on the CPU (``chunk_elements=None``): temporaries of 1 MiB (float32) stay in cache,
faster than one pass over the whole tensor; a chunk holds at least one row (600 KiB at 150k vocab)."""
DEVICE_CHUNK_ELEMENTS = 1 << 24
"""Entropy chunk on an accelerator (``chunk_elements=None``): few kernel launches, 64 MiB temporaries."""


def chunked_entropy(
    x: torch.Tensor,
    eps: float,
    from_logits: bool,
    chunk_elements: int | None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Entropy of each row (last dim) of ``x``, or of the rows ``index`` of the flattened leading dims."""
    x = as_tensor(x).detach()
    if chunk_elements is None:
        chunk_elements = CPU_CHUNK_ELEMENTS if x.device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    v = x.shape[-1]
    rows = x.reshape(-1, v)  # a view for contiguous input
    n = rows.shape[0] if index is None else index.shape[0]
    out = torch.empty(n, dtype=dtype, device=x.device)
    step = max(1, chunk_elements // max(v, 1))
    for start in range(0, n, step):  # over chunks of rows, to bound the temporaries
        if index is None:
            chunk = rows[start : start + step].to(dtype)
        else:
            chunk = rows.index_select(0, index[start : start + step]).to(dtype)
        p = torch.softmax(chunk, dim=-1) if from_logits else chunk
        t = p + eps
        t.log_()
        t.mul_(p)
        torch.sum(t, dim=-1, out=out[start : start + step])
    out.neg_()
    return out if index is not None else out.reshape(x.shape[:-1])


def policy_entropy(
    logits: torch.Tensor, *, eps: float = POLICY_ENTROPY_EPS, chunk_elements: int | None = None
) -> torch.Tensor:
    """Entropy ``-sum(p * log(p + eps))`` of ``p = softmax(logits)`` over the last dim, in row chunks.

    Rows of the flattened leading dims are processed ``chunk_elements // vocab`` at a time (at least
    one), so the temporaries never exceed about ``3 * max(chunk_elements, vocab)`` floats (4 with a
    dtype conversion). ``chunk_elements=None``: :data:`CPU_CHUNK_ELEMENTS` on the CPU,
    :data:`DEVICE_CHUNK_ELEMENTS` elsewhere.

    >>> policy_entropy(torch.zeros(2, 3, 4), chunk_elements=4).shape
    torch.Size([2, 3])
    >>> round(policy_entropy(torch.zeros(4)).item(), 6)  # uniform over 4: log 4
    1.386294
    """
    return chunked_entropy(logits, eps, True, chunk_elements)


def attention_entropy(
    weights: torch.Tensor, *, eps: float = ATTENTION_ENTROPY_EPS, chunk_elements: int | None = None
) -> torch.Tensor:
    """Entropy ``-sum(w * log(w + eps))`` of attention weights over the last (key) dim, in row chunks.

    >>> round(attention_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]]))[0].item(), 6)
    0.693147
    """
    return chunked_entropy(weights, eps, False, chunk_elements)


__all__ = [
    "ATTENTION_ENTROPY_EPS", "CPU_CHUNK_ELEMENTS", "DEVICE_CHUNK_ELEMENTS", "POLICY_ENTROPY_EPS",
    "attention_entropy", "chunked_entropy", "policy_entropy",
]  # fmt: skip
