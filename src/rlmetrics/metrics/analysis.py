"""The seed's example metrics ("Custom Metrics Implementation"), vectorised and exact under merging.

Every example function of the seed keeps its name, its metric names and its per-rank numbers, without
a Python loop over the batch or the sequence: per-row statistics come from masks and cumsums, distinct
tokens and bigrams from one sort of packed keys, policy entropy from row chunks of bounded size.

Each family has two views of **one** computation:

* ``compute_*(data) -> dict[str, float]`` -- the seed's function: the numbers one rank reports.
* ``compute_*_stats(data) -> dict[str, Stat]`` -- what a rank submits: one
  :class:`~rlmetrics.stat.Stat` per name (names of one statistic share the same Stat), so the
  aggregator reports the statistic of all ranks' data together. Per-sequence metrics carry the
  per-sequence values, token metrics the token values (summarized on the device), ratios their
  numerator and denominator.

All device tensors a call needs go to the host in **one** copy, and on an accelerator nothing is read
earlier (no ``.item()``, no data-dependent shape), so the device is never synchronized mid-way.

**std.** The dict view returns torch's ``.std()`` as the seed does (unbiased, ``n - 1``; NaN for a
single value). The Stat view, merged and reduced by ``STD``, gives the *population* std (``n``) of the
values of all ranks -- the pooled std rlmetrics reports for every ``.../std`` name.

**Medians and percentiles.** The dict view is exact (``torch.median``: the lower middle value,
``torch.quantile``: linear). The Stat view carries a quantile sketch: exact while the merged values are
at most 4096 unit-weight values, within 0.5 % relative error beyond.

**Policy entropy.** ``-sum(p * log(p + 1e-8))`` with ``p = softmax(logits)``, the seed's definition, not
``logsumexp``-based ``-sum(p * log p)``: the ``1e-8`` adds up to ``V * 1e-8`` nats (1.5e-3 at a
150k vocabulary with near-uniform ``p``), far from a tight match. It is computed in row chunks of at
most ``chunk_elements`` logits (by default 256 Ki on the CPU, 16 Mi on an accelerator), so the
temporaries stay near ``3 * chunk_elements`` floats whatever the batch. Per row the arithmetic is the
seed's, bit for bit, in float32 for float16/bfloat16 logits (the seed would stay in the low
precision) and in the logits' dtype otherwise. The mean weights positions by ``response_mask``; on
the CPU, where a data-dependent shape costs no synchronization, positions with mask 0 are not
computed at all (a NaN there does not reach the result, as it would through the seed's
``entropy * mask``).

**Token transitions.** Transitions are bigrams of consecutive *unmasked* response tokens of one
sequence (masked positions are skipped, as the seed's ``responses[i][mask[i].bool()]``).
``analysis/unique_transitions/total`` is the number of distinct transitions on a rank; merged, it is
the **sum of the per-rank counts** -- an upper bound on the distinct transitions of all ranks together
(exact when no transition occurs on two ranks; exact merging would need the key sets themselves).
``analysis/total_transitions/total`` merges exactly. ``analysis/transition_diversity/mean`` is the
rank's ``unique / max(total, 1)`` with weight ``max(total, 1)``, so the merged value is
``sum(unique) / sum(max(total, 1))`` -- consistent with the two totals.

**Reward distribution** (``analyze_reward_distribution``; the seed names the function but not its
metrics). A sequence's reward is the sum of its ``token_level_rewards`` over the sequence (as
``critic/rewards``: rewards outside the response are zero).

* ``analysis/reward_distribution/mean|std|median|min|max|p25|p75`` -- of the sequence rewards;
* ``analysis/reward_positive_ratio/mean``, ``analysis/reward_negative_ratio/mean``,
  ``analysis/reward_zero_ratio/mean`` -- share of sequences with reward > 0, < 0, == 0;
* ``analysis/reward_nonzero_token_ratio/mean`` -- share of response tokens (``response_mask`` when
  present, else all) with a non-zero token reward: ~1/length for outcome rewards, ~1 for dense ones.

Other deviations from the seed's code: ``model/prompt_attention_ratio/mean`` splits the *last*
(key) dimension of the attention weights at ``keys - response_length`` (the seed's ``[:, :, :-R]``
is that for 3-D weights, but slices queries for ``(batch, heads, query, key)`` weights, and gives 0
for ``R == 0``) and adds float32 row sums in float64 (the seed sums all in float32); hidden-state norms of float16/bfloat16 states are taken in float32; an empty batch
gives NaN where the seed would raise. Token ids must fit in 32 bits (bigram keys pack two ids in one
int64); larger ids raise ``ValueError``.

>>> import torch
>>> data = {"responses": torch.tensor([[5, 6, 5, 6, 0], [7, 7, 7, 0, 0]]),
...         "response_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])}
>>> analyze_token_transitions(data)
{'analysis/transition_diversity/mean': 0.6, 'analysis/unique_transitions/total': 3.0, 'analysis/total_transitions/total': 5.0}
>>> compute_token_transition_stats(data)["analysis/unique_transitions/total"].sum
3.0
"""  # noqa: E501

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from rlmetrics.extras import require
from rlmetrics.metrics.batch import as_batch
from rlmetrics.reduce import resolve
from rlmetrics.sketch import Sketch
from rlmetrics.stat import NAN_STRATEGIES, MetricValueError, Stat, to_host

