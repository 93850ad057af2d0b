"""The per-sequence data metrics (scores, rewards, lengths, ratios, turns, tool calls).

Computed on the device, moved in one copy (:func:`fetch`), summarized on the host (small ops cost less).
Rules: docs/metrics.md, "What the data metrics summarize".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlmetrics.core.host import HostPlan
from rlmetrics.core.stat import empty_arrays
from rlmetrics.core.summary import nonfinite, summarize
from rlmetrics.core.values import MetricValueError
from rlmetrics.metrics.assemble import VF_AUX, column_values, metrics_of_arrays, with_token_block
from rlmetrics.metrics.batch import key_error
from rlmetrics.metrics.data.tokens import TokenSummaries, triple
from rlmetrics.metrics.tensors import BatchTensors, floating

CORRECT_THRESHOLD = 0.5
"""A response is correct when its sequence reward (sum of ``token_level_rewards``) exceeds this."""

SEQUENCE_METRICS = (  # batch key (the response / prompt mask: its lengths) and metric prefix
    ("token_level_scores", "critic/score"),
    ("token_level_rewards", "critic/rewards"),
    ("response_mask", "response/length"),
    ("prompt_mask", "prompt/length"),
    ("__num_turns__", "num_turns"),
    ("tool_call_counts", "tool_call_counts"),
)

Part = tuple[tuple[str, ...], np.ndarray, Any]  # names, values, which to keep (None: all)


# ------------------------------------------------------------------------------ on the device
def sequence_tensors(t: BatchTensors) -> dict[str, Any]:
    """The per-sequence vectors of the seed's metrics, by batch key: sums, lengths, counts."""
    seq: dict[str, Any] = {}
    add_sums(t, seq)
    if t.response_mask is not None:
        seq["response_mask"] = t.response_mask.sum(-1)
    if t.prompt_mask is not None:
        seq["prompt_mask"] = t.prompt_mask.sum(-1)
    add_counts(t, seq)
    return seq


def add_sums(t: BatchTensors, seq: dict[str, Any]) -> None:
    """Sequence scores and rewards: sums over the whole row (siiRL's and verl's)."""
    for key, _ in SEQUENCE_METRICS[:2]:
        x = t.get(key)
        if x is not None:
            if x.dim() == 0:
                raise key_error(key, "must have one value (or row) per sequence, got a scalar")
            t.check_size(key, x)
            seq[key] = floating(x).sum(-1) if x.dim() >= 2 else x


def add_counts(t: BatchTensors, seq: dict[str, Any]) -> None:
    """Turns and tool calls per sequence (any number of values: names never depend on it)."""
    for key, _ in SEQUENCE_METRICS[4:]:
        x = t.get(key)
        if x is not None:
            seq[key] = x


def fetch(
    seq: Mapping[str, Any], tokens: TokenSummaries | None, extra: Sequence[Any] = ()
) -> tuple[dict[str, np.ndarray], np.ndarray, list[np.ndarray]]:
    """In one copy, as host arrays: the per-sequence vectors, the token block, the ``extra`` tensors."""
    plan = HostPlan()
    plan.add(list(seq.values()), lambda *arrays: dict(zip(seq, arrays)))
    plan.add(list(extra), lambda *arrays: list(arrays))
    if tokens is not None:
        plan.add([tokens.block], tokens.on_host)
    host, extra_host, *block = plan.run()
    return host, block[0] if block else empty_arrays(0), extra_host


# -------------------------------------------------------------------------------- on the host
def sequence_parts(seq: Mapping[str, np.ndarray], t: BatchTensors, nan_strategy: str) -> list[Part]:
    """The per-sequence metrics as parts (:data:`Part`), from the host vectors of :func:`sequence_tensors`."""
    parts: list[Part] = [(triple(prefix), seq[key], None) for key, prefix in SEQUENCE_METRICS if key in seq]
    lengths = seq.get("response_mask")
    if lengths is not None:
        parts.append((("response/clip_ratio/mean",), (lengths == t.response_width) * 1.0, None))
        parts.append((("response/aborted_ratio",), (lengths == 0) * 1.0, None))
        reward = seq.get("token_level_rewards")
        if reward is not None and reward.shape == lengths.shape:
            correct = reward > CORRECT_THRESHOLD
            wrong = ~correct  # a NaN reward is wrong, as siiRL counts it
            if nan_strategy == "drop":  # a non-finite reward: neither correct nor wrong
                known = np.isfinite(reward)
                correct, wrong = correct & known, wrong & known
            parts.append((triple("response/correct_length"), lengths, correct))
            parts.append((triple("response/wrong_length"), lengths, wrong))
    prompt = seq.get("prompt_mask")
    if prompt is not None:
        parts.append((("prompt/clip_ratio/mean",), (prompt == t.prompt_width) * 1.0, None))
    return parts


def part_summaries(
    parts: list[Part], nan_strategy: str = "propagate"
) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """Name groups and ``(5, K)`` summaries of parts; ``"error"`` raises naming the part's first name."""
    if nan_strategy == "error":
        for names, values, keep in parts:
            bad = int(nonfinite(values, keep))
            if bad:
                raise MetricValueError(
                    f"metric {names[0]!r}: {bad} non-finite value(s) (nan_strategy='error')"
                )
    out = empty_arrays(len(parts))
    by_size: dict[int, list[int]] = {}  # vectors of one size are summarized together
    for i, (_, values, _) in enumerate(parts):
        by_size.setdefault(values.size, []).append(i)
    for idx in by_size.values():
        values = np.stack([parts[i][1] for i in idx])
        keep = None
        if any(parts[i][2] is not None for i in idx):
            keep = np.ones(values.shape, dtype=bool)
            for row, i in enumerate(idx):
                if parts[i][2] is not None:
                    keep[row] = parts[i][2]
        out[:, idx] = summarize(values, keep, nan_strategy=nan_strategy)
    return [names for names, _, _ in parts], out


def part_rows(parts: list[Part], n: int, nan_strategy: str = "propagate") -> np.ndarray:
    """``(5, K, n)``: each part's summary per sequence (one observation or none), for group breakdowns.
    Raises ``MetricValueError`` for a part without one value per sequence.

    >>> part_rows([(("x/mean",), np.array([1.0, 2.0]), np.array([True, False]))], 2)[:, 0].tolist()
    [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, inf], [1.0, -inf]]
    """
    for names, values, _ in parts:
        if values.shape != (n,):
            raise MetricValueError(
                f"metric {names[0]!r}: {values.size} values for {n} sequences; a group breakdown needs "
                "one per sequence"
            )
    values = np.stack([v for _, v, _ in parts]) if parts else np.zeros((0, n))
    keep = np.stack([np.ones(n, bool) if k is None else k for _, _, k in parts]) if parts else None
    strategy = "drop" if nan_strategy == "drop" else "propagate"
    return summarize(values[..., None], None if keep is None else keep[..., None], nan_strategy=strategy)


__all__ = [
    "CORRECT_THRESHOLD", "SEQUENCE_METRICS", "VF_AUX", "Part", "add_counts", "add_sums", "column_values",
    "fetch", "metrics_of_arrays", "part_rows", "part_summaries", "sequence_parts",
    "sequence_tensors", "with_token_block",
]  # fmt: skip
