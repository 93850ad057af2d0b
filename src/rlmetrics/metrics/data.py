"""Data metrics of a PPO / GRPO batch: the seed's ``compute_data_metric``, exact under merging.

:func:`compute_data_stats` summarizes a batch into one :class:`~rlmetrics.stat.Stat` per metric name,
so that merging the Stats of all ranks gives the statistics of the concatenated batch:

- ``critic/advantages|returns|values/*`` summarize the response tokens (``response_mask != 0``):
  a global mean is token-weighted;
- ``critic/score|rewards/*`` (sums of the token-level tensors over each sequence), the response and
  prompt lengths, the ratios (clip, aborted), ``num_turns/*`` and ``tool_call_counts/*`` summarize
  sequences: a global mean is sequence-weighted;
- ``critic/vf_explained_var`` is ``1 - Var(returns - values) / (Var(returns) + 1e-5)`` over the
  response tokens (unbiased variances, as siiRL). A ratio of variances does not merge by itself, so
  its ingredients also travel under auxiliary names (pooled stds and the token count, see
  :mod:`rlmetrics.metrics`) and :func:`rlmetrics.metrics.derive_metrics` computes the exact global
  value from the merged result. The Stat under ``critic/vf_explained_var`` itself is the rank's
  value weighted by its token count: what a merge without that step reports.

:func:`compute_data_metric` is ``data_metrics_from_stats(compute_data_stats(batch))``, the seed's
``{name: float}``; a metric whose Stat holds no observation (no correct response in the batch, say)
is left out, as the aggregator leaves out names without data. Which names a batch yields depends
only on its keys, never on its values, so all ranks submit the same names.

Conventions (siiRL's, and verl's for the keys siiRL lacks): the response width is
``responses.shape[-1]`` (else ``response_mask``'s), the response mask is ``response_mask`` (else the
last columns of ``attention_mask``), the prompt mask the other columns of ``attention_mask``; a
response is correct when its summed ``token_level_rewards`` exceed :data:`CORRECT_THRESHOLD`;
``response/aborted_ratio`` is the share of responses without tokens (verl's definition; there is no
abort flag in siiRL 0.2.0), so it comes with the response lengths; ``tool_call_counts/*`` read the
``tool_call_counts`` key (verl's) and ``num_turns/*`` the ``__num_turns__`` key, any numeric dtype.

Everything is computed on the batch's device with fixed shapes (no masked_select, no ``.item()``)
and the summaries of all metrics reach the host in one transfer. On CPU the token summaries work in
scratch memory each thread keeps between calls (up to :data:`_SCRATCH_LIMIT` bytes, three
mask-sized tensors) rather than in fresh temporaries, whose page faults cost more than the
arithmetic. Missing keys skip the metrics that need them. Batch keys: ``responses``,
``attention_mask``, ``response_mask``, ``token_level_scores``, ``token_level_rewards``, ``advantages``,
``returns``, ``values``, ``__num_turns__``, ``tool_call_counts`` (tensors, numpy arrays or lists;
a TensorDict or a plain dict).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import psutil

from rlmetrics.extras import require
from rlmetrics.metrics import VF_RESIDUAL_STD, VF_RETURNS_STD, VF_TOKENS, derive_metrics, vf_explained_var
from rlmetrics.reduce import resolve
from rlmetrics.stat import Stat

torch = require("torch", "torch")

logger = logging.getLogger(__name__)

CORRECT_THRESHOLD = 0.5
"""A response is correct when its sequence reward (sum of ``token_level_rewards``) exceeds this."""

_MMM = ("mean", "max", "min")
_TOKEN_METRICS = (
    ("advantages", "critic/advantages"),
    ("returns", "critic/returns"),
    ("values", "critic/values"),
)

_VF_AUX = (VF_RETURNS_STD, VF_RESIDUAL_STD, VF_TOKENS)

Batch = Mapping[str, Any]


# ----------------------------------------------------------------------------------------- public
def compute_data_stats(batch: Batch, *, aux: bool = True) -> dict[str, Stat]:
    """One mergeable :class:`Stat` per data metric of ``batch`` (see the module docstring).

    ``aux=False`` leaves out the auxiliary Stats of the explained variance.

    >>> import torch
    >>> attention_mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # prompt 2, response 3
    >>> advantages = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    >>> batch = {"responses": torch.zeros(2, 3), "attention_mask": attention_mask, "advantages": advantages}
    >>> stats = compute_data_stats(batch)
    >>> s = stats["critic/advantages/mean"]
    >>> (s.count, s.mean, stats["response/length/mean"].count)
    (5.0, 3.0, 2.0)
    """
    plan = _Plan()
    _add_metrics(_Tensors(batch), plan)
    stats = plan.run()
    if VF_RETURNS_STD in stats and VF_RESIDUAL_STD in stats:
        n = stats[VF_RETURNS_STD].count
        stats[VF_TOKENS] = Stat(1.0, n, 0.0, n, n)  # one observation: the rank's token count
        ev = vf_explained_var({k: resolve(k).apply(stats[k]) for k in _VF_AUX})
        # fallback value for merges without derive_metrics: this rank's value, weighted by its tokens
        stats["critic/vf_explained_var"] = Stat() if ev is None else Stat(n, ev * n, 0.0, ev, ev)
        if not aux:
            for name in _VF_AUX:
                del stats[name]
    rss_gb = _process().memory_info().rss / 1024**3
    stats["perf/process_cpu_mem_used_gb"] = Stat(1.0, rss_gb, 0.0, rss_gb, rss_gb)
    return stats


def compute_data_metric(batch: Batch) -> dict[str, float]:
    """The seed's data metrics of ``batch`` as ``{name: float}``.

    >>> import torch
    >>> attention_mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # prompt 2, response 3
    >>> rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> batch = {"responses": torch.zeros(2, 3), "attention_mask": attention_mask}
    >>> batch["token_level_rewards"] = rewards
    >>> m = compute_data_metric(batch)
    >>> m["response/length/mean"], m["prompt/length/max"], m["response/clip_ratio/mean"]
    (2.5, 2.0, 0.5)
    >>> m["critic/rewards/mean"], m["response/correct_length/mean"], m["response/wrong_length/mean"]
    (0.5, 3.0, 2.0)
    """
    return data_metrics_from_stats(compute_data_stats(batch))


def data_metrics_from_stats(stats: Mapping[str, Stat]) -> dict[str, float]:
    """Reduce (merged) data Stats to ``{name: float}`` as the aggregator does: each name by its
    reduction, empty Stats left out, then :func:`rlmetrics.metrics.derive_metrics`.

    >>> import torch
    >>> a = compute_data_stats({"advantages": torch.tensor([[1.0, 2.0]]), "response_mask": torch.ones(1, 2)})
    >>> b = compute_data_stats({"advantages": torch.tensor([[6.0, 0.0]]), "response_mask": torch.eye(2)[:1]})
    >>> merged = {n: a[n].merge(b[n]) for n in a}
    >>> data_metrics_from_stats(merged)["critic/advantages/mean"]
    3.0
    """
    names = [name for name, s in stats.items() if s.count > 0]
    if not names:
        return {}
    arrays = np.array(
        [[stats[n].count, stats[n].sum, stats[n].m2, stats[n].min, stats[n].max] for n in names]
    ).T
    groups: dict[Any, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(resolve(name), []).append(i)
    values = np.empty(len(names))
    for reduction, idx in groups.items():  # one vectorised reduction per kind, as the aggregator does
        if reduction.needs_sketch:
            values[idx] = [reduction.apply(stats[names[i]]) for i in idx]
        else:
            values[idx] = reduction.apply_arrays(arrays[:, idx])
    return derive_metrics(dict(zip(names, values.tolist())))


# -------------------------------------------------------------------------------------- internals
_PROCESSES: dict[int, Any] = {}


def _process() -> Any:
    """This process's ``psutil.Process``, made once per pid (making one reads ``/proc`` twice)."""
    pid = os.getpid()
    if pid not in _PROCESSES:
        _PROCESSES.clear()
        _PROCESSES[pid] = psutil.Process(pid)
    return _PROCESSES[pid]


