"""verl's batch metric functions, returning :class:`Value` floats that carry what a rank submits in
their place (docs/verl.md, "What changes in the numbers, and why")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlmetrics.core.groups import split_group_name
from rlmetrics.core.reduce import MEAN, Reduction, resolve
from rlmetrics.core.stat import Stat
from rlmetrics.metrics import (
    DERIVED_METRICS,
    THROUGHPUT_GPU_SECONDS,
    THROUGHPUT_TOKENS,
    TIMED_STAGES,
    derive_metrics,
    is_aux,
    timing_aux,
)
from rlmetrics.metrics.batch import BatchView
from rlmetrics.metrics.validation import encode_samples, samples_by_source

VERL_REDUCTIONS: dict[str, Reduction] = {"variance_proxy/proxy2_total_power": MEAN}
"""verl's names whose reduction the name's tokens get wrong (``total`` would sum a mean)."""


_DERIVED_AUX = {item.name: item.ingredients for item in DERIVED_METRICS}


class Value(float):
    """verl's number, carrying ``stat`` (its mergeable summary) and ``aux`` (a derived metric's Stats).

    >>> v = Value(2.0, Stat.of([1.0, 3.0]))
    >>> v + 1, v.stat.count
    (3.0, 2.0)
    """

    stat: Stat
    aux: dict[str, Stat]

    def __new__(cls, value: float, stat: Stat, aux: Mapping[str, Stat] | None = None) -> Value:
        self = super().__new__(cls, value)
        self.stat = stat
        self.aux = dict(aux or {})
        return self

    def __reduce__(self) -> tuple:
        return (Value, (float(self), self.stat, self.aux))

    def __repr__(self) -> str:
        return float.__repr__(self)


def compute_data_metrics(batch: Any, use_critic: bool = True, *, group_by: Any = None) -> dict[str, Value]:
    """verl's ``compute_data_metrics`` (:func:`rlmetrics.metrics.data.compute_verl_data_stats`); a key
    the batch lacks skips its metrics. ``group_by`` (e.g. ``"data_source"``): every metric also per
    group, as ``group/<tag>/<value>/<metric>`` (docs/groups.md)."""
    from rlmetrics.metrics.data import column_values, verl_data_arrays

    batch = verl_view(batch, "compute_data_metrics")
    names, arrays = verl_data_arrays(batch, use_critic=use_critic, group_by=group_by)
    stats = {name: Stat(*column) for name, column in zip(names, arrays.T.tolist())}
    return values_of(stats, dict(zip(names, column_values(names, arrays).tolist())))


def compute_timing_metrics(batch: Any, timing_raw: Mapping[str, Any]) -> dict[str, Value]:
    """verl's ``compute_timing_metrics``: ``timing_s/{stage}`` and ``timing_per_token_ms/{stage}``.

    >>> import torch
    >>> batch = {"responses": torch.zeros(1, 4), "response_mask": torch.tensor([[1, 0, 0, 1]]),
    ...          "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])}  # tool output: attended, not trained
    >>> m = compute_timing_metrics(batch, {"gen": 0.3, "ref": 0.5})
    >>> m["timing_s/gen"], m["timing_per_token_ms/gen"], m["timing_per_token_ms/ref"]
    (0.3, 100.0, 100.0)
    """
    from rlmetrics.core.host import to_host
    from rlmetrics.metrics.data import verl_lengths
    from rlmetrics.metrics.timing import stage_seconds

    seconds = stage_seconds(timing_raw)
    out: dict[str, Value] = {f"timing_s/{stage}": Value(s, Stat.of(s)) for stage, s in seconds.items()}
    lengths = verl_lengths(verl_view(batch, "compute_timing_metrics"))
    if lengths is None:
        return out
    prompt, response = (float(x.sum()) for x in to_host(list(lengths)))
    for stage in [s for s in TIMED_STAGES if s in seconds]:
        tokens = response if stage == "gen" else prompt + response
        value = seconds[stage] * 1000.0 / tokens if tokens > 0 else 0.0
        seconds_name, tokens_name = timing_aux(stage)
        aux = {seconds_name: Stat.of(seconds[stage]), tokens_name: Stat.of(tokens)}
        out[f"timing_per_token_ms/{stage}"] = Value(value, Stat.of(value), aux)
    return out


def compute_throughout_metrics(batch: Any, timing_raw: Mapping[str, Any], n_gpus: int) -> dict[str, Value]:
    """verl's ``compute_throughout_metrics`` (its spelling): ``perf/total_num_tokens``,
    ``perf/time_per_step``, ``perf/throughput`` (tokens per second per GPU).

    >>> m = compute_throughout_metrics({"global_token_num": [100, 300]}, {"step": 2.0}, n_gpus=4)
    >>> m["perf/total_num_tokens"], m["perf/time_per_step"], m["perf/throughput"]
    (400.0, 2.0, 50.0)
    """
    from rlmetrics.metrics.timing import batch_tokens

    tokens = batch_tokens(verl_view(batch, "compute_throughout_metrics"), "compute_throughout_metrics")
    step = float(timing_raw["step"])
    throughput = tokens / (step * n_gpus)
    aux = {THROUGHPUT_TOKENS: Stat.of(tokens), THROUGHPUT_GPU_SECONDS: Stat.of(step * n_gpus)}
    return {
        "perf/total_num_tokens": Value(tokens, Stat.of(tokens)),
        "perf/time_per_step": Value(step, Stat.of(step)),
        "perf/throughput": Value(throughput, Stat.of(throughput), aux),
    }


def compute_variance_proxy_metrics(batch: Any, gradient_norm: float | None = None) -> dict[str, Value]:
    """verl's ``compute_variance_proxy_metrics``
    (:func:`rlmetrics.metrics.data.compute_variance_proxy_stats`)."""
    from rlmetrics.metrics.data import compute_variance_proxy_stats

    return values_of(
        compute_variance_proxy_stats(verl_view(batch, "compute_variance_proxy_metrics"), gradient_norm)
    )


def process_validation_metrics(
    data_sources: Sequence[Any],
    sample_uids: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    expected_acc_counts: Mapping[tuple[Any, Any], int] | None = None,
) -> dict[Any, dict[str, dict[str, float]]]:
    """verl's ``process_validation_metrics``: ``{data_source: {var: {metric: value}}}``, vectorised
    (:mod:`rlmetrics.metrics.validation`, ``style="verl"``).

    >>> m = process_validation_metrics(["gsm8k"] * 4, ["q1", "q1", "q2", "q2"],
    ...                                {"acc": [1.0, None, 1.0, 0.0], "pred": ["4", "5", "7", "7"]})
    >>> m["gsm8k"]["acc"]["mean@1"], m["gsm8k"]["acc"]["mean@2"], m["gsm8k"]["acc"]["maj@2/mean"]
    (1.0, 0.5, 0.513)
    """
    record = encode_samples(
        data_sources, sample_uids, infos_dict, style="verl", seed=seed, expected_counts=expected_acc_counts
    )
    return samples_by_source(record)


VERL_READS: dict[str, tuple[str, ...]] = {
    "compute_data_metrics": ("batch", "non_tensor_batch"),
    "compute_timing_metrics": ("batch",),
    "compute_throughout_metrics": ("meta_info",),
    "compute_variance_proxy_metrics": ("batch",),
}
"""The attributes of a ``DataProto`` each of verl 0.9.1's batch functions reads."""

_NON_TENSOR_KEYS = ("__num_turns__", "tool_call_counts")
_VARIANCE_KEYS = ("sum_pi_squared", "old_log_probs", "advantages")


def verl_view(data: Any, what: str) -> Any:
    """A DataProto-shaped ``data`` (anything with ``.batch``) as the parts verl's ``what`` reads
    (:data:`VERL_READS`); what verl refuses raises, naming the attribute (docs/verl.md). A mapping
    is returned as it is.

    >>> from types import SimpleNamespace
    >>> proto = SimpleNamespace(batch={"responses": [[1]]}, non_tensor_batch=[], meta_info=None)
    >>> verl_view(proto, "compute_data_metrics").parts
    ({'responses': [[1]]},)
    >>> verl_view(proto, "compute_throughout_metrics")
    Traceback (most recent call last):
    ...
    TypeError: compute_throughout_metrics: .meta_info must be a mapping holding 'global_token_num' (verl \
reads batch.meta_info["global_token_num"]), got NoneType
    """
    if (
        isinstance(data, (Mapping, BatchView))
        or isinstance(data, (str, bytes, type))
        or not hasattr(data, "batch")
    ):
        return data  # a mapping is read whole; anything else gets as_batch's error
    reads = VERL_READS[what]
    tensors = data.batch
    parts: list[Any] = []
    if "batch" in reads:
        expected = "a mapping or a TensorDict of the batch's tensors"
        if what == "compute_variance_proxy_metrics":  # verl returns {} unless it holds all three
            parts += _part(tensors, what, ".batch", expected, _VARIANCE_KEYS, all)
        elif not isinstance(tensors, Mapping):
            raise TypeError(
                f'{what}: .batch must be {expected} (verl reads batch.batch["responses"], ...), '
                f"got {type(tensors).__name__}"
            )
        else:
            parts.append(tensors)
    if "non_tensor_batch" in reads:
        parts += _non_tensor_part(data, what)
    meta = None
    if "meta_info" in reads:
        if not hasattr(data, "meta_info"):
            raise AttributeError(
                f'{what}: the batch has no .meta_info (verl reads batch.meta_info["global_token_num"]): '
                "give a dict"
            )
        meta = data.meta_info
        if not isinstance(meta, Mapping):
            raise TypeError(
                f"{what}: .meta_info must be a mapping holding 'global_token_num' (verl reads "
                f'batch.meta_info["global_token_num"]), got {type(meta).__name__}'
            )
        parts.append(meta)
        if isinstance(tensors, Mapping):  # a shard's own tokens, where the list is another batch's
            parts.append(tensors)
    return BatchView(tuple(parts), meta, data)


def _non_tensor_part(data: Any, what: str) -> list[Any]:
    """``.non_tensor_batch`` as a part (a mapping) or none (what verl ignores); verl's refusals raise."""
    if not hasattr(data, "non_tensor_batch"):
        raise AttributeError(
            f"{what}: the batch has no .non_tensor_batch (verl looks __num_turns__ and tool_call_counts up "
            "in it): give a dict of numpy arrays, {} for none"
        )
    expected = "a mapping of numpy arrays (verl looks __num_turns__ and tool_call_counts up in it)"
    return _part(data.non_tensor_batch, what, ".non_tensor_batch", expected, _NON_TENSOR_KEYS, any)


def _part(value: Any, what: str, attr: str, expected: str, keys: tuple[str, ...], indexed: Any) -> list[Any]:
    """``value`` as a part if a mapping; else refused where verl's ``key in value`` raises or
    ``indexed`` of its answers is true, no part where verl reads nothing from it."""
    if isinstance(value, Mapping):
        return [value]
    try:
        refused = indexed([key in value for key in keys])
    except TypeError:
        refused = True
    if refused:
        raise TypeError(f"{what}: {attr} must be {expected}, got {type(value).__name__}")
    return []


def values_of(stats: Mapping[str, Stat], plain: Mapping[str, float] | None = None) -> dict[str, Value]:
    """A :class:`Value` per Stat (NaN where empty; ``plain``: the values, when known); aux names left out."""
    if plain is None:
        plain = {name: _reduction(name).apply(stat) for name, stat in stats.items()}
    derived = derive_metrics({name: v for name, v in plain.items() if stats[name].count > 0})
    out = {}
    for name, stat in stats.items():
        if is_aux(name):
            continue
        prefix, metric = split_group_name(name) or ("", name)  # a group's ingredients are its own
        aux = {prefix + a: stats[prefix + a] for a in _DERIVED_AUX.get(metric, ()) if prefix + a in stats}
        out[name] = Value(derived.get(name, plain[name]), stat, aux)
    return out


def _reduction(name: str) -> Reduction:
    return VERL_REDUCTIONS.get((split_group_name(name) or ("", name))[1]) or resolve(name)


__all__ = [
    "VERL_READS", "VERL_REDUCTIONS", "Value", "compute_data_metrics", "compute_throughout_metrics",
    "compute_timing_metrics", "compute_variance_proxy_metrics", "process_validation_metrics", "values_of",
    "verl_view",
]  # fmt: skip
