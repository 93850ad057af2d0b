"""Timing and throughput metrics of a training step (the seed's names).

- :func:`compute_timing_metrics`: ``timing_s/{stage}`` for every entry of ``timing_raw`` and
  ``timing_per_token_ms/{stage}`` for ``gen`` (per response token) and ``ref``, ``values``, ``adv``,
  ``update_critic``, ``update_actor`` (per prompt + response token of the batch).
- :func:`compute_throughput_metrics` (also under the seed's spelling ``compute_throughout_metrics``):
  ``perf/total_num_tokens`` (the batch's ``global_token_num``), ``perf/time_per_step``
  (``timing_raw["step"]``) and ``perf/throughput`` (tokens per second per GPU).

Merged over ranks, ``perf/total_num_tokens`` is summed (its name says ``total``), the others are
averaged. Missing keys or unusable values skip the metrics that need them; nothing raises.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlmetrics.extras import require
from rlmetrics.metrics import TIMED_STAGES
from rlmetrics.metrics.data import _Tensors, lookup
from rlmetrics.stat import to_host

torch = require("torch", "torch")

logger = logging.getLogger(__name__)

RESPONSE_TOKEN_STAGES = TIMED_STAGES[:1]
"""Stages timed per response token."""
ALL_TOKEN_STAGES = TIMED_STAGES[1:]
"""Stages timed per token of the whole sequence (prompt + response)."""


def _seconds(value: Any) -> float | Any | None:
    """A timer value as a float, a one-element tensor (read with the call's other tensors), or None."""
    if isinstance(value, numbers.Real) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach()
    return None


def _read(values: dict[str, Any]) -> dict[str, float]:
    """``values`` with their tensors read, in one device-to-host copy (:func:`~rlmetrics.stat.to_host`)."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    host = to_host([values[k] for k in keys])
    return {**values, **{k: float(h.sum()) for k, h in zip(keys, host)}}


def _token_counts(batch: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """(prompt tokens, response tokens) of the batch as 0-dim tensors; None if unknown."""
    t = _Tensors(batch)
    if t.prompt_mask is None or t.response_mask is None:
        return None
    return t.prompt_mask.sum(), t.response_mask.sum()


def _stage_values(timing_raw: Mapping[str, Any]) -> dict[str, Any]:
    """The stages of ``timing_raw`` whose time is a number, as :func:`_seconds` gives them (tensors
    not read yet); the others are skipped (logged at debug level)."""
    seconds = {}
    for stage, value in timing_raw.items():
        s = _seconds(value)
        if s is None:
            logger.debug("timing_raw[%r] is not a number: %r", stage, value)
            continue
        seconds[stage] = s
    return seconds


def stage_seconds(timing_raw: Mapping[str, Any]) -> dict[str, float]:
    """The stages of ``timing_raw`` whose time is a number (a float, a numpy or one-element torch
    scalar), in seconds (tensors read in one copy); the others are skipped.

    >>> stage_seconds({"gen": 1, "note": "slow"})
    {'gen': 1.0}
    """
    return _read(_stage_values(timing_raw))


def compute_timing_metrics(batch: Mapping[str, Any], timing_raw: Mapping[str, Any]) -> dict[str, float]:
    """``timing_s/{stage}`` in seconds and ``timing_per_token_ms/{stage}`` in milliseconds per token.

    Token counts come from ``attention_mask`` and ``responses`` / ``response_mask`` as in
    :mod:`rlmetrics.metrics.data`; without them (or with zero tokens) only ``timing_s/*`` is returned.

    >>> import torch
    >>> batch = {"responses": torch.zeros(2, 2), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    >>> m = compute_timing_metrics(batch, {"gen": 0.5, "update_actor": 1.4, "step": 3.0})
    >>> m["timing_s/step"], m["timing_per_token_ms/gen"], m["timing_per_token_ms/update_actor"]
    (3.0, 166.66666666666666, 200.0)
    """
    seconds = _stage_values(timing_raw)
    timed = [s for s in (*RESPONSE_TOKEN_STAGES, *ALL_TOKEN_STAGES) if s in seconds]
    counts = _token_counts(batch) if timed else None
    tokens = {} if counts is None else {"prompt": counts[0], "response": counts[1]}
    read = _read({**{("s", k): v for k, v in seconds.items()}, **{("t", k): v for k, v in tokens.items()}})
    seconds = {k: read["s", k] for k in seconds}
    out = {f"timing_s/{stage}": s for stage, s in seconds.items()}
    if counts is not None:
        prompt, response = read["t", "prompt"], read["t", "response"]
        for stage in timed:
            tokens = response if stage in RESPONSE_TOKEN_STAGES else prompt + response
            if tokens > 0:
                out[f"timing_per_token_ms/{stage}"] = seconds[stage] * 1000.0 / tokens
    return out


def _total_tokens(batch: Mapping[str, Any]) -> float | Any | None:
    """Sum of ``global_token_num`` (tokens per sequence), else of ``attention_mask``: a float, a
    0-dim tensor (read with the call's other tensors) or None."""
    value = lookup(batch, "global_token_num")
    if value is not None:
        try:
            if isinstance(value, torch.Tensor):
                return value.detach().sum(dtype=torch.float64)
            return float(np.sum(np.asarray(value, dtype=np.float64)))
        except (TypeError, ValueError) as exc:
            logger.debug("global_token_num is not numeric (%s)", exc)
    mask = lookup(batch, "attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.detach().sum(dtype=torch.float64)
    return None


def compute_throughput_metrics(
    batch: Mapping[str, Any], timing_raw: Mapping[str, Any], n_gpus: int
) -> dict[str, float]:
    """``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (tokens/s/GPU).

    Tokens: the sum of ``global_token_num`` (siiRL's per-sequence token counts), or of
    ``attention_mask`` when the batch has no ``global_token_num``.

    >>> compute_throughput_metrics({"global_token_num": [100, 300]}, {"step": 2.0}, n_gpus=4)
    {'perf/total_num_tokens': 400.0, 'perf/time_per_step': 2.0, 'perf/throughput': 50.0}
    """
    out: dict[str, float] = {}
    step = _seconds(timing_raw.get("step")) if hasattr(timing_raw, "get") else None
    read = _read({"tokens": _total_tokens(batch), "step": step})
    tokens, step = read["tokens"], read["step"]
    if tokens is not None:
        out["perf/total_num_tokens"] = tokens
    if step is not None:
        out["perf/time_per_step"] = step
        gpus = n_gpus if isinstance(n_gpus, numbers.Real) else math.nan
        if tokens is not None and step > 0 and gpus > 0:
            out["perf/throughput"] = tokens / (step * gpus)
    return out


compute_throughout_metrics = compute_throughput_metrics
"""The seed's spelling of :func:`compute_throughput_metrics`."""


__all__ = [
    "ALL_TOKEN_STAGES", "RESPONSE_TOKEN_STAGES", "compute_throughout_metrics", "compute_throughput_metrics",
    "compute_timing_metrics", "stage_seconds",
]  # fmt: skip