class _Tensors:
    """The batch's tensors (missing or unusable keys are None) and the response / prompt masks."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        responses = self.get("responses")
        attention = self.get("attention_mask")
        response_mask = self.get("response_mask")
        width = _last_dim(responses) if responses is not None else _last_dim(response_mask)
        self.response_width = width
        self.prompt_width: int | None = None
        self.prompt_mask = None
        if attention is not None and attention.dim() == 2 and width is not None:
            total = attention.shape[-1]
            if 0 <= width <= total:
                self.prompt_width = total - width
                self.prompt_mask = attention[:, : self.prompt_width]
                if response_mask is None:
                    response_mask = attention[:, self.prompt_width :]
        self.response_mask = response_mask if response_mask is not None and response_mask.dim() == 2 else None

    def get(self, key: str) -> Any:
        """``batch[key]`` as a tensor (numpy arrays and lists converted on the host), else None."""
        value = lookup(self.batch, key)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            try:
                arr = np.asarray(value)
                if arr.dtype.kind not in "biuf":
                    arr = arr.astype(np.float64)
                value = torch.as_tensor(arr)
            except (TypeError, ValueError) as exc:
                logger.debug("batch key %r is not numeric (%s); its metrics are skipped", key, exc)
                return None
        return None if value.is_complex() else value.detach()


def lookup(batch: Batch, key: str) -> Any:
    """``batch[key]`` or None; a TensorDict's non-tensor entries come back as their data."""
    try:
        return batch[key] if key in batch else None
    except (TypeError, KeyError):
        return None