torch = require("torch", "torch")

__all__ = [
    "ATTENTION_ENTROPY_EPS", "CPU_CHUNK_ELEMENTS", "DEVICE_CHUNK_ELEMENTS", "POLICY_ENTROPY_EPS",
    "TARGET_LENGTH",
    "analyze_reward_distribution", "analyze_token_transitions", "attention_entropy",
    "compute_advanced_metrics", "compute_advanced_stats", "compute_conversation_quality_metrics",
    "compute_conversation_quality_stats", "compute_custom_data_metrics", "compute_custom_data_stats",
    "compute_custom_training_metrics", "compute_custom_training_stats", "compute_example_metrics",
    "compute_example_stats", "compute_length_appropriateness", "compute_model_performance_metrics",
    "compute_model_performance_stats", "compute_repetition_score", "compute_response_quality_score",
    "compute_reward_distribution_stats", "compute_sequence_coherence", "compute_token_transition_stats",
    "conversation_quality_scores", "policy_entropy",
]  # fmt: skip

POLICY_ENTROPY_EPS = 1e-8
ATTENTION_ENTROPY_EPS = 1e-9
CPU_CHUNK_ELEMENTS = 1 << 18
"""Entropy chunk on the CPU (``chunk_elements=None``): temporaries of 1 MiB (float32) stay in cache,
faster than one pass over the whole tensor; a chunk holds at least one row (600 KiB at 150k vocab)."""
DEVICE_CHUNK_ELEMENTS = 1 << 24
"""Entropy chunk on an accelerator (``chunk_elements=None``): few kernel launches, 64 MiB temporaries."""
TARGET_LENGTH = 50
"""The seed's ``compute_length_appropriateness`` target length."""

TOKEN_ACCURACY = ("custom/token_accuracy/mean",)
RESPONSE_QUALITY = (
    "custom/response_quality/mean",
    "custom/response_quality/max",
    "custom/response_quality/min",
)
POLICY_ENTROPY = ("training/policy_entropy/mean",)
GRAD_NORM = ("training/grad_norm/mean",)
LOSS = ("training/loss/mean", "training/loss/std")
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
ATTENTION_ENTROPY = ("model/attention_entropy/mean",)
PROMPT_ATTENTION_RATIO = ("model/prompt_attention_ratio/mean",)
HIDDEN_NORM = ("model/hidden_norm/mean", "model/hidden_norm/std")
CONVERSATION_QUALITY = tuple(f"conversation/quality/{s}" for s in ("mean", "std", "min", "max"))

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_NARROW_INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32)


# ------------------------------------------------------------------------------------------ plumbing
@dataclass(frozen=True)
class _Out:
    """One statistic on the host: the names it answers, its Stat and, if unweighted, its values."""

    names: tuple[str, ...]
    stat: Stat
    values: np.ndarray | None = None  # the observations (unit weights): exact quantiles in the dict view


def _obs(names: tuple[str, ...], values: np.ndarray) -> _Out:
    sketch = any(resolve(n).needs_sketch for n in names)
    return _Out(names, Stat.of(values, sketch=sketch, name=names[0]), values)


def _ratio(names: tuple[str, ...], num: float, den: float) -> _Out:
    """``num / den`` as one observation of weight ``den``: merged, sum(num) / sum(den) over ranks."""
    if den == 0:
        return _Out(names, Stat())
    r = num / den
    return _Out(names, Stat(den, num, 0.0, r, r))


