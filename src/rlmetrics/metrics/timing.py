"""Timing and throughput metrics of a training step (the seed's names), exact when merged over ranks.

- :func:`compute_timing_stats` / :func:`compute_timing_metrics`: ``timing_s/{stage}`` for every entry
  of ``timing_raw`` and ``timing_per_token_ms/{stage}`` for ``gen`` (per response token) and ``ref``,
  ``values``, ``adv``, ``update_critic``, ``update_actor`` (per prompt + response token of the batch).
- :func:`compute_throughput_stats` / :func:`compute_throughput_metrics` (also under the seed's spelling
  ``compute_throughout_metrics``): ``perf/total_num_tokens`` (the batch's tokens), ``perf/time_per_step``
  (``timing_raw["step"]``) and ``perf/throughput`` (tokens per second per GPU).

Merged over ranks (the ``*_stats`` functions give what a rank submits), the ratios are derived from
merged sums, so they equal the whole batch's (docs/reductions.md, "Derived metrics: ratios are
computed from merged sums"; siiRL's per-token times are about W times too high). Names depend on the
keys present, never on the values; a value that is not a number is refused naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rlmetrics.core.host import to_host
from rlmetrics.core.reduce import resolve
from rlmetrics.core.stat import MetricValueError, Stat
from rlmetrics.core.values import scalar_value
from rlmetrics.extras import require
from rlmetrics.metrics import (
    THROUGHPUT_GPUS,
    THROUGHPUT_SECONDS,
    THROUGHPUT_TOKENS,
    TIMED_STAGES,
    timing_aux,
)
from rlmetrics.metrics.batch import key_error
from rlmetrics.metrics.data import data_metrics_from_stats
from rlmetrics.metrics.tensors import BatchTensors

torch = require("torch", "torch")

RESPONSE_TOKEN_STAGES = TIMED_STAGES[:1]
"""Stages timed per response token."""
ALL_TOKEN_STAGES = TIMED_STAGES[1:]
"""Stages timed per token of the whole sequence (prompt + response)."""


def _stage_values(timing_raw: Mapping[str, Any], errors: dict[str, str] | None = None) -> dict[str, Any]:
    """The numbers of ``timing_raw``: floats, and one-element tensors not read yet (they come to
    the host with the call's other tensors). Another entry is refused (:func:`refuse`: into
    ``errors`` by name, or a MetricValueError without ``errors``) and is None: its names are sent
    with no observation, so the step does not wait for this rank's; the others are kept."""
    out, refused = {}, {}
    for stage, value in timing_raw.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[stage] = value.detach().reshape(())
            continue
        name = f"timing_s/{stage}"
        try:
            s = scalar_value(value, name)
        except MetricValueError as exc:
            refused[name], out[stage] = str(exc), None
            continue
        if s is None:
            refused[name] = (
                f"timing_raw[{stage!r}] is {_shown(value)}, not a number of seconds: this rank's {name} "
                "is left out of this step; pass a float (or a one-element tensor) per stage"
            )
        out[stage] = s
    refuse(refused, errors)
    return out


def _shown(value: Any) -> str:
    """``value`` for a message: its repr (cut at 60 characters) and its type."""
    text = repr(value)
    return f"{text[:57] + '...' if len(text) > 60 else text} ({type(value).__name__})"


def refuse(refused: Mapping[str, str], errors: dict[str, str] | None) -> None:
    """The messages ``refused`` (by metric name) go into ``errors`` (a client's call: it submits the
    other names, then raises), or raise one MetricValueError without ``errors`` (a direct call)."""
    if errors is not None:
        errors.update(refused)
    elif refused:
        raise MetricValueError("; ".join(refused.values()))


