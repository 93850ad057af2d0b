"""Model FLOPs utilization, ``perf/mfu/{stage}``, exact when merged over ranks.

Holds the FLOPs count (:class:`ModelFlops`), dense peaks (:data:`PEAK_FLOPS`) and a rank's ingredients.
Rules: docs/mfu.md, "The formula" and "Merged over ranks, never counted once per rank".

>>> model = ModelFlops(n_params=7e9, n_layers=32, hidden_size=4096)
>>> model.per_token(4096) / 1e9   # 6 * 7e9 + 12 * 32 * 4096 * 4096
48.442450944
>>> m = compute_mfu_metrics(2_000_000, {"update_actor": 100.0}, 8, model=model, seq_len=4096,
...                         peak_flops="H100")
>>> round(m["perf/mfu/actor"], 4)   # 2e6 * 48.44e9 / (100 s * 8 * 989e12)
0.1225
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlmetrics.core.stat import Stat
from rlmetrics.core.values import MetricValueError, scalar_value
from rlmetrics.extras import require
from rlmetrics.metrics import MFU_STAGES, mfu_aux

PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,  # H100 SXM, bf16 dense (1979 with sparsity)
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H800": 989e12,
    "H200": 989e12,
    "H20": 148e12,
    "B200": 2250e12,
    "A100": 312e12,  # A100 SXM / PCIe, bf16 dense (624 with sparsity)
    "A800": 312e12,
    "L40S": 362e12,
    "MI300X": 1307e12,
}
"""Dense bf16 peak FLOP/s of one GPU by name (no sparsity), looked up by :func:`peak_flops_of`."""

DEFAULT_TIMERS = {
    "actor": "update_actor",
    "critic": "update_critic",
    "actor_infer": "old_log_prob",
    "ref": "ref",
}
"""The ``timing_raw`` stage each MFU stage is timed by (verl's timer names), else ``"step"``."""


@dataclass(frozen=True)
class ModelFlops:
    """A dense decoder's size for the FLOPs count: ``n_params`` (all), ``n_layers``, ``hidden_size``.

    >>> ModelFlops(1e9, 16, 2048).per_token(1024, training=False) / 1e9   # (6e9 + 12*16*2048*1024) / 3
    2.134217728
    """

    n_params: float
    n_layers: int
    hidden_size: int

    @classmethod
    def of(cls, model: Any) -> ModelFlops:
        """A ModelFlops from a mapping or object with ``n_params``/``num_params``,
        ``n_layers``/``num_hidden_layers``/``num_layers`` and ``hidden_size``/``d_model``; ValueError without.

        >>> ModelFlops.of({"num_params": 5e8, "num_hidden_layers": 24, "hidden_size": 896})
        ModelFlops(n_params=500000000.0, n_layers=24, hidden_size=896)
        """
        if isinstance(model, ModelFlops):
            return model
        get = model.get if isinstance(model, Mapping) else lambda k, d=None: getattr(model, k, d)

        def first(*keys: str) -> Any:
            for k in keys:
                if get(k) is not None:
                    return get(k)
            raise ValueError(
                f"model: needs one of {keys} (got a {type(model).__name__}); from a torch model and its "
                "config: ModelFlops(n_params=sum(p.numel() for p in model.parameters()), "
                "n_layers=config.num_hidden_layers, hidden_size=config.hidden_size)"
            )

        return cls(
            float(first("n_params", "num_params")),
            int(first("n_layers", "num_hidden_layers", "num_layers")),
            int(first("hidden_size", "d_model")),
        )

    def per_token(self, seq_len: float, *, training: bool = True) -> float:
        """FLOPs of one token of a ``seq_len``-token sequence (forward only: a third)."""
        flops = 6.0 * self.n_params + 12.0 * self.n_layers * self.hidden_size * float(seq_len)
        return flops if training else flops / 3.0

    def of_sequences(self, lengths: Any, *, training: bool = True) -> float:
        """FLOPs of sequences of ``lengths`` tokens, each at its own length (forward only: a third)."""
        s = [float(x) for x in lengths]
        flops = 6.0 * self.n_params * sum(s) + 12.0 * self.n_layers * self.hidden_size * sum(x * x for x in s)
        return flops if training else flops / 3.0


def peak_flops_of(device: float | str) -> float:
    """Peak FLOP/s of one GPU: a positive number as given, or a name looked up in :data:`PEAK_FLOPS`
    (case, spaces, ``-`` and ``_`` ignored; the longest key inside it wins). ValueError otherwise.

    >>> peak_flops_of("NVIDIA H100 80GB HBM3"), peak_flops_of("a100-sxm4-80gb"), peak_flops_of(1e15)
    (989000000000000.0, 312000000000000.0, 1000000000000000.0)
    """
    if isinstance(device, str):
        key = re.sub(r"[\s_-]", "", device).lower()
        found = [k for k in PEAK_FLOPS if re.sub(r"[\s_-]", "", k).lower() in key]
        if not found:
            raise ValueError(
                f"peak_flops: unknown device {device!r}; give its dense peak FLOP/s as a number "
                f"(known: {', '.join(PEAK_FLOPS)})"
            )
        return PEAK_FLOPS[max(found, key=len)]
    value = scalar_value(device, "peak_flops")
    if value is None or not (math.isfinite(value) and value > 0):
        raise ValueError(f"peak_flops: must be a positive number of FLOP/s or a device name, got {device!r}")
    return value


def _tokens_and_lengths(data: Any) -> tuple[float, list[float] | None]:
    """This rank's tokens and each sequence's (None for a plain number of tokens)."""
    value = (
        scalar_value(data, "perf/mfu") if not hasattr(data, "keys") and not hasattr(data, "batch") else None
    )
    if value is not None:
        return value, None
    torch = require("torch", "torch")
    from rlmetrics.metrics.tensors import BatchTensors
    from rlmetrics.metrics.timing import batch_tokens

    tokens = batch_tokens(data, "compute_mfu_metrics")
    t = BatchTensors(data, "compute_mfu_metrics")
    counts = t.batch.get("global_token_num")
    if counts is not None:
        counts = torch.as_tensor(counts).reshape(-1)
        if t.size is None or counts.numel() == t.size:
            return tokens, counts.to(torch.float64).tolist()
    if t.attention is not None:
        return tokens, t.attention.sum(dim=-1, dtype=torch.float64).tolist()
    return tokens, None


def compute_mfu_stats(
    data: Any,
    timing_raw: Mapping[str, Any],
    n_gpu: Any,
    *,
    peak_flops: float | str,
    flops_per_token: float | None = None,
    model: Any = None,
    seq_len: float | None = None,
    stage: str = "actor",
    timer: str | None = None,
    training: bool | None = None,
    nan_strategy: str = "propagate",
) -> dict[str, Stat]:
    """A rank's ``perf/mfu/{stage}`` and its ingredients (``{}`` without the stage's timer or ``"step"``);
    options: docs/mfu.md, "The formula". ``ValueError`` for a bad stage, timer, peak or FLOPs option.

    >>> stats = compute_mfu_stats(1000, {"step": 2.0}, 4, flops_per_token=1e9, peak_flops=1e12)
    >>> [stats[n].sum for n in mfu_aux("actor")]
    [1000000000000.0, 2.0, 4000000000000.0]
    """
    if stage not in MFU_STAGES:
        raise ValueError(f"stage: one of {MFU_STAGES} (the names perf/mfu/<stage> the aggregator derives)")
    if (flops_per_token is None) == (model is None):
        raise ValueError("compute_mfu_metrics: give either flops_per_token or model")
    peak = peak_flops_of(peak_flops)
    if timer is None:
        timer = DEFAULT_TIMERS[stage] if DEFAULT_TIMERS[stage] in timing_raw else "step"
    elif timer not in timing_raw:
        raise ValueError(f"timer={timer!r} is not in timing_raw (it has {sorted(timing_raw)})")
    if timer not in timing_raw:
        return {}
    from rlmetrics.metrics.timing import stage_seconds

    seconds = stage_seconds({timer: timing_raw[timer]}).get(timer)
    if seconds is None:
        return {}
    tokens, lengths = _tokens_and_lengths(data)
    train = stage in ("actor", "critic") if training is None else training
    if flops_per_token is not None:
        fpt = scalar_value(flops_per_token, "flops_per_token")
        if fpt is None or not fpt >= 0:
            raise ValueError(f"flops_per_token: must be a number >= 0, got {flops_per_token!r}")
        flops = tokens * fpt
    else:
        spec = ModelFlops.of(model)
        if seq_len is not None:
            flops = tokens * spec.per_token(seq_len, training=train)
        elif lengths is not None:
            flops = spec.of_sequences(lengths, training=train)
        else:
            raise MetricValueError("compute_mfu_metrics: a number of tokens with model= needs seq_len=")
    gpus = scalar_value(n_gpu, "n_gpu")
    flops_name, seconds_name, peak_name = mfu_aux(stage)
    name = f"perf/mfu/{stage}"
    seconds_stat = Stat.of(seconds, nan_strategy=nan_strategy, name=name)
    if gpus is None or not (seconds_stat.count > 0 and gpus > 0):  # a dropped time, a bad n_gpu: no MFU
        return {name: Stat(), flops_name: Stat(), seconds_name: Stat(), peak_name: Stat()}
    ratio = flops / (seconds * gpus * peak) if seconds > 0 else None
    return {
        name: Stat() if ratio is None else Stat.of(ratio),
        flops_name: Stat.of(flops, nan_strategy=nan_strategy, name=name),
        seconds_name: seconds_stat,
        peak_name: Stat.of(gpus * peak),
    }


def compute_mfu_metrics(
    data: Any, timing_raw: Mapping[str, Any], n_gpu: Any, **options: Any
) -> dict[str, float]:
    """``perf/mfu/{stage}`` of ``data`` (a batch or tokens) on ``n_gpu`` GPUs; as :func:`compute_mfu_stats`.

    >>> compute_mfu_metrics({"attention_mask": [[1, 1, 0], [1, 1, 1]]}, {"step": 1.0}, 1,
    ...                     flops_per_token=1e9, peak_flops=1e10)
    {'perf/mfu/actor': 0.5}
    """
    from rlmetrics.metrics.data import data_metrics_from_stats

    return data_metrics_from_stats(compute_mfu_stats(data, timing_raw, n_gpu, **options))


__all__ = [
    "DEFAULT_TIMERS", "PEAK_FLOPS", "ModelFlops", "compute_mfu_metrics", "compute_mfu_stats", "peak_flops_of",
]  # fmt: skip