def _summary(x: torch.Tensor, weight: torch.Tensor | None = None, drop: bool = False) -> torch.Tensor:
    """``[count, sum, m2, min, max]`` (float64, on x's device) of ``x`` weighted by ``weight``.

    The arithmetic of :meth:`Stat.of` (masked values drop out, NaN elsewhere propagates; with
    ``drop`` non-finite values drop out too) in fewer passes: the token metrics summarize up to
    millions of values per call.
    """
    x = x.detach()
    w = None if weight is None else weight.detach().to(torch.float64).broadcast_to(x.shape).reshape(-1)
    x = x.to(torch.float64).reshape(-1)
    if drop:
        finite = torch.isfinite(x).to(torch.float64)
        w = finite if w is None else w * finite
    if x.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)  # host: no copy
    if w is None:
        n = torch.full((), float(x.numel()), dtype=torch.float64, device=x.device)
        s = x.sum()
        d = x - s / n
        lo, hi = torch.aminmax(x)
        return torch.stack([n, s, torch.dot(d, d), lo, hi])
    keep = w > 0
    n = w.sum()
    s = torch.dot(w, torch.where(keep, x, 0.0))
    d = torch.where(keep, x - s / torch.where(n > 0, n, 1.0), 0.0)
    lo = torch.where(keep, x, math.inf).amin()
    hi = torch.where(keep, x, -math.inf).amax()
    return torch.stack([n, s, torch.dot(w * d, d), lo, hi])


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def _get(data: Any, key: str) -> Any:
    return data[key] if key in data else None


