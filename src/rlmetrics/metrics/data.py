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
only on its keys, never on its values (a batch of 0 sequences yields every name, with empty Stats),
so all ranks submit the same names. Non-finite observations follow ``nan_strategy``
(:func:`compute_data_stats`).

Conventions (siiRL's, and verl's for the keys siiRL lacks): the response width is
``responses.shape[-1]`` (else ``response_mask``'s), the response mask is ``response_mask`` (else the
last columns of ``attention_mask``), the prompt mask the other columns of ``attention_mask``; a
response is correct when its summed ``token_level_rewards`` exceed :data:`CORRECT_THRESHOLD`;
``response/aborted_ratio`` is the share of responses without tokens (verl's definition; there is no
abort flag in siiRL 0.2.0), so it comes with the response lengths; ``tool_call_counts/*`` read the
``tool_call_counts`` key (verl's) and ``num_turns/*`` the ``__num_turns__`` key, any numeric dtype.

**verl's names** (:func:`compute_verl_data_stats`, behind
:func:`rlmetrics.integrations.verl.compute_data_metrics`): ``critic/score|rewards/*`` of the
responses that are not empty, ``response_length/*`` and ``prompt_length/*`` from ``attention_mask``
(:func:`verl_lengths`: tool output in a multi-turn response counts), ``response_length/clip_ratio``,
``response_length_non_aborted/*``, ``response/aborted_ratio``, ``prompt_length/clip_ratio`` against
``prompts.shape[-1]``; token metrics over ``response_mask``; ``critic/values/*`` and the explained
variance only with ``use_critic``; no correct/wrong lengths, no process memory.
:func:`compute_variance_proxy_stats` is verl's ``compute_variance_proxy_metrics`` as Stats.

The token summaries and the per-sequence sums (scores, rewards, lengths) are computed on the
batch's device with fixed shapes (no masked_select, no ``.item()``); they reach the host in one
transfer, where the per-sequence metrics are summarized with numpy (a few numbers per sequence:
small operations cost less there than as device kernels). On CPU the token summaries work in
scratch memory each thread keeps between calls (up to :data:`_SCRATCH_LIMIT` bytes: two masks and
the tensors summarized together, all of the mask's shape) rather than in fresh temporaries, whose
page faults cost more than the arithmetic. Missing keys skip the metrics that need them; a key of
the wrong shape or dtype raises :class:`~rlmetrics.stat.MetricValueError` naming it. Batch keys:
``responses``, ``attention_mask``, ``response_mask``, ``token_level_scores``,
``token_level_rewards``, ``advantages``, ``returns``, ``values``, ``__num_turns__``,
``tool_call_counts`` (tensors, numpy arrays or lists), in a plain dict, a TensorDict or a verl
``DataProto`` (:mod:`rlmetrics.metrics.batch`).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import psutil

from rlmetrics.extras import require
from rlmetrics.metrics import (
    VF_RESIDUAL_STD,
    VF_RETURNS_STD,
    VF_TOKENS,
    VP_SEQUENCES,
    derive_metrics,
    variance_proxy_noise,
    vf_explained_var,
)
from rlmetrics.metrics.batch import as_batch, key_error
from rlmetrics.reduce import resolve
from rlmetrics.stat import NAN_STRATEGIES, MetricValueError, Stat, empty_arrays, is_dataless, to_host

torch = require("torch", "torch")

logger = logging.getLogger(__name__)

CORRECT_THRESHOLD = 0.5
"""A response is correct when its sequence reward (sum of ``token_level_rewards``) exceeds this."""

_MMM = ("mean", "max", "min")
_TOKEN_METRICS = (  # batch key and metric prefix
    ("advantages", "critic/advantages"),
    ("returns", "critic/returns"),
    ("values", "critic/values"),
)

_SEQUENCE_METRICS = (  # batch key (the response / prompt mask: its lengths) and metric prefix
    ("token_level_scores", "critic/score"),
    ("token_level_rewards", "critic/rewards"),
    ("response_mask", "response/length"),
    ("prompt_mask", "prompt/length"),
    ("__num_turns__", "num_turns"),
    ("tool_call_counts", "tool_call_counts"),
)

_VF_AUX = (VF_RETURNS_STD, VF_RESIDUAL_STD, VF_TOKENS)

Batch = Any  # a mapping, a TensorDict or a DataProto-shaped object: rlmetrics.metrics.batch


# ----------------------------------------------------------------------------------------- public
def compute_data_stats(
    batch: Batch, *, aux: bool = True, torch_compile: bool = False, nan_strategy: str = "propagate"
) -> dict[str, Stat]:
    """One mergeable :class:`Stat` per data metric of ``batch`` (see the module docstring).

    ``nan_strategy``: non-finite values of the observations (response tokens of advantages, returns
    and values; sequence scores, rewards, turns, tool calls) reach the statistics (``"propagate"``),
    are left out (``"drop"``; a sequence with a non-finite reward has no correct/wrong length), or
    raise :class:`~rlmetrics.stat.MetricValueError` naming the metric (``"error"``).
    ``aux=False`` leaves out the auxiliary Stats of the explained variance. ``torch_compile=True``
    computes the token summaries (advantages, returns, values) with ``torch.compile``: fused kernels,
    about 2.5x faster for them on this CPU, after a first call that compiles for 10-30 s (a C++
    compiler on CPU, Triton on GPU; where compiling fails, a warning and the eager path).

    >>> import torch
    >>> attention_mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # prompt 2, response 3
    >>> advantages = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    >>> batch = {"responses": torch.zeros(2, 3), "attention_mask": attention_mask, "advantages": advantages}
    >>> stats = compute_data_stats(batch)
    >>> s = stats["critic/advantages/mean"]
    >>> (s.count, s.mean, stats["response/length/mean"].count)
    (5.0, 3.0, 2.0)
    """
    names, arrays = _data_arrays(batch, torch_compile, nan_strategy)
    stats = {name: Stat(*column) for name, column in zip(names, arrays.T.tolist())}
    if not aux:
        for name in _VF_AUX:
            stats.pop(name, None)
    return stats


def compute_data_metric(
    batch: Batch, *, torch_compile: bool = False, nan_strategy: str = "propagate"
) -> dict[str, float]:
    """The seed's data metrics of ``batch`` as ``{name: float}`` (``nan_strategy``: as
    :func:`compute_data_stats`).

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
    return _metrics_of_arrays(*_data_arrays(batch, torch_compile, nan_strategy))


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
    names = list(stats)
    arrays = np.array([[s.count, s.sum, s.m2, s.min, s.max] for s in stats.values()]).T
    return _metrics_of_arrays(names, arrays.reshape(5, len(names)), stats)


def compute_verl_data_stats(
    batch: Batch, *, use_critic: bool = True, torch_compile: bool = False
) -> dict[str, Stat]:
    """verl 0.9.1's ``compute_data_metrics`` of ``batch`` as one mergeable :class:`Stat` per name
    (verl's names and semantics, see the module docstring), with the explained-variance ingredients.

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
    names, arrays = verl_data_arrays(batch, use_critic=use_critic, torch_compile=torch_compile)
    return {name: Stat(*column) for name, column in zip(names, arrays.T.tolist())}


def verl_data_arrays(
    batch: Batch, *, use_critic: bool = True, torch_compile: bool = False
) -> tuple[list[str], np.ndarray]:
    """:func:`compute_verl_data_stats` as names and their ``(5, K)`` stat array."""
    t = _Tensors(batch)
    plan = _Plan()
    _add_sums(t, plan)
    lengths = _verl_lengths(t)
    if lengths is not None:
        plan.sequences["prompt_length"], plan.sequences["response_length"] = lengths
    if t.response_mask is not None:
        keys = ("advantages", "returns", "values") if use_critic else ("advantages", "returns")
        _add_token_metrics(t, plan, t.response_mask, torch_compile, keys)
    _add_counts(t, plan)
    sequences, block = plan.run()
    return _with_token_block(*_part_summaries(_verl_parts(sequences, t)), plan, block)


def verl_lengths(batch: Batch) -> tuple[Any, Any] | None:
    """verl's prompt and response lengths per sequence: the batch's ``prompt_length`` and
    ``response_length`` when it has both, else the sums of ``attention_mask`` before and over the
    last ``responses.shape[-1]`` columns (tool output in a multi-turn response counts); None if
    neither is there.

    >>> import torch
    >>> batch = {"responses": torch.zeros(1, 3), "attention_mask": torch.tensor([[0, 1, 1, 1, 0]])}
    >>> [x.tolist() for x in verl_lengths(batch)]
    [[1], [2]]
    """
    return _verl_lengths(_Tensors(batch))


def compute_variance_proxy_stats(batch: Batch, gradient_norm: float | None = None) -> dict[str, Stat]:
    """verl 0.9.1's ``compute_variance_proxy_metrics`` as mergeable Stats: per sequence ``A**2 * W``
    (``proxy2_total_power``; with ``rollout_is_weights`` its off-policy form), ``A**2`` and ``W``, where
    ``A`` is the sequence's mean advantage (verl's masked mean, ``+ 1e-8`` in the denominator) and ``W``
    the sum over its response tokens of ``1 - 2 exp(old_log_probs) + sum_pi_squared``;
    ``proxy1_signal_strength`` is ``gradient_norm**2``; ``proxy3_pure_noise``
    (``max(0, (proxy2 - proxy1) / (N - 1))`` over the ``N`` sequences) comes with the sequence count
    under :data:`~rlmetrics.metrics.VP_SEQUENCES`, so the merged value is the full batch's. Empty
    without ``sum_pi_squared``, ``old_log_probs``, ``advantages`` or a response mask.

    >>> import torch
    >>> batch = {"old_log_probs": torch.zeros(2, 2), "sum_pi_squared": torch.ones(2, 2),
    ...          "advantages": torch.tensor([[1.0, 1.0], [2.0, 0.0]]), "response_mask": torch.ones(2, 2)}
    >>> stats = compute_variance_proxy_stats(batch, gradient_norm=1.0)
    >>> round(stats["variance_proxy/expected_a_squared"].mean, 6), stats["variance_proxy/expected_w"].mean
    (1.0, 0.0)
    """
    t = _Tensors(batch)
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
    """The batch's tensors (missing keys are None) and the response / prompt masks.

    Recognised keys of the wrong shape or dtype raise, naming the key: the masks and ``responses``
    are 2-D with one row per sequence, ``response_mask`` has the shape of ``responses``, and
    ``attention_mask`` is at least as wide as the response.
    """

    def __init__(self, batch: Batch, what: str = "compute_data_metric") -> None:
        self.batch = as_batch(batch, what)
        self.size: int | None = None  # sequences in the batch
        self._size_key = ""
        responses = self.get("responses")
        attention = self.get("attention_mask")
        response_mask = self.get("response_mask")
        for key, x in (
            ("responses", responses),
            ("attention_mask", attention),
            ("response_mask", response_mask),
        ):
            if x is not None:
                if x.dim() != 2:
                    raise key_error(key, f"must be 2-D (sequences, tokens), got shape {tuple(x.shape)}")
                self.check_size(key, x)
        if responses is not None and response_mask is not None and responses.shape != response_mask.shape:
            raise key_error(
                "response_mask", f"shape {tuple(response_mask.shape)}, responses' is {tuple(responses.shape)}"
            )
        width = _last_dim(responses) if responses is not None else _last_dim(response_mask)
        self.response_width = width
        self.attention = attention
        self.prompt_width: int | None = None
        self.prompt_mask = None
        if attention is not None and width is not None:
            total = attention.shape[-1]
            if width > total:
                raise key_error("attention_mask", f"{total} columns, fewer than the {width} response columns")
            self.prompt_width = total - width
            self.prompt_mask = attention[:, : self.prompt_width]
            if response_mask is None:
                response_mask = attention[:, self.prompt_width :]
        self.response_mask = response_mask

    def check_size(self, key: str, x: Any) -> None:
        """Raise unless ``x`` has one row per sequence of the batch (the first key checked sets it)."""
        n = int(x.shape[0])
        if self.size is None:
            self.size, self._size_key = n, key
        elif n != self.size:
            raise key_error(key, f"{n} rows, {self._size_key!r} has {self.size} sequences")

    def get(self, key: str) -> Any:
        """``batch[key]`` as a tensor (numpy arrays and lists converted on the host), else None."""
        value = self.batch.get(key)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            try:
                arr = np.asarray(value)
            except ValueError as exc:  # ragged
                raise key_error(key, f"not an array of numbers ({exc})") from None
            if arr.dtype.kind == "O" and all(isinstance(v, numbers.Real) for v in arr.flat):
                arr = arr.astype(np.float64)  # verl's non_tensor_batch: object arrays of numbers
            if arr.dtype.kind not in "biuf":
                raise key_error(key, f"must be numbers, got {arr.dtype} data")
            value = torch.as_tensor(arr)
        if value.is_complex() or is_dataless(value) or value.layout != torch.strided:
            raise key_error(
                key, f"must be a dense real tensor, got {value.dtype} {value.layout} on {value.device}"
            )
        return value.detach()


def _last_dim(t: Any) -> int | None:
    return int(t.shape[-1]) if t is not None and t.dim() >= 1 else None


def _float(t: Any) -> Any:
    """Floating point for arithmetic: float32 and float64 kept, others to float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


class _Plan:
    """Device tensors of one call: per-sequence vectors and one block of token summaries."""

    def __init__(self) -> None:
        self.sequences: dict[str, Any] = {}  # 1-D per-sequence values, by batch key
        self.token_names: list[tuple[str, ...]] = []
        self.token_block: Any = None  # (5, K) summaries, column k for the names token_names[k]
        self.token_inputs: Any = None  # (keys, tensors, residual, mask) of the token block

    def run(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The sequences as host arrays and the ``(5, K)`` token block, moved in one copy."""
        tensors = list(self.sequences.values())
        if self.token_block is not None:
            tensors.append(self.token_block)
        arrays = to_host(tensors)
        block = arrays.pop().reshape(5, -1) if self.token_block is not None else empty_arrays(0)
        return dict(zip(self.sequences, arrays)), block


def _data_arrays(batch: Batch, torch_compile: bool, nan_strategy: str) -> tuple[list[str], np.ndarray]:
    """The data metrics' names and their ``(5, K)`` stat array: count, sum, m2, min, max."""
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    t = _Tensors(batch)
    plan = _Plan()
    _add_metrics(t, plan, torch_compile)
    sequences, block = plan.run()
    if nan_strategy != "propagate" and not _finite_block(block):
        block = _finite_token_block(plan, nan_strategy, block)
    names, arrays = _with_token_block(*_sequence_summaries(sequences, t, nan_strategy), plan, block)
    rss_gb = _process().memory_info().rss / 1024**3
    names.append("perf/process_cpu_mem_used_gb")
    return names, np.concatenate([arrays, np.array([(1.0, rss_gb, 0.0, rss_gb, rss_gb)]).T], axis=1)


def _with_token_block(
    groups: list[tuple[str, ...]], arrays: np.ndarray, plan: _Plan, block: np.ndarray
) -> tuple[list[str], np.ndarray]:
    """Names and ``(5, K)`` stat array of the per-sequence summaries, the token summaries and, with
    returns and values, the explained variance (its token count and this batch's value)."""
    groups = groups + plan.token_names
    arrays = np.concatenate([arrays, block], axis=1)[
        :, np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    ]
    names = [name for group in groups for name in group]
    if VF_RETURNS_STD not in names or VF_RESIDUAL_STD not in names:
        return names, arrays
    n = arrays[0, names.index(VF_RETURNS_STD)]
    stds = resolve(VF_RETURNS_STD).apply_arrays(arrays[:, [names.index(k) for k in _VF_AUX[:2]]])
    ev = vf_explained_var(dict(zip(_VF_AUX, [*stds.tolist(), n])))
    names += [VF_TOKENS, "critic/vf_explained_var"]
    extra = [(1.0, n, 0.0, n, n)]  # one observation: the rank's token count
    # fallback value for merges without derive_metrics: this rank's value, weighted by its tokens
    extra += [(0.0, 0.0, 0.0, math.inf, -math.inf) if ev is None else (n, ev * n, 0.0, ev, ev)]
    return names, np.concatenate([arrays, np.array(extra).T], axis=1)


@functools.lru_cache(maxsize=256)
def _reductions(names: tuple[str, ...]) -> list[tuple[Any, np.ndarray]]:
    """The names' reductions and the indices of the names each one reduces (names repeat per call)."""
    groups: dict[Any, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(resolve(name), []).append(i)
    return [(reduction, np.array(idx)) for reduction, idx in groups.items()]


def _metrics_of_arrays(
    names: list[str], arrays: np.ndarray, stats: Mapping[str, Stat] | None = None
) -> dict[str, float]:
    """``{name: float}`` of a ``(5, K)`` stat array as the aggregator reports it: each name by its
    reduction (one vectorised reduction per kind; quantiles from the sketches of ``stats``, the
    Stats of the array), names without observations left out, then
    :func:`rlmetrics.metrics.derive_metrics`."""
    values = column_values(names, arrays, stats)
    has = (arrays[0] > 0).tolist()
    return derive_metrics({name: v for name, v, h in zip(names, values.tolist(), has) if h})


def column_values(
    names: Sequence[str], arrays: np.ndarray, stats: Mapping[str, Stat] | None = None
) -> np.ndarray:
    """The value of each column of a ``(5, K)`` stat array by its name's reduction (NaN where it
    holds no observation), one vectorised reduction per kind; quantiles from the sketches of ``stats``.

    >>> column_values(["x/max", "x/mean"], Stat.of([1.0, 3.0]).to_array()[:, None].repeat(2, 1)).tolist()
    [3.0, 2.0]
    """
    values = np.empty(len(names))
    for reduction, idx in _reductions(tuple(names)):
        if reduction.needs_sketch:  # only a user's merged Stats carry sketches
            values[idx] = [reduction.apply(stats[names[i]]) for i in idx]
        else:
            values[idx] = reduction.apply_arrays(arrays[:, idx])
    return values


def _finite_keep(names: tuple[str, ...], values: np.ndarray, keep: Any, nan_strategy: str) -> Any:
    """Which of ``values`` to keep under ``nan_strategy`` ("drop" or "error"), given ``keep``."""
    bad = ~np.isfinite(values)
    if keep is not None:
        bad &= keep
    if not bad.any():
        return keep
    if nan_strategy == "error":
        raise MetricValueError(
            f"metric {names[0]!r}: {int(bad.sum())} non-finite value(s) (nan_strategy='error')"
        )
    return ~bad if keep is None else keep & ~bad


def _finite_block(block: np.ndarray) -> bool:
    """Whether the token summaries summarize finite values only: their min and max are finite (a
    NaN or an infinity reaches one of them; a sum may overflow from finite values)."""
    has = block[0] > 0
    return bool(np.isfinite(block[3:5, has]).all())


def _finite_token_block(plan: _Plan, nan_strategy: str, block: np.ndarray) -> np.ndarray:
    """The token block under ``nan_strategy`` when it is not finite (a rare path, a second transfer):
    ``"error"`` raises for a non-finite response token, ``"drop"`` summarizes each tensor over its
    finite response tokens (the explained variance over the tokens where returns and values both
    are), in columns of their own (``plan.token_names`` follows)."""
    keys, xs, residual, mask = plan.token_inputs
    on = mask != 0
    finite = [torch.isfinite(x) for x in xs]
    bad = torch.stack([(on & ~f).sum() for f in finite]).tolist()
    prefixes = dict(_TOKEN_METRICS)
    if nan_strategy == "error":
        for key, n in zip(keys, bad):
            if n:
                raise MetricValueError(
                    f"metric {prefixes[key] + '/*'!r}: {int(n)} non-finite response value(s) in batch key "
                    f"{key!r} (nan_strategy='error')"
                )
        return block
    groups, blocks = [], []
    for key, x, f in zip(keys, xs, finite):
        groups.append(_triple(prefixes[key]))
        blocks.append(_token_block((x,), None, on & f))
    if residual is not None:
        i, j = residual
        groups += [(VF_RETURNS_STD,), (VF_RESIDUAL_STD,)]
        blocks.append(_token_block((xs[i], xs[j]), (0, 1), on & finite[i] & finite[j])[:, [0, 2]])
    plan.token_names = groups
    return to_host([torch.cat(blocks, 1)])[0].reshape(5, -1)


def _summaries(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``(5, K)`` count, sum, m2, min, max of the rows of ``values`` ``(K, N)`` where ``keep``."""
    n = keep.sum(1, dtype=np.float64)
    s = np.where(keep, values, 0.0).sum(1)
    dev = np.where(keep, values - (s / np.maximum(n, 1.0))[:, None], 0.0)  # nan in a kept value propagates
    m2 = np.einsum("ij,ij->i", dev, dev)
    mn = np.where(keep, values, np.inf).min(1, initial=np.inf)
    mx = np.where(keep, values, -np.inf).max(1, initial=-np.inf)
    return np.stack([n, s, m2, mn, mx])


def _sequence_summaries(
    seq: Mapping[str, np.ndarray], t: _Tensors, nan_strategy: str
) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """The per-sequence metrics' name groups and ``(5, K)`` summaries, from the sequence vectors on
    the host (:func:`_add_metrics` queues them); non-finite values as ``nan_strategy`` says."""
    parts: list[tuple[tuple[str, ...], np.ndarray, Any]] = [  # names, values, which to keep (None: all)
        (_triple(prefix), seq[key], None) for key, prefix in _SEQUENCE_METRICS if key in seq
    ]
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
            parts.append((_triple("response/correct_length"), lengths, correct))
            parts.append((_triple("response/wrong_length"), lengths, wrong))
    prompt = seq.get("prompt_mask")
    if prompt is not None:
        parts.append((("prompt/clip_ratio/mean",), (prompt == t.prompt_width) * 1.0, None))
    return _part_summaries(parts, nan_strategy)


def _part_summaries(
    parts: list[tuple[tuple[str, ...], np.ndarray, Any]], nan_strategy: str = "propagate"
) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """The name groups and ``(5, K)`` summaries of ``(names, values, which to keep or None)`` parts;
    non-finite values as ``nan_strategy`` says."""
    if nan_strategy != "propagate":
        parts = [
            (names, values, _finite_keep(names, values, keep, nan_strategy)) for names, values, keep in parts
        ]
    out = empty_arrays(len(parts))
    by_size: dict[int, list[int]] = {}  # vectors of one size are summarized together
    for i, (_, values, _) in enumerate(parts):
        by_size.setdefault(values.size, []).append(i)
    for idx in by_size.values():
        values = np.stack([parts[i][1] for i in idx])
        keep = np.ones(values.shape, dtype=bool)
        for row, i in enumerate(idx):
            if parts[i][2] is not None:
                keep[row] = parts[i][2]
        out[:, idx] = _summaries(values, keep)
    return [names for names, _, _ in parts], out


def _verl_lengths(t: _Tensors) -> tuple[Any, Any] | None:
    prompt, response = t.get("prompt_length"), t.get("response_length")
    if prompt is not None and response is not None:
        return prompt.reshape(-1), response.reshape(-1)
    attention, width = t.get("attention_mask"), t.response_width
    if attention is None or attention.dim() != 2 or not width or width > attention.shape[-1]:
        return None
    split = attention.shape[-1] - width
    return attention[:, :split].sum(-1), attention[:, split:].sum(-1)


def _verl_parts(seq: Mapping[str, np.ndarray], t: _Tensors) -> list[tuple[tuple[str, ...], np.ndarray, Any]]:
    """verl's per-sequence metrics: scores and rewards of the responses that are not empty, response
    lengths (all, and without the empty ones), the share of empty responses, prompt lengths, turns
    and tool calls."""
    response = seq.get("response_length")
    kept = None if response is None else response != 0
    parts = []
    for key, prefix in _SEQUENCE_METRICS[:2]:
        if key in seq:
            keep = kept if kept is not None and kept.shape == seq[key].shape else None
            parts.append((_triple(prefix), seq[key], keep))
    if response is not None:
        clipped = (response == t.response_width) * 1.0
        parts += [
            (_triple("response_length"), response, None),
            (("response_length/clip_ratio",), clipped, None),
            (_triple("response_length_non_aborted"), response, kept),
            (("response_length_non_aborted/clip_ratio",), clipped, kept),
            (("response/aborted_ratio",), (response == 0) * 1.0, None),
        ]
    prompt = seq.get("prompt_length")
    if prompt is not None:
        prompts = t.get("prompts")
        width = _last_dim(prompts) if prompts is not None else t.prompt_width
        parts += [
            (_triple("prompt_length"), prompt, None),
            (("prompt_length/clip_ratio",), (prompt == width) * 1.0, None),
        ]
    parts += [(_triple(prefix), seq[key], None) for key, prefix in _SEQUENCE_METRICS[4:] if key in seq]
    return parts


class _TokenMask:
    """The response mask as the token summaries use it, built once per batch (into ``out`` if given).

    Two integer tensors of ``dtype``, as wide as the float data summarized: ``on``
    is 1 on the response (``mask != 0``, as masked_select reads a mask) and 0 off it, ``off`` the
    reverse. Multiplying the integers of float data by ``on`` keeps response tokens exactly and
    zeroes the padding whatever it holds (nan or inf too, which a float multiplication would
    spread); adding ``off * v`` then sets the padding to the bits of ``v``. Integer arithmetic runs
    several times faster than boolean kernels such as ``torch.where`` on CPU.
    """

    def __init__(self, mask: Any, dtype: Any, out: Any = None) -> None:
        mask = mask.ne(0) if mask.is_floating_point() else mask
        self.on = (mask.to(dtype) if out is None else out[0].copy_(mask)).ne_(0)
        self.count = self.on.sum(dtype=dtype).to(torch.float64)  # (a float64 sum of ints is slower)
        self.divisor = self.count.clamp(min=1.0)
        self.off = torch.bitwise_xor(self.on, 1, out=None if out is None else out[1])


_SCRATCH_LIMIT = 32 * 2**20
"""Bytes of scratch memory a thread keeps between calls on CPU (see :func:`_scratch`)."""

_STACK_BYTES = 4 * 2**20
"""Token tensors whose data take at most this many bytes in all are summarized together (on this
2-core machine together is faster up to 1 MiB per tensor, one at a time from 2 MiB)."""

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


def _summarize_tokens(buf: Any, mask: _TokenMask, dtype: Any) -> tuple[Any, Any, Any, Any]:
    """Sum, m2 (float64), min and max (``dtype``) of ``K`` float tensors of ``dtype`` held as integer
    bits in ``buf`` ``(K, *mask.shape)``, 0 on padding: four ``(K,)`` tensors. ``buf`` is overwritten.

    All ``K`` go through each step together (fewer, larger kernels). Sums run per row in the data's
    precision and across rows in float64 (a row's sum is within ``(width - 1) * eps / 2 * sum|x|``
    of the exact one, in any order of summation: eager and compiled, on any CPU). Padding is replaced
    with its tensor's mean before min/max and centering, so it changes neither, and no shape depends
    on the data (no sync).
    """
    f64 = torch.float64
    k = buf.shape[0]
    vals = buf.view(dtype)
    sums = vals.sum(-1).sum(1, dtype=f64)
    means = (sums / mask.divisor).to(dtype)
    buf.addcmul_(mask.off, means.view(buf.dtype)[:, None, None])  # padding := mean, in place
    flat = vals.view(k, -1)
    if k == 1:  # one pass for both (torch.aminmax over a dim is many times slower on CPU)
        mins, maxs = (v[None] for v in torch.aminmax(flat[0]))
    else:
        mins, maxs = flat.amin(1), flat.amax(1)
    vals.sub_(means[:, None, None])
    return sums, vals.mul_(vals).sum(-1).sum(1, dtype=f64), mins, maxs


def _token_block(
    xs: tuple[Any, ...], residual: tuple[int, int] | None, mask: Any, scratch: Any = None, group: int = 1
) -> Any:
    """``(5, K)`` float64 count, sum, m2, min, max of the response tokens of each of ``xs`` (float
    tensors of one dtype, of the mask's shape) and, with ``residual=(i, j)``, of ``xs[i] - xs[j]``.

    The tensors go through :func:`_summarize_tokens` ``group`` at a time. ``scratch`` is integer
    memory of shape ``(2 + group, *mask.shape)`` for the masks and the data; None: fresh tensors (under
    ``torch.compile``, which fuses them away).
    """
    f64, dtype = torch.float64, xs[0].dtype
    itype = torch.int64 if dtype == f64 else torch.int32
    k = len(xs) + (residual is not None)
    token_mask = _TokenMask(mask, itype, out=None if scratch is None else scratch[:2])
    parts = []
    for start in range(0, k, group):
        bufs = []
        for i in range(start, min(start + group, k)):
            out = None if scratch is None else scratch[2 + i - start]
            if i < len(xs):
                x = xs[i]
            else:  # the residual, into its slot
                x = torch.sub(xs[residual[0]], xs[residual[1]], out=None if out is None else out.view(dtype))
            # x on the response, 0 (all bits) elsewhere
            bufs.append(torch.mul(x.view(itype), token_mask.on, out=out))
        stacked = scratch[2 : 2 + len(bufs)] if scratch is not None else torch.stack(bufs)
        parts.append(_summarize_tokens(stacked, token_mask, dtype))
    sums, m2s, mins, maxs = (torch.cat(column) for column in zip(*parts))
    has = token_mask.count > 0
    mins, maxs = torch.where(has, mins.to(f64), math.inf), torch.where(has, maxs.to(f64), -math.inf)
    return torch.stack([token_mask.count.expand(k), sums, m2s, mins, maxs])


_compiled: dict[str, Any] = {}  # "fn": _token_block under torch.compile; "failed": compiling failed
_compile_lock = threading.Lock()


def _compiled_token_block(xs: tuple[Any, ...], residual: tuple[int, int] | None, mask: Any) -> Any:
    """:func:`_token_block` under ``torch.compile`` (shapes dynamic, so batch sizes and widths do not
    recompile), or None where compiling fails: a warning then, and eager summaries from then on.
    Calls run one at a time (dynamo's compiling is not thread-safe: ranks as threads of one process
    would race on the first compile)."""
    with _compile_lock:
        if _compiled.get("failed"):
            return None
        try:
            if "fn" not in _compiled:
                _compiled["fn"] = torch.compile(_token_block, dynamic=True)
            return _compiled["fn"](xs, residual, mask)
        except Exception as exc:  # no C++ compiler, a device torch.compile does not support, ...
            _compiled["failed"] = True
            warnings.warn(
                f"torch_compile=True: compiling the token summaries failed ({type(exc).__name__}: {exc}); "
                "they are computed eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return None


def _triple(prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}/{r}" for r in _MMM)


def _add_metrics(t: _Tensors, plan: _Plan, torch_compile: bool) -> None:
    """Queue what the metrics need of every key the batch has; the rest happens on the host."""
    _add_sums(t, plan)
    if t.response_mask is not None:
        plan.sequences["response_mask"] = t.response_mask.sum(-1)
        _add_token_metrics(t, plan, t.response_mask, torch_compile)
    if t.prompt_mask is not None:
        plan.sequences["prompt_mask"] = t.prompt_mask.sum(-1)
    _add_counts(t, plan)


def _add_sums(t: _Tensors, plan: _Plan) -> None:
    """Sequence scores and rewards: sums over the whole row (siiRL's and verl's)."""
    for key, _ in _SEQUENCE_METRICS[:2]:
        x = t.get(key)
        if x is not None:
            if x.dim() == 0:
                raise key_error(key, "must have one value (or row) per sequence, got a scalar")
            t.check_size(key, x)
            plan.sequences[key] = _float(x).sum(-1) if x.dim() >= 2 else x


def _add_counts(t: _Tensors, plan: _Plan) -> None:
    """Turns and tool calls per sequence (any number of values: names never depend on it)."""
    for key, _ in _SEQUENCE_METRICS[4:]:
        x = t.get(key)
        if x is not None:
            plan.sequences[key] = x


def _add_token_metrics(
    t: _Tensors,
    plan: _Plan,
    mask: Any,
    torch_compile: bool,
    keys: Sequence[str] = ("advantages", "returns", "values"),
) -> None:
    """Advantages, returns, values (those of ``keys``) and the explained-variance ingredients over
    response tokens."""
    found = {}
    for key, _ in _TOKEN_METRICS:
        x = t.get(key) if key in keys else None
        if x is not None:
            if tuple(x.shape) != tuple(mask.shape):
                raise key_error(key, f"shape {tuple(x.shape)}, the response mask's is {tuple(mask.shape)}")
            found[key] = _float(x)
    if not found:
        return
    vf = "returns" in found and "values" in found
    plan.token_names = [
        _triple(prefix) + ((VF_RETURNS_STD,) if vf and key == "returns" else ())
        for key, prefix in _TOKEN_METRICS
        if key in found
    ] + ([(VF_RESIDUAL_STD,)] if vf else [])
    f64 = torch.float64
    k = len(plan.token_names)
    if mask.numel() == 0:
        empty = torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=f64)  # on the host: no copy
        plan.token_block = empty[:, None].expand(5, k)
        return
    dtype = f64 if any(x.dtype == f64 for x in found.values()) else torch.float32
    keys = list(found)
    xs = tuple(x.to(dtype) for x in found.values())
    residual = (keys.index("returns"), keys.index("values")) if vf else None
    plan.token_inputs = (keys, xs, residual, mask)
    if torch_compile:
        plan.token_block = _compiled_token_block(xs, residual, mask)
        if plan.token_block is not None:
            return
    # small batches go through the summaries together (fewer kernels), large ones one tensor at a
    # time (a smaller working set stays in cache)
    group = k if k * mask.numel() * dtype.itemsize <= _STACK_BYTES else 1
    scratch = _scratch((2 + group, *mask.shape), torch.int64 if dtype == f64 else torch.int32, mask.device)
    plan.token_block = _token_block(xs, residual, mask, scratch, group)


__all__ = [
    "CORRECT_THRESHOLD",
    "compute_data_metric",
    "compute_data_stats",
    "compute_variance_proxy_stats",
    "column_values",
    "compute_verl_data_stats",
    "data_metrics_from_stats",
    "verl_data_arrays",
    "verl_lengths",
]