def _read(values: dict[Any, Any]) -> dict[Any, Any]:
    """``values`` with their tensors read, in one device-to-host copy
    (:func:`~rlmetrics.core.host.to_host`)."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    host = to_host([values[k] for k in keys])
    return {**values, **{k: float(h.sum()) for k, h in zip(keys, host)}}


def stage_seconds(timing_raw: Mapping[str, Any]) -> dict[str, float]:
    """The stages of ``timing_raw`` whose time is a number (a float, a numpy or one-element torch
    scalar), in seconds (tensors read in one copy); the others are skipped (the timing metrics of
    the same call refuse them).

    >>> stage_seconds({"gen": 1, "note": "slow"})
    {'gen': 1.0}
    """
    return {k: v for k, v in _read(_stage_values(timing_raw, {})).items() if v is not None}


def _token_counts(t: BatchTensors) -> dict[str, Any]:
    """``{"prompt": ..., "response": ...}`` tokens of the batch as 0-d tensors (read with the call's
    other tensors); empty if unknown."""
    if t.prompt_mask is None or t.response_mask is None:
        return {}
    return {
        "prompt": t.prompt_mask.sum(dtype=torch.float64),
        "response": t.response_mask.sum(dtype=torch.float64),
    }


def compute_timing_stats(
    batch: Any,
    timing_raw: Mapping[str, Any],
    *,
    nan_strategy: str = "propagate",
    errors: dict[str, str] | None = None,
) -> dict[str, Stat]:
    """What a rank submits for :func:`compute_timing_metrics`: the Stats of ``timing_s/*``, of each
    ``timing_per_token_ms/*`` (this rank's ratio, kept where the derivation cannot run) and of their
    auxiliary ingredients (seconds and tokens, :func:`rlmetrics.metrics.timing_aux`). Tensor timers
    and token counts come to the host in one copy. A stage whose time is not a number is refused
    (:func:`refuse`), naming the stage and the value.

    >>> import torch
    >>> batch = {"responses": torch.zeros(1, 2), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    >>> stats = compute_timing_stats(batch, {"gen": 0.5})
    >>> sorted(stats), stats["_aux/timing_per_token_ms/gen/tokens/sum"].sum
    (['_aux/timing_per_token_ms/gen/seconds/mean', '_aux/timing_per_token_ms/gen/tokens/sum', \
'timing_per_token_ms/gen', 'timing_s/gen'], 1.0)
    """
    t = BatchTensors(batch, "compute_timing_metrics")
    values = _stage_values(timing_raw, errors)
    timed = [s for s in TIMED_STAGES if s in values]
    tokens = _token_counts(t) if timed else {}
    read = _read({**{("s", k): v for k, v in values.items()}, **{("t", k): v for k, v in tokens.items()}})
    out = {}
    for stage in values:
        name = f"timing_s/{stage}"  # a stage's name may ask for quantiles (timing_s/p99): a sketch then
        seconds = read["s", stage]
        sketch = resolve(name).needs_sketch
        out[name] = (
            Stat()
            if seconds is None
            else Stat.of(seconds, sketch=sketch, nan_strategy=nan_strategy, name=name)
        )
    if not tokens:
        return out
    prompt, response = read["t", "prompt"], read["t", "response"]
    for stage in timed:
        count = response if stage in RESPONSE_TOKEN_STAGES else prompt + response
        seconds_name, tokens_name = timing_aux(stage)
        seconds = out[f"timing_s/{stage}"]
        used = seconds.count > 0  # a value dropped under nan_strategy="drop" takes its tokens along
        ratio = seconds.sum * 1000.0 / count if used and count > 0 else None
        out[f"timing_per_token_ms/{stage}"] = Stat() if ratio is None else Stat.of(ratio)
        out[seconds_name] = seconds
        out[tokens_name] = Stat.of(count) if used else Stat()
    return out


def compute_timing_metrics(
    batch: Any, timing_raw: Mapping[str, Any], *, nan_strategy: str = "propagate"
) -> dict[str, float]:
    """``timing_s/{stage}`` in seconds and ``timing_per_token_ms/{stage}`` in milliseconds per token.

    Token counts come from ``attention_mask`` and ``responses`` / ``response_mask`` as in
    :mod:`rlmetrics.metrics.data`; without them (or with zero tokens) only ``timing_s/*`` is returned.

    >>> import torch
    >>> batch = {"responses": torch.zeros(2, 2), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    >>> m = compute_timing_metrics(batch, {"gen": 0.5, "update_actor": 1.4, "step": 3.0})
    >>> m["timing_s/step"], m["timing_per_token_ms/gen"], m["timing_per_token_ms/update_actor"]
    (3.0, 166.66666666666666, 200.0)
    """
    return data_metrics_from_stats(compute_timing_stats(batch, timing_raw, nan_strategy=nan_strategy))


def _total_tokens(t: BatchTensors) -> Any:
    """This rank's tokens: the sum of ``global_token_num`` when it has one count per sequence of the
    batch, else of ``attention_mask`` (see the module docstring); a float, a 0-d tensor (read with
    the call's other tensors) or None without either."""
    value = t.batch.get("global_token_num")
    if value is not None:
        counts = _token_list(value)
        if t.size is None or counts.numel() == t.size or counts.dim() == 0:
            return counts.sum()
        if t.attention is None:
            raise key_error(
                "global_token_num",
                f"{counts.numel()} counts for {t.size} sequences: the list of another batch (verl copies "
                "the whole batch's list into every shard's meta_info), which every rank would count; "
                "give this rank's counts or an attention_mask",
            )
    if t.attention is None:
        return None
    return t.attention.sum(dtype=torch.float64)


def batch_tokens(batch: Any, what: str = "compute_throughput_metrics") -> float:
    """This rank's tokens as :func:`compute_throughput_metrics` counts them (``global_token_num`` of
    this batch, else ``attention_mask``); MetricValueError without either.

    >>> batch_tokens({"global_token_num": [100, 300]})
    400.0
    """
    tokens = _total_tokens(BatchTensors(batch, what))
    if tokens is None:
        raise key_error(
            "global_token_num", "missing, and the batch has no attention_mask to count tokens from"
        )
    return _read({"tokens": tokens})["tokens"]


def _token_list(value: Any) -> Any:
    """``global_token_num`` as a float64 tensor (where it is)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise key_error("global_token_num", f"must be token counts, got {arr.dtype} data")
    return torch.from_numpy(arr.astype(np.float64))


def compute_throughput_stats(
    batch: Any,
    timing_raw: Mapping[str, Any],
    n_gpus: Any,
    *,
    nan_strategy: str = "propagate",
    errors: dict[str, str] | None = None,
) -> dict[str, Stat]:
    """What a rank submits for :func:`compute_throughput_metrics`: the Stats of its three names
    (``perf/throughput``: this rank's ratio, kept where the derivation cannot run) and of the
    throughput's ingredients (tokens, seconds and GPUs; :data:`rlmetrics.metrics.THROUGHPUT_TOKENS`).
    A step time that is not a number, or ``n_gpus`` that is not a positive number, is refused
    (:func:`refuse`) with the names it makes, naming the value; the other names are kept.

    >>> stats = compute_throughput_stats({"global_token_num": [100, 300]}, {"step": 2.0}, 4)
    >>> stats["perf/total_num_tokens"].sum, stats["_aux/perf/throughput/gpus/sum"].sum
    (400.0, 4.0)
    """
    tokens = _total_tokens(BatchTensors(batch, "compute_throughput_metrics"))
    refused: dict[str, str] = {}
    step = _stage_values({"step": timing_raw["step"]}, refused).get("step") if _has_step(timing_raw) else None
    if refused:
        refused = {"perf/time_per_step": refused.popitem()[1].replace("timing_s/step", "perf/time_per_step")}
    try:
        gpus = scalar_value(n_gpus, "perf/throughput")
    except MetricValueError:
        gpus = None
    if not (gpus is not None and gpus > 0):  # not NaN, 0, negative, a str, None
        refused["perf/throughput"] = (
            f"the GPU count (n_gpu) is {_shown(n_gpus)}: this rank is left out of this step's "
            "perf/throughput; pass the GPUs its batch ran on, a positive number (siiRL passes pp * tp)"
        )
        gpus = None
    refuse(refused, errors)
    read = _read({"tokens": tokens, "step": step})
    tokens, step = read["tokens"], read["step"]
    out: dict[str, Stat] = {}
    if tokens is not None:
        out["perf/total_num_tokens"] = Stat.of(
            tokens, nan_strategy=nan_strategy, name="perf/total_num_tokens"
        )
    if not _has_step(timing_raw):
        return out
    out["perf/time_per_step"] = (
        Stat() if step is None else Stat.of(step, nan_strategy=nan_strategy, name="perf/time_per_step")
    )
    if tokens is None:
        return out
    token_stat, step_stat = out["perf/total_num_tokens"], out["perf/time_per_step"]
    # a value dropped under nan_strategy="drop" or refused (sent with no observation) takes the others
    used = token_stat.count > 0 and step_stat.count > 0 and gpus is not None
    out["perf/throughput"] = Stat.of(tokens / (step * gpus)) if used and step > 0 else Stat()
    parts = (token_stat, step_stat, Stat.of(gpus) if used else Stat())
    for name, part in zip((THROUGHPUT_TOKENS, THROUGHPUT_SECONDS, THROUGHPUT_GPUS), parts):
        out[name] = part if used else Stat()
    return out


def _has_step(timing_raw: Any) -> bool:
    return isinstance(timing_raw, Mapping) and "step" in timing_raw


def compute_throughput_metrics(
    batch: Any, timing_raw: Mapping[str, Any], n_gpus: Any, *, nan_strategy: str = "propagate"
) -> dict[str, float]:
    """``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (tokens/s/GPU).

    Tokens: the sum of ``global_token_num`` (siiRL's per-sequence token counts), or of
    ``attention_mask`` when the batch has no ``global_token_num``.

    >>> compute_throughput_metrics({"global_token_num": [100, 300]}, {"step": 2.0}, n_gpus=4)
    {'perf/total_num_tokens': 400.0, 'perf/time_per_step': 2.0, 'perf/throughput': 50.0}
    """
    return data_metrics_from_stats(
        compute_throughput_stats(batch, timing_raw, n_gpus, nan_strategy=nan_strategy)
    )


compute_throughout_metrics = compute_throughput_metrics
"""The seed's spelling of :func:`compute_throughput_metrics`."""


__all__ = [
    "ALL_TOKEN_STAGES", "RESPONSE_TOKEN_STAGES", "compute_throughout_metrics", "compute_throughput_metrics",
    "batch_tokens", "compute_throughput_stats", "compute_timing_metrics", "compute_timing_stats",
    "stage_seconds",
]  # fmt: skip
