"""Built-in metric functions computed from a batch, and metrics derived after merging.

Holds :data:`DERIVED_METRICS`, their ``_aux/`` ingredients' names and the families' state kinds, plugged
into the engine on import; torch submodules load on first use (``from rlmetrics.metrics import ...``).
Rules: docs/reductions.md, "Derived metrics: ratios are computed from merged sums".

>>> merged = {"critic/vf_explained_var": 0.7, "critic/score/mean": 1.0,
...           VF_RETURNS_STD: 2.0, VF_RESIDUAL_STD: 1.0, VF_TOKENS: 101.0}
>>> derived = derive_metrics(merged)
>>> sorted(derived), round(derived["critic/vf_explained_var"], 4)
(['critic/score/mean', 'critic/vf_explained_var'], 0.75)
>>> seconds, tokens = timing_aux("gen")
>>> derive_metrics({"timing_per_token_ms/gen": 40.0, seconds: 2.0, tokens: 400.0})  # 2 s / 400 tokens
{'timing_per_token_ms/gen': 5.0}
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from rlmetrics.core.states import register_state
from rlmetrics.engine.derived import AUX_PREFIX, DERIVED, Derived, derive, is_aux, without_reserved

VF_EPS = 1e-5
"""Added to Var(returns) in the explained variance, as siiRL does."""
VF_RETURNS_STD = AUX_PREFIX + "vf_explained_var/returns/std"
"""Pooled (population) std of the returns over response tokens."""
VF_RESIDUAL_STD = AUX_PREFIX + "vf_explained_var/residual/std"
"""Pooled (population) std of ``returns - values`` over response tokens."""
VF_TOKENS = AUX_PREFIX + "vf_explained_var/tokens/sum"
"""Number of response tokens (summed over ranks)."""


def vf_explained_var(values: Mapping[str, float]) -> float | None:
    """The explained variance from the merged ingredients; None without them or below 2 tokens."""
    n, ret, res = values.get(VF_TOKENS), values.get(VF_RETURNS_STD), values.get(VF_RESIDUAL_STD)
    if n is None or ret is None or res is None or not n >= 2:
        return None
    unbiased = n / (n - 1)
    return 1.0 - res * res * unbiased / (ret * ret * unbiased + VF_EPS)


TIMED_STAGES = ("gen", "ref", "values", "adv", "update_critic", "update_actor")
"""Stages with a ``timing_per_token_ms/{stage}`` (``gen`` per response token, the others per token)."""


def timing_aux(stage: str) -> tuple[str, str]:
    """The auxiliary names of ``timing_per_token_ms/{stage}``: seconds (mean) and tokens (sum).

    >>> timing_aux("gen")
    ('_aux/timing_per_token_ms/gen/seconds/mean', '_aux/timing_per_token_ms/gen/tokens/sum')
    """
    return (
        f"{AUX_PREFIX}timing_per_token_ms/{stage}/seconds/mean",
        f"{AUX_PREFIX}timing_per_token_ms/{stage}/tokens/sum",
    )


def _per_token_ms(stage: str) -> Callable[[Mapping[str, float]], float | None]:
    seconds_name, tokens_name = timing_aux(stage)

    def per_token_ms(values: Mapping[str, float]) -> float | None:
        """``1000 * seconds / tokens``; None when no rank had tokens."""
        seconds, tokens = values.get(seconds_name), values.get(tokens_name)
        if seconds is None or tokens is None or not tokens > 0:
            return None
        return seconds * 1000.0 / tokens

    return per_token_ms


THROUGHPUT_TOKENS = AUX_PREFIX + "perf/throughput/tokens/sum"
"""Tokens behind ``perf/throughput`` (summed over ranks)."""
THROUGHPUT_SECONDS = AUX_PREFIX + "perf/throughput/seconds/mean"
"""Step time behind ``perf/throughput`` (averaged over ranks)."""
THROUGHPUT_GPUS = AUX_PREFIX + "perf/throughput/gpus/sum"
"""GPUs behind ``perf/throughput``, each rank's own (siiRL's ``n_gpu``; summed over ranks)."""
THROUGHPUT_GPU_SECONDS = AUX_PREFIX + "perf/throughput/gpu_seconds/mean"
"""Step seconds times all GPUs of the step (verl's ``n_gpus``; averaged over ranks)."""


def throughput(values: Mapping[str, float]) -> float | None:
    """Tokens per second per GPU: ``tokens / gpu_seconds``, else ``tokens / (seconds * gpus)``."""
    tokens = values.get(THROUGHPUT_TOKENS)
    gpu_seconds = values.get(THROUGHPUT_GPU_SECONDS)
    if gpu_seconds is None:
        seconds, gpus = values.get(THROUGHPUT_SECONDS), values.get(THROUGHPUT_GPUS)
        gpu_seconds = None if seconds is None or gpus is None else seconds * gpus
    if tokens is None or gpu_seconds is None or not gpu_seconds > 0:
        return None
    return tokens / gpu_seconds


MFU_STAGES = ("actor", "critic", "actor_infer", "ref")
"""Stages with a ``perf/mfu/{stage}`` (verl's three, and ``ref``)."""


def mfu_aux(stage: str) -> tuple[str, str, str]:
    """The auxiliary names of ``perf/mfu/{stage}``: FLOPs (sum), seconds (mean), ``n_gpu * peak`` (sum).

    >>> mfu_aux("actor")
    ('_aux/perf/mfu/actor/flops/sum', '_aux/perf/mfu/actor/seconds/mean', '_aux/perf/mfu/actor/peak/sum')
    """
    head = f"{AUX_PREFIX}perf/mfu/{stage}/"
    return head + "flops/sum", head + "seconds/mean", head + "peak/sum"


def _mfu(stage: str) -> Callable[[Mapping[str, float]], float | None]:
    flops_name, seconds_name, peak_name = mfu_aux(stage)

    def mfu(values: Mapping[str, float]) -> float | None:
        """``flops / (seconds * peak)``; None when the time or the peak is zero."""
        flops, seconds, peak = values.get(flops_name), values.get(seconds_name), values.get(peak_name)
        if flops is None or seconds is None or peak is None or not seconds * peak > 0:
            return None
        return flops / (seconds * peak)

    return mfu


VP_SEQUENCES = AUX_PREFIX + "variance_proxy/sequences/sum"
"""Number of sequences behind the variance proxies (summed over ranks)."""


def variance_proxy_noise(values: Mapping[str, float]) -> float | None:
    """verl's ``variance_proxy/proxy3_pure_noise`` (0.0 for ``N <= 1``); None without the sequence count."""
    n = values.get(VP_SEQUENCES)
    signal = values.get("variance_proxy/proxy1_signal_strength")
    power = values.get("variance_proxy/proxy2_total_power")
    if n is None or signal is None or power is None:
        return None
    return max(0.0, (power - signal) / (n - 1)) if n > 1 else 0.0  # max(0.0, nan) is 0.0, as verl's


DERIVED_METRICS: tuple[Derived, ...] = (
    Derived("critic/vf_explained_var", (VF_RETURNS_STD, VF_RESIDUAL_STD, VF_TOKENS), vf_explained_var),
    Derived(
        "perf/throughput",
        (THROUGHPUT_TOKENS, THROUGHPUT_SECONDS, THROUGHPUT_GPUS, THROUGHPUT_GPU_SECONDS),
        throughput,
    ),
    Derived("variance_proxy/proxy3_pure_noise", (VP_SEQUENCES,), variance_proxy_noise),
    *(Derived(f"timing_per_token_ms/{s}", timing_aux(s), _per_token_ms(s)) for s in TIMED_STAGES),
    *(Derived(f"perf/mfu/{s}", mfu_aux(s), _mfu(s)) for s in MFU_STAGES),
)
"""The built-in derived metrics (:class:`~rlmetrics.engine.derived.Derived` rows)."""
DERIVED.extend(DERIVED_METRICS)

AUX_INGREDIENTS = frozenset(name for item in DERIVED_METRICS for name in item.ingredients)
"""The only names under :data:`AUX_PREFIX` a client takes (also in a group)."""

VALIDATION_SAMPLES = AUX_PREFIX + "validation/samples/total"
"""The column of :class:`~rlmetrics.metrics.validation.samples.Samples` (value: samples held)."""
PROMPT_STATS = AUX_PREFIX + "difficulty/prompts/total"
"""The column of :class:`~rlmetrics.metrics.difficulty.PromptStats` (value: prompts held)."""
STAGE_TIMES = AUX_PREFIX + "perf/straggler/ranks/total"
"""The column of :class:`~rlmetrics.metrics.stragglers.StageTimes` (value: ranks' times held)."""
register_state("samples", "rlmetrics.metrics.validation.samples:Samples", column=VALIDATION_SAMPLES)
register_state("prompts", "rlmetrics.metrics.difficulty:PromptStats", column=PROMPT_STATS)
register_state("stage_times", "rlmetrics.metrics.stragglers:StageTimes", column=STAGE_TIMES)


def derive_metrics(values: Mapping[str, float]) -> dict[str, float]:
    """A merged result as reported: derived metrics computed (per group too), ``_aux/`` names dropped.

    >>> a = "group/src/a/"
    >>> derived = derive_metrics({a + VF_TOKENS: 11.0, a + VF_RETURNS_STD: 1.0, a + VF_RESIDUAL_STD: 0.5})
    >>> list(derived), round(derived[a + "critic/vf_explained_var"], 4)
    (['group/src/a/critic/vf_explained_var'], 0.75)
    """
    return derive(values, DERIVED)


_LAZY = {
    "compute_data_metric": "data",
    "compute_data_stats": "data",
    "data_metrics_from_stats": "data",
    "compute_timing_metrics": "timing",
    "compute_throughout_metrics": "timing",
    "compute_throughput_metrics": "timing",
    "compute_mfu_metrics": "mfu",
    "compute_memory_metrics": "memory",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rlmetrics.metrics' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlmetrics.metrics.{module}"), name)


__all__ = [
    "AUX_INGREDIENTS", "AUX_PREFIX", "DERIVED_METRICS", "MFU_STAGES", "PROMPT_STATS", "STAGE_TIMES",
    "THROUGHPUT_GPUS", "THROUGHPUT_GPU_SECONDS", "THROUGHPUT_SECONDS", "THROUGHPUT_TOKENS", "TIMED_STAGES",
    "VALIDATION_SAMPLES", "VF_EPS", "VF_RESIDUAL_STD", "VF_RETURNS_STD", "VF_TOKENS", "VP_SEQUENCES",
    "derive_metrics", "is_aux", "mfu_aux", "throughput", "timing_aux", "variance_proxy_noise",
    "vf_explained_var", "without_reserved",
    *sorted(_LAZY),
]  # fmt: skip