class _Rows:
    """Response tokens of each row with the masked ones removed (order kept), padded at the end.

    The padding repeats the row's first token and the padding of the bigram keys the row's first
    key, so counting distinct values needs no mask. Shared by the metrics of one call that read the
    same ``(responses, mask)``.
    """

    def __init__(self, responses: torch.Tensor, mask: torch.Tensor | None) -> None:
        tokens = _as_tensor(responses)
        self._narrow = tokens.dtype in _NARROW_INTS
        tokens = tokens.long()
        b, r = tokens.shape
        if mask is None:
            keep = torch.ones_like(tokens, dtype=torch.bool)
        else:
            keep = (_as_tensor(mask) != 0).broadcast_to((b, r))
        self.lengths = keep.sum(1)
        kept_before = keep.cumsum(1)
        self._pos = torch.arange(r, device=tokens.device)
        # a kept token goes to (kept ones before it); a masked one behind all kept ones, in order
        dest = torch.where(keep, kept_before - 1, self.lengths[:, None] + self._pos - kept_before)
        compact = torch.empty_like(tokens).scatter_(1, dest, tokens)
        self.valid = self._pos < self.lengths[:, None]
        self.tokens = torch.where(self.valid, compact, compact[:, :1])

    @cached_property
    def distinct_tokens(self) -> torch.Tensor:
        return _count_distinct(self.tokens, self.lengths > 0)

    @cached_property
    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Bigram keys (padding: the row's first key) and the number of bigrams of each row."""
        a, b = self.tokens[:, :-1], self.tokens[:, 1:]
        keys = (a << 32) | (b & 0xFFFFFFFF)  # injective for 32-bit ids
        count = (self.lengths - 1).clamp(min=0)
        return torch.where(self._pos[:-1] < count[:, None], keys, keys[:, :1]), count

    @cached_property
    def _distinct_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct bigrams of each row and of the whole batch, from one stable sort of all keys."""
        keys, count = self._pairs
        b, k = keys.shape
        if keys.numel() == 0:
            return torch.zeros(b, dtype=torch.long, device=keys.device), keys.new_zeros(())
        has = count > 0
        # rows without bigrams hold a key of a row with bigrams; within a key, the stable sort keeps
        # the rows in order, so the first entry of each (row, key) follows another row or key
        donor = has.to(torch.int32).argmax().reshape(1)
        fill = keys[:, 0].index_select(0, donor)
        sorted_keys, order = torch.where(has[:, None], keys, fill).reshape(-1).sort(stable=True)
        row = order // k
        first = torch.ones(1, dtype=torch.bool, device=keys.device)
        new_key = torch.cat([first, sorted_keys[1:] != sorted_keys[:-1]])
        new_in_row = new_key | torch.cat([first, row[1:] != row[:-1]])
        per_row = torch.zeros(b, dtype=torch.long, device=keys.device).index_add_(0, row, new_in_row.long())
        return torch.where(has, per_row, 0), torch.where(has.any(), new_key.sum(), 0)

    @property
    def distinct_pairs(self) -> torch.Tensor:
        return self._distinct_pairs[0]

    @property
    def distinct_pairs_overall(self) -> torch.Tensor:
        return self._distinct_pairs[1]

    @cached_property
    def id_overflow(self) -> torch.Tensor:
        """True when a kept token id does not fit in 32 bits (the bigram keys would collide)."""
        if self._narrow or self.tokens.numel() == 0:
            return torch.zeros((), dtype=torch.bool, device=self.tokens.device)
        lo, hi = torch.aminmax(torch.where(self.valid, self.tokens, 0))
        return (lo < _INT32_MIN) | (hi > _INT32_MAX)


def _count_distinct(keys: torch.Tensor, nonempty: torch.Tensor) -> torch.Tensor:
    """Distinct values of each row of ``keys`` (0 where not ``nonempty``): one sort, fixed shapes."""
    b, k = keys.shape
    if k == 0 or b == 0:
        return torch.zeros(b, dtype=torch.long, device=keys.device)
    s = keys.sort(1).values
    return torch.where(nonempty, (s[:, 1:] != s[:, :-1]).sum(1) + 1, 0)


class _Plan:
    """Device tensors of one call and how to read them; :meth:`run` moves them to the host at once."""

    def __init__(self, chunk_elements: int | None = None, nan_strategy: str = "propagate") -> None:
        self.chunk_elements = chunk_elements
        self.drop = nan_strategy == "drop"  # device summaries leave non-finite values out
        self._tensors: list[torch.Tensor] = []
        self._readers: list[tuple[int, Callable[..., list[_Out]]]] = []
        self._rows: dict[tuple[int, int], _Rows] = {}

    def add(self, tensors: Sequence[torch.Tensor], read: Callable[..., list[_Out]]) -> None:
        """``read(*host_arrays)`` (1-D float64, one per tensor) returns the statistics."""
        self._tensors.extend(tensors)
        self._readers.append((len(tensors), read))

    def rows(self, responses: torch.Tensor, mask: torch.Tensor | None) -> _Rows:
        key = (id(responses), id(mask))
        if key not in self._rows:
            self._rows[key] = _Rows(responses, mask)
        return self._rows[key]

    def run(self) -> list[_Out]:
        if not self._tensors:
            return []
        arrays = to_host([t.detach() for t in self._tensors])
        outs: list[_Out] = []
        i = 0
        for n, read in self._readers:
            outs.extend(read(*arrays[i : i + n]))
            i += n
        return outs


Planner = Callable[[Any, _Plan], None]


def _evaluate(
    data: Any, planners: Sequence[Planner], chunk_elements: int | None = None, nan_strategy: str = "propagate"
) -> list[_Out]:
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    data = as_batch(data, "rlmetrics.metrics.analysis")
    plan = _Plan(chunk_elements, nan_strategy)
    for planner in planners:
        planner(data, plan)
    return [_finite(out, nan_strategy) for out in plan.run()]


def _finite(out: _Out, nan_strategy: str) -> _Out:
    """``out`` under ``nan_strategy``: non-finite observations dropped (device summaries drop them
    already, ratios drop as one) or refused."""
    if nan_strategy == "propagate" or out.stat.finite:
        return out
    if nan_strategy == "error":
        raise MetricValueError(f"metric {out.names[0]!r}: non-finite value(s) (nan_strategy='error')")
    if out.values is not None:
        return _obs(out.names, out.values[np.isfinite(out.values)])
    return _Out(out.names, Stat())


def _as_stats(outs: list[_Out]) -> dict[str, Stat]:
    return {name: out.stat for out in outs for name in out.names}


def _seed_value(name: str, out: _Out) -> float:
    """The number the seed's code reports for ``name`` on this rank."""
    red = resolve(name)
    stat = out.stat
    if red.kind == "std":  # torch's .std(): unbiased
        return math.sqrt(max(stat.m2, 0.0) / (stat.count - 1)) if stat.count > 1 else math.nan
    if red.needs_sketch and out.values is not None:  # exact, however many values
        exact = Sketch.of(out.values, exact_limit=max(out.values.size, 1))
        return red.apply(Stat(*stat.to_array().tolist(), sketch=exact))
    return red.apply(stat)


def _as_floats(outs: list[_Out]) -> dict[str, float]:
    return {name: _seed_value(name, out) for out in outs for name in out.names}


# ------------------------------------------------------------------------------------------ entropy
def _chunked_entropy(
    x: torch.Tensor,
    eps: float,
    from_logits: bool,
    chunk_elements: int | None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Entropy of each row (last dim) of ``x``, or of the rows ``index`` of the flattened leading dims."""
    x = _as_tensor(x).detach()
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
    return _chunked_entropy(logits, eps, True, chunk_elements)


def attention_entropy(
    weights: torch.Tensor, *, eps: float = ATTENTION_ENTROPY_EPS, chunk_elements: int | None = None
) -> torch.Tensor:
    """Entropy ``-sum(w * log(w + eps))`` of attention weights over the last (key) dim, in row chunks.

    >>> round(attention_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]]))[0].item(), 6)
    0.693147
    """
    return _chunked_entropy(weights, eps, False, chunk_elements)


# ---------------------------------------------------------------------------- Method 1: custom data
def _plan_custom_data(data: Any, plan: _Plan) -> None:
    correct, attention_mask = _get(data, "correct_tokens"), _get(data, "attention_mask")
    if correct is not None and attention_mask is not None:
        s = _summary(_as_tensor(correct), _as_tensor(attention_mask), plan.drop)
        plan.add((s,), lambda s: [_Out(TOKEN_ACCURACY, Stat(*s.tolist()))])
    responses, response_mask = _get(data, "responses"), _get(data, "response_mask")
    if responses is not None and response_mask is not None:
        counts = plan.rows(responses, response_mask).distinct_tokens
        plan.add((counts,), lambda v: [_obs(RESPONSE_QUALITY, v)])


def compute_response_quality_score(data: Any) -> torch.Tensor:
    """Distinct response tokens per sequence (vocabulary diversity), float32 on the input's device.

    >>> compute_response_quality_score({"responses": torch.tensor([[3, 3, 4, 9]]),
    ...                                 "response_mask": torch.tensor([[1, 1, 1, 0]])})
    tensor([2.])
    """
    data = as_batch(data, "compute_response_quality_score")
    return _Rows(data["responses"], data["response_mask"]).distinct_tokens.float()


def compute_custom_data_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`compute_custom_data_metrics` (token accuracy is token-weighted).

    >>> s = compute_custom_data_stats({"correct_tokens": torch.tensor([[1, 0, 1]]),
    ...                               "attention_mask": torch.tensor([[1, 1, 0]])})
    >>> s["custom/token_accuracy/mean"].count, s["custom/token_accuracy/mean"].mean
    (2.0, 0.5)
    """
    return _as_stats(_evaluate(data, [_plan_custom_data], nan_strategy=nan_strategy))