def _last_dim(t: Any) -> int | None:
    return int(t.shape[-1]) if t is not None and t.dim() >= 1 else None


def _float(t: Any) -> Any:
    """Floating point for arithmetic: float32 and float64 kept, others to float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


class _Plan:
    """Summaries to compute on the device; :meth:`run` moves them to the host in one transfer."""

    def __init__(self) -> None:
        self.rows: list[tuple[tuple[str, ...], Any, Any]] = []  # per-sequence values and weights
        self.tokens: list[tuple[list[tuple[str, ...]], Any]] = []  # (5, K) blocks of token summaries

    def sequence(self, names: tuple[str, ...], values: Any, weights: Any = None) -> None:
        self.rows.append((names, values.reshape(-1), None if weights is None else weights.reshape(-1)))

    def token_block(self, names: list[tuple[str, ...]], block: Any) -> None:
        """A ``(5, K)`` float64 block of summaries, column ``k`` for the names ``names[k]``."""
        self.tokens.append((names, block))

    def run(self) -> dict[str, Stat]:
        parts, names = [], []
        device = _common_device([v for _, v, _ in self.rows] + [b for _, b in self.tokens])
        if self.rows:
            lengths = {v.shape[0] for _, v, _ in self.rows}
            if len(lengths) > 1:  # inconsistent batch sizes: keep the metrics of the most common size
                sizes = [v.shape[0] for _, v, _ in self.rows]
                keep = max(lengths, key=sizes.count)
                dropped = [n[0] for n, v, _ in self.rows if v.shape[0] != keep]
                logger.warning("batch tensors disagree on the batch size; skipped %s", dropped)
                self.rows = [r for r in self.rows if r[1].shape[0] == keep]
            values = torch.stack([_on(v, device) for _, v, _ in self.rows])
            ones = torch.ones(values.shape[1], dtype=torch.float64, device=device)
            weights = torch.stack([ones if w is None else _on(w, device) for _, _, w in self.rows])
            parts.append(_summarize_rows(values, weights))
            names += [n for n, _, _ in self.rows]
        for block_names, block in self.tokens:
            parts.append(_on(block, device))
            names += block_names
        if not parts:
            return {}
        columns = torch.cat(parts, dim=1).T.tolist()  # the one transfer: (count, sum, m2, min, max) each
        return {name: Stat(*column) for group, column in zip(names, columns) for name in group}


def _on(t: Any, device: Any) -> Any:
    """``t`` as float64 on ``device``, moved only when it lives elsewhere (host arrays to the device)."""
    if t.device != device:
        t = t.to(device)
    return t if t.dtype == torch.float64 else t.to(torch.float64)


def _common_device(tensors: list[Any]) -> Any:
    """An accelerator device when any tensor lives on one (so nothing moves to the host early)."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def _summarize_rows(values: Any, weights: Any) -> Any:
    """``(5, K)`` count, sum, m2, min, max of ``K`` weighted rows, with fixed shapes (no sync).

    A zero-weight column is appended, so empty rows (batch of zero) reduce without error.
    """
    k = values.shape[0]
    values = torch.cat([values, values.new_zeros(k, 1)], dim=1)
    weights = torch.cat([weights, weights.new_zeros(k, 1)], dim=1)
    keep = weights > 0
    xs = torch.where(keep, values, 0.0)
    n = weights.sum(1)
    s = (weights * xs).sum(1)
    mean = s / torch.where(n > 0, n, 1.0)
    dev = torch.where(keep, xs - mean[:, None], 0.0)
    m2 = (weights * dev * dev).sum(1)
    mn = torch.where(keep, values, math.inf).amin(1)
    mx = torch.where(keep, values, -math.inf).amax(1)
    return torch.stack([n, s, m2, mn, mx])