def compute_custom_data_metrics(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """The seed's ``compute_custom_data_metrics``: token accuracy and response vocabulary diversity.

    ``custom/token_accuracy/mean`` needs ``correct_tokens`` and ``attention_mask``;
    ``custom/response_quality/mean|max|min`` (distinct tokens per response) ``responses`` and
    ``response_mask``. A missing key skips its metrics.

    >>> compute_custom_data_metrics({"responses": torch.tensor([[1, 2, 2], [4, 4, 4]]),
    ...                              "response_mask": torch.ones(2, 3)})
    {'custom/response_quality/mean': 1.5, 'custom/response_quality/max': 2.0, 'custom/response_quality/min': 1.0}
    """  # noqa: E501
    return _as_floats(_evaluate(data, [_plan_custom_data], nan_strategy=nan_strategy))


# ------------------------------------------------------------------------ Method 1: custom training
def _plan_custom_training(data: Any, plan: _Plan) -> None:
    logits = _get(data, "policy_logits")
    if logits is not None:
        logits, mask = _as_tensor(logits), _get(data, "response_mask")
        if mask is None:
            s = _summary(policy_entropy(logits, chunk_elements=plan.chunk_elements), drop=plan.drop)
        else:
            w = _as_tensor(mask).broadcast_to(logits.shape[:-1]).reshape(-1)
            if logits.device.type == "cpu":  # skip masked rows: a data-dependent shape syncs nothing here
                index = (w != 0).nonzero().squeeze(1)
                s = _summary(
                    _chunked_entropy(logits, POLICY_ENTROPY_EPS, True, plan.chunk_elements, index),
                    w[index],
                    plan.drop,
                )
            else:
                s = _summary(
                    policy_entropy(logits, chunk_elements=plan.chunk_elements).reshape(-1), w, plan.drop
                )
        plan.add((s,), lambda s: [_Out(POLICY_ENTROPY, Stat(*s.tolist()))])
    grad_norm = _get(data, "grad_norm")
    if grad_norm is not None:
        plan.add((_as_tensor(grad_norm),), lambda v: [_obs(GRAD_NORM, v)])
    loss = _get(data, "loss_values")
    if loss is not None:
        plan.add((_as_tensor(loss),), lambda v: [_obs(LOSS, v)])


def compute_custom_training_stats(
    data: Any, *, chunk_elements: int | None = None, nan_strategy: str = "propagate"
) -> dict[str, Stat]:
    """Stats to submit for :func:`compute_custom_training_metrics` (entropy weighted by response tokens).

    >>> compute_custom_training_stats({"loss_values": torch.tensor([1.0, 3.0])})["training/loss/std"].std
    1.0
    """
    return _as_stats(_evaluate(data, [_plan_custom_training], chunk_elements, nan_strategy=nan_strategy))


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
    return _as_floats(_evaluate(data, [_plan_custom_training], chunk_elements, nan_strategy=nan_strategy))


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
    responses = _as_tensor(data["responses"])
    r = responses.shape[-1]
    lengths = _as_tensor(data["attention_mask"]).sum(-1).long().clamp(max=r)
    keep = torch.arange(r, device=responses.device) < lengths[:, None]
    x = responses.to(torch.float64)
    n = lengths.to(torch.float64)
    mean = torch.where(keep, x, 0.0).sum(1) / n.clamp(min=1.0)
    dev = torch.where(keep, x - mean[:, None], 0.0)
    var = (dev * dev).sum(1) / (n - 1.0).clamp(min=1.0)
    return torch.where(lengths > 1, 1.0 / (1.0 + var), 1.0)


def _plan_coherence(data: Any, plan: _Plan) -> None:
    if "responses" in data and "attention_mask" in data:
        plan.add((compute_sequence_coherence(data),), lambda v: [_obs(COHERENCE, v)])


def _check_ids(overflow: np.ndarray) -> None:
    if overflow[0]:
        raise ValueError("token ids must fit in 32 bits (-2**31 .. 2**31 - 1) for bigram metrics")


def _plan_transitions(data: Any, plan: _Plan) -> None:
    responses = _get(data, "responses")
    if responses is None:
        return
    rows = plan.rows(responses, _get(data, "response_mask"))
    total = (rows.lengths - 1).clamp(min=0).sum()

    def read(unique: np.ndarray, total: np.ndarray, overflow: np.ndarray) -> list[_Out]:
        _check_ids(overflow)
        diversity = _ratio(TRANSITION_DIVERSITY, float(unique[0]), max(float(total[0]), 1.0))
        return [diversity, _obs(UNIQUE_TRANSITIONS, unique), _obs(TOTAL_TRANSITIONS, total)]

    plan.add((rows.distinct_pairs_overall, total, rows.id_overflow), read)


def _plan_rewards(data: Any, plan: _Plan) -> None:
    rewards = _get(data, "token_level_rewards")
    if rewards is None:
        return
    rewards = _as_tensor(rewards)
    per_seq = rewards.reshape(rewards.shape[0], math.prod(rewards.shape[1:])).to(torch.float64).sum(-1)
    mask = _get(data, "response_mask")
    keep = torch.ones_like(rewards, dtype=torch.bool) if mask is None else (_as_tensor(mask) != 0)
    nonzero, tokens = ((rewards != 0) & keep).sum(), keep.broadcast_to(rewards.shape).sum()

    def read(r: np.ndarray, nonzero: np.ndarray, tokens: np.ndarray) -> list[_Out]:
        return [
            _obs(REWARD_DISTRIBUTION, r),
            _obs(REWARD_POSITIVE, (r > 0).astype(np.float64)),
            _obs(REWARD_NEGATIVE, (r < 0).astype(np.float64)),
            _obs(REWARD_ZERO, (r == 0).astype(np.float64)),
            _ratio(REWARD_NONZERO_TOKENS, float(nonzero[0]), float(tokens[0])),
        ]

    plan.add((per_seq, nonzero, tokens), read)


_ADVANCED = (_plan_coherence, _plan_transitions, _plan_rewards)


def compute_token_transition_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`analyze_token_transitions` (see the module docs for their merge).

    >>> compute_token_transition_stats({"responses": torch.tensor([[1, 2, 1, 2]])})["analysis/total_transitions/total"].sum
    3.0
    """  # noqa: E501
    return _as_stats(_evaluate(data, [_plan_transitions], nan_strategy=nan_strategy))


def analyze_token_transitions(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """The seed's transition analysis: distinct and total bigrams of unmasked response tokens.

    ``analysis/transition_diversity/mean`` = distinct / max(total, 1) over the whole batch.

    >>> analyze_token_transitions({"responses": torch.tensor([[1, 2, 1, 2]])})["analysis/transition_diversity/mean"]
    0.6666666666666666
    """  # noqa: E501
    return _as_floats(_evaluate(data, [_plan_transitions], nan_strategy=nan_strategy))


def compute_reward_distribution_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`analyze_reward_distribution` (sketches for the quantile names).

    >>> rewards = torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    >>> s = compute_reward_distribution_stats({"token_level_rewards": rewards})
    >>> s["analysis/reward_distribution/median"].sketch.median()
    -1.0
    """
    return _as_stats(_evaluate(data, [_plan_rewards], nan_strategy=nan_strategy))


def analyze_reward_distribution(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """Distribution of sequence rewards (sum of ``token_level_rewards``); names in the module docs.

    >>> m = analyze_reward_distribution({"token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
    ...                                  "response_mask": torch.tensor([[1, 1], [1, 0]])})
    >>> m["analysis/reward_distribution/mean"], m["analysis/reward_positive_ratio/mean"]
    (0.5, 0.5)
    >>> round(m["analysis/reward_nonzero_token_ratio/mean"], 4)  # 1 of 3 response tokens
    0.3333
    """
    return _as_floats(_evaluate(data, [_plan_rewards], nan_strategy=nan_strategy))


def compute_advanced_stats(data: Any, *, nan_strategy: str = "propagate") -> dict[str, Stat]:
    """Stats to submit for :func:`compute_advanced_metrics`.

    >>> s = compute_advanced_stats({"responses": torch.tensor([[1, 3]]), "attention_mask": torch.ones(1, 2)})
    >>> s["analysis/coherence/median"] is s["analysis/coherence/mean"]
    True
    """
    return _as_stats(_evaluate(data, _ADVANCED, nan_strategy=nan_strategy))


def compute_advanced_metrics(data: Any, *, nan_strategy: str = "propagate") -> dict[str, float]:
    """The seed's ``compute_advanced_metrics``: coherence, token transitions, reward distribution.

    ``analysis/coherence/mean|std|median`` of :func:`compute_sequence_coherence` (std unbiased, median
    the lower middle value), plus :func:`analyze_token_transitions` and
    :func:`analyze_reward_distribution`.

    >>> m = compute_advanced_metrics({"responses": torch.tensor([[1, 3], [2, 2]]), "attention_mask": torch.ones(2, 2)})
    >>> m["analysis/coherence/mean"], m["analysis/coherence/median"], m["analysis/unique_transitions/total"]
    (0.6666666666666666, 0.3333333333333333, 2.0)
    """  # noqa: E501
    return _as_floats(_evaluate(data, _ADVANCED, nan_strategy=nan_strategy))


# ------------------------------------------------------------------------ Example 1: model outputs
def _plan_model(data: Any, model_outputs: Mapping[str, Any] | None, plan: _Plan) -> None:
    model_outputs = model_outputs or {}
    weights = model_outputs.get("attention_weights")
    if weights is not None:
        weights = _as_tensor(weights)
        entropy = attention_entropy(weights, chunk_elements=plan.chunk_elements)
        plan.add((_summary(entropy, drop=plan.drop),), lambda s: [_Out(ATTENTION_ENTROPY, Stat(*s.tolist()))])
        if "attention_mask" in data and "responses" in data:
            split = max(weights.shape[-1] - _as_tensor(data["responses"]).shape[-1], 0)
            dtype = torch.promote_types(weights.dtype, torch.float32)
            # rows summed in float32, rows added in float64: converting all weights to float64 costs more
            prompt = weights[..., :split].sum(-1, dtype=dtype).to(torch.float64).sum()
            total = prompt + weights[..., split:].sum(-1, dtype=dtype).to(torch.float64).sum()
            plan.add((prompt, total), lambda p, t: [_ratio(PROMPT_ATTENTION_RATIO, float(p[0]), float(t[0]))])
    hidden = model_outputs.get("hidden_states")
    if hidden is not None:
        hidden = _as_tensor(hidden)
        norms = torch.linalg.vector_norm(
            hidden, dim=-1, dtype=torch.promote_types(hidden.dtype, torch.float32)
        )
        plan.add((_summary(norms, drop=plan.drop),), lambda s: [_Out(HIDDEN_NORM, Stat(*s.tolist()))])


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
    return _as_stats(
        _evaluate(
            data, [lambda d, p: _plan_model(d, model_outputs, p)], chunk_elements, nan_strategy=nan_strategy
        )
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
    return _as_floats(
        _evaluate(
            data, [lambda d, p: _plan_model(d, model_outputs, p)], chunk_elements, nan_strategy=nan_strategy
        )
    )


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


def _repetition(rows: _Rows) -> torch.Tensor:
    n = rows.lengths.to(torch.float64)
    repeated = n - 1.0 - rows.distinct_pairs.to(torch.float64)
    return torch.where(n <= 1, 1.0, 1.0 - repeated / (n - 1.0).clamp(min=1.0))


def compute_repetition_score(tokens: torch.Tensor) -> float:
    """``1 - repeated bigrams / bigrams`` of one token sequence (1 for fewer than two tokens).

    >>> compute_repetition_score(torch.tensor([1, 2, 1, 2, 1]))  # bigrams 12 21 12 21: two repeats
    0.5
    """
    rows = _Rows(_as_tensor(tokens).reshape(1, -1), None)
    return float(_repetition(rows)[0])


def _quality(rows: _Rows, target_length: int) -> torch.Tensor:
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
    return _quality(_Rows(data["responses"], _get(data, "response_mask")), target_length)


def _plan_conversation(data: Any, plan: _Plan, target_length: int = TARGET_LENGTH) -> None:
    if "responses" not in data or "prompts" not in data:
        return
    rows = plan.rows(data["responses"], _get(data, "response_mask"))

    def read(q: np.ndarray, overflow: np.ndarray) -> list[_Out]:
        _check_ids(overflow)
        return [_obs(CONVERSATION_QUALITY, q)]

    plan.add((_quality(rows, target_length), rows.id_overflow), read)


def compute_conversation_quality_stats(
    data: Any, *, target_length: int = TARGET_LENGTH, nan_strategy: str = "propagate"
) -> dict[str, Stat]:
    """Stats to submit for :func:`compute_conversation_quality_metrics`.

    >>> data = {"responses": torch.tensor([[1, 2]]), "prompts": torch.ones(1, 1)}
    >>> compute_conversation_quality_stats(data)["conversation/quality/min"].count
    1.0
    """
    return _as_stats(
        _evaluate(data, [lambda d, p: _plan_conversation(d, p, target_length)], nan_strategy=nan_strategy)
    )


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
    return _as_floats(
        _evaluate(data, [lambda d, p: _plan_conversation(d, p, target_length)], nan_strategy=nan_strategy)
    )


# ---------------------------------------------------------------------------------- the whole pack
def _pack_planners(model_outputs: Mapping[str, Any] | None, target_length: int) -> list[Planner]:
    return [
        _plan_custom_data,
        _plan_custom_training,
        *_ADVANCED,
        lambda d, p: _plan_model(d, model_outputs, p),
        lambda d, p: _plan_conversation(d, p, target_length),
    ]


def compute_example_stats(
    data: Any,
    model_outputs: Mapping[str, Any] | None = None,
    *,
    chunk_elements: int | None = None,
    target_length: int = TARGET_LENGTH,
    nan_strategy: str = "propagate",
) -> dict[str, Stat]:
    """Stats of every example metric the inputs allow, with one device-to-host copy; submit these.

    >>> sorted(compute_example_stats({"responses": torch.tensor([[1, 2]]), "prompts": torch.ones(1, 1)}))[:2]
    ['analysis/total_transitions/total', 'analysis/transition_diversity/mean']
    """
    return _as_stats(
        _evaluate(
            data, _pack_planners(model_outputs, target_length), chunk_elements, nan_strategy=nan_strategy
        )
    )


def compute_example_metrics(
    data: Any,
    model_outputs: Mapping[str, Any] | None = None,
    *,
    chunk_elements: int | None = None,
    target_length: int = TARGET_LENGTH,
    nan_strategy: str = "propagate",
) -> dict[str, float]:
    """Every example metric of the seed the inputs allow, as this rank's numbers (one host copy).

    The union of :func:`compute_custom_data_metrics`, :func:`compute_custom_training_metrics`,
    :func:`compute_advanced_metrics`, :func:`compute_model_performance_metrics` (when
    ``model_outputs`` is given) and :func:`compute_conversation_quality_metrics`.

    >>> m = compute_example_metrics({"responses": torch.tensor([[1, 2]]), "prompts": torch.ones(1, 1)})
    >>> m["analysis/total_transitions/total"], m["conversation/quality/min"]
    (1.0, 0.712)
    """
    return _as_floats(
        _evaluate(
            data, _pack_planners(model_outputs, target_length), chunk_elements, nan_strategy=nan_strategy
        )
    )