class _TokenMask:
    """The response mask as the token summaries use it, built once per batch into ``out``.

    Two integer tensors as wide as the float data summarized (``out`` is ``(2, *mask.shape)``): ``on``
    is 1 on the response (``mask != 0``, as masked_select reads a mask) and 0 off it, ``off`` the
    reverse. Multiplying the integers of float data by ``on`` keeps response tokens exactly and
    zeroes the padding whatever it holds (nan or inf too, which a float multiplication would
    spread); adding ``off * v`` then sets the padding to the bits of ``v``. Integer arithmetic runs
    several times faster than boolean kernels such as ``torch.where`` on CPU.
    """

    def __init__(self, mask: Any, out: Any) -> None:
        self.on, self.off = out
        self.on.copy_(mask.ne(0) if mask.is_floating_point() else mask).ne_(0)
        self.count = self.on.sum(dtype=self.on.dtype).to(torch.float64)  # (a float64 sum of ints is slower)
        self.divisor = self.count.clamp(min=1.0)
        torch.bitwise_xor(self.on, 1, out=self.off)


_SCRATCH_LIMIT = 32 * 2**20
"""Bytes of scratch memory a thread keeps between calls on CPU (see :func:`_scratch`)."""

_kept = threading.local()


def _scratch(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """An uninitialised tensor: on CPU a view of the calling thread's kept scratch memory (up to
    :data:`_SCRATCH_LIMIT` bytes), as there a fresh multi-megabyte temporary costs a page fault every
    4 KiB whenever the allocator has handed freed memory back to the system. Accelerator allocators
    keep their memory themselves. Nothing derived from the result may outlive the caller's use."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes > _SCRATCH_LIMIT:
        return torch.empty(shape, dtype=dtype, device=device)
    kept = getattr(_kept, "memory", None)
    if kept is None or kept.numel() < nbytes:
        with torch.inference_mode(False):  # a normal tensor: later calls may run outside inference mode
            kept = _kept.memory = torch.empty(nbytes, dtype=torch.uint8)
    return kept[:nbytes].view(dtype).view(shape)


def _summarize_tokens(x: Any, mask: _TokenMask, buf: Any) -> tuple[Any, Any, Any, Any]:
    """Sum, m2 (float64) and min, max (``x``'s dtype) of the response tokens of ``x``, on its device.

    ``x`` is float32 or float64; ``buf`` an integer scratch tensor as wide, of the mask's shape (it
    may be ``x`` itself viewed as integers). Sums run per row in ``x``'s precision and across rows
    in float64. Padding is replaced with the mean before min/max and centering, so it changes
    neither, and no shape depends on the data (no sync).
    """
    f64 = torch.float64
    torch.mul(x.view(buf.dtype), mask.on, out=buf)
    vals = buf.view(x.dtype)  # x on response tokens, +0.0 (all bits 0) on padding
    total = vals.sum(-1).sum(dtype=f64)
    mean = (total / mask.divisor).to(x.dtype)
    buf.addcmul_(mask.off, mean.view(buf.dtype))  # padding := mean, in place
    mn, mx = torch.aminmax(vals)
    vals.sub_(mean)
    m2 = vals.mul_(vals).sum(-1).sum(dtype=f64)
    return total, m2, mn, mx


def _triple(prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}/{r}" for r in _MMM)


def _add_metrics(t: _Tensors, plan: _Plan) -> None:
    """Queue every metric the batch has the keys for."""
    f64 = torch.float64
    # sequence scores and rewards: sums over the whole row, as siiRL (token-level tensors are 0 off-response)
    seq_reward = None
    for key, prefix in (("token_level_scores", "critic/score"), ("token_level_rewards", "critic/rewards")):
        x = t.get(key)
        if x is not None and x.dim() >= 1:
            seq = _float(x).sum(-1).to(f64) if x.dim() >= 2 else x.to(f64)
            plan.sequence(_triple(prefix), seq)
            if key == "token_level_rewards":
                seq_reward = seq

    mask = t.response_mask
    if mask is not None:
        lengths = mask.sum(-1).to(f64)
        plan.sequence(_triple("response/length"), lengths)
        plan.sequence(("response/clip_ratio/mean",), (lengths == t.response_width).to(f64))
        plan.sequence(("response/aborted_ratio",), (lengths == 0).to(f64))
        if seq_reward is not None and seq_reward.shape[0] == lengths.shape[0]:
            correct = (seq_reward > CORRECT_THRESHOLD).to(f64)
            plan.sequence(_triple("response/correct_length"), lengths, correct)
            plan.sequence(_triple("response/wrong_length"), lengths, 1.0 - correct)
        _add_token_metrics(t, plan, mask)

    if t.prompt_mask is not None:
        prompt_lengths = t.prompt_mask.sum(-1).to(f64)
        plan.sequence(_triple("prompt/length"), prompt_lengths)
        plan.sequence(("prompt/clip_ratio/mean",), (prompt_lengths == t.prompt_width).to(f64))

    for key, prefix in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        x = t.get(key)
        if x is not None and x.numel() > 0:
            plan.sequence(_triple(prefix), x.to(f64))


def _add_token_metrics(t: _Tensors, plan: _Plan, mask: Any) -> None:
    """Advantages, returns, values and the explained-variance ingredients over response tokens."""
    found = {}
    for key, _ in _TOKEN_METRICS:
        x = t.get(key)
        if x is not None and tuple(x.shape) == tuple(mask.shape):
            found[key] = _float(x)
    if not found:
        return
    vf = "returns" in found and "values" in found
    names = [
        _triple(prefix) + ((VF_RETURNS_STD,) if vf and key == "returns" else ())
        for key, prefix in _TOKEN_METRICS
        if key in found
    ] + ([(VF_RESIDUAL_STD,)] if vf else [])
    f64 = torch.float64
    if mask.numel() == 0:
        empty = torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=f64, device=mask.device)
        plan.token_block(names, empty[:, None].expand(5, len(names)))
        return
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in found.values()) else torch.float32
    scratch = _scratch((3, *mask.shape), torch.int64 if dtype == f64 else torch.int32, mask.device)
    token_mask = _TokenMask(mask, out=scratch[:2])
    buf = scratch[2]
    parts = [
        _summarize_tokens(found[key].to(dtype), token_mask, buf) for key, _ in _TOKEN_METRICS if key in found
    ]
    if vf:  # the residual is computed into the scratch buffer and summarized in place
        residual = torch.sub(found["returns"].to(dtype), found["values"].to(dtype), out=buf.view(dtype))
        parts.append(_summarize_tokens(residual, token_mask, buf))
    sums, m2s, mins, maxs = torch.stack([v for part in parts for v in part]).view(-1, 4).T  # float64
    has = token_mask.count > 0
    mins, maxs = torch.where(has, mins, math.inf), torch.where(has, maxs, -math.inf)
    plan.token_block(names, torch.stack([token_mask.count.expand(len(parts)), sums, m2s, mins, maxs]))


__all__ = ["CORRECT_THRESHOLD", "compute_data_metric", "compute_data_stats", "data_metrics_from_stats"]
