"""verl 0.9.1's metric functions with verl's names and signatures, exact across data-parallel ranks.

A drop-in for ``verl.trainer.ppo.metric_utils`` and ``verl.utils.metric`` (verl is not needed)::

    from rlmetrics.integrations.verl import (
        AggregationType, Metric, compute_data_metrics, compute_throughout_metrics, compute_timing_metrics,
        compute_variance_proxy_metrics, process_validation_metrics, reduce_metrics)

On one process every function returns verl's keys and numbers (float rounding aside: verl sums in
float32, we in float64). Batches are recognised by shape: a ``DataProto`` (an object with ``.batch``,
a TensorDict, ``.non_tensor_batch``, a dict of numpy arrays, and ``.meta_info``), its TensorDict, or a
plain dict of tensors and arrays.

**Across ranks.** The batch functions return :class:`Value` floats: verl's number, carrying the
mergeable summary behind it. Each data-parallel rank calls the same function on its own shard and
submits the result through a client with verl's naming (:func:`connect`, or any backend's
``connect(..., naming=NAMING)``); merged, the result is verl's number for the full batch under verl's
name: token- and sequence-weighted means, global min/max, ``critic/vf_explained_var``,
``timing_per_token_ms/*``, ``perf/throughput`` and ``variance_proxy/proxy3_pure_noise`` derived from
merged sums. ``timing_s/*`` keeps its name. Validation samples go with
:func:`submit_validation_metrics`; the merged keys are those verl's trainer logs
(``val-core/{source}/{var}/{metric}``, ``val-aux/...``).

Worker metrics submitted with verl's naming: a verl :class:`Metric` (ours or verl's own, recognised by
shape) merges as verl's ``Metric.aggregate_dp`` does (mean over ranks and micro-batches; ``SUM``:
the mean over ranks of each rank's sum; min/max over all values); a list of per-micro-batch values
merges as ``reduce_metrics`` of the concatenated lists, a list under a ``.../std`` name included
(the mean of the stds); a ``(value, tokens)`` pair per micro-batch merges to the value over all
tokens of all ranks (``actor/pg_loss``, ``actor/entropy``, ...). Reductions are resolved from whole
tokens of the name (``actor/minibatch_loss`` is a mean), with verl's exceptions in
:data:`VERL_REDUCTIONS`.

>>> import torch
>>> batch = {"prompts": torch.zeros(2, 2), "responses": torch.zeros(2, 2),
...          "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]]),
...          "response_mask": torch.tensor([[1, 1], [1, 0]]),
...          "token_level_scores": torch.tensor([[0.0, 1.0], [0.5, 0.0]]),
...          "token_level_rewards": torch.tensor([[0.0, 1.0], [0.5, 0.0]]),
...          "advantages": torch.tensor([[1.0, 2.0], [3.0, 9.0]]), "returns": torch.ones(2, 2)}
>>> m = compute_data_metrics(batch, use_critic=False)
>>> m["critic/advantages/mean"], m["response_length/mean"], m["prompt_length/clip_ratio"]
(2.0, 1.5, 0.5)
>>> m["critic/advantages/mean"].stat.count  # what a rank submits: 3 response tokens
3.0
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np

from rlmetrics.metrics import (
    AUX_PREFIX,
    THROUGHPUT_GPU_SECONDS,
    THROUGHPUT_TOKENS,
    TIMED_STAGES,
    VF_RESIDUAL_STD,
    VF_RETURNS_STD,
    VF_TOKENS,
    VP_SEQUENCES,
    derive_metrics,
    timing_aux,
)
from rlmetrics.metrics.validation import encode_samples, samples_by_source
from rlmetrics.reduce import MAX, MEAN, MIN, STD, SUM, Reduction, resolve
from rlmetrics.stat import Stat

VERL_REDUCTIONS: dict[str, Reduction] = {"variance_proxy/proxy2_total_power": MEAN}
"""verl's names whose reduction the name's tokens get wrong (``total`` would sum a mean)."""

_DERIVED_AUX = {
    "critic/vf_explained_var": (VF_RETURNS_STD, VF_RESIDUAL_STD, VF_TOKENS),
    "variance_proxy/proxy3_pure_noise": (VP_SEQUENCES,),
}


class Value(float):
    """verl's number, carrying what a rank submits in its place: ``stat``, the mergeable summary
    under the metric's own name, and ``aux``, the auxiliary Stats of a derived metric.

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


# ------------------------------------------------------------------------------------ batch functions
def compute_data_metrics(batch: Any, use_critic: bool = True) -> dict[str, Value]:
    """verl's ``compute_data_metrics``: ``critic/score|rewards/*`` of the responses that are not empty,
    ``critic/advantages|returns/*`` (and with ``use_critic`` ``critic/values/*`` and
    ``critic/vf_explained_var``) over ``response_mask`` tokens, ``response_length/*``,
    ``response_length_non_aborted/*``, ``response/aborted_ratio``, ``prompt_length/*`` (lengths from
    ``attention_mask``), ``num_turns/*`` and ``tool_call_counts/*``. NaN where verl reports NaN (no
    token, no response that is not empty); a key the batch lacks skips its metrics (verl raises).
    See :func:`rlmetrics.metrics.data.compute_verl_data_stats`.
    """
    from rlmetrics.metrics.data import column_values, verl_data_arrays

    names, arrays = verl_data_arrays(batch, use_critic=use_critic)
    stats = {name: Stat(*column) for name, column in zip(names, arrays.T.tolist())}
    return _values(stats, dict(zip(names, column_values(names, arrays).tolist())))


def compute_timing_metrics(batch: Any, timing_raw: Mapping[str, Any]) -> dict[str, Value]:
    """verl's ``compute_timing_metrics``: ``timing_s/{stage}`` for every entry of ``timing_raw`` and
    ``timing_per_token_ms/{stage}`` for ``gen`` (per response token) and ``ref``, ``values``, ``adv``,
    ``update_critic``, ``update_actor`` (per token of the whole sequence; 0.0 without tokens), tokens
    counted as verl does (:func:`~rlmetrics.metrics.data.verl_lengths`). Merged, a stage's time per
    token is its time over the tokens of all ranks.

    >>> import torch
    >>> batch = {"responses": torch.zeros(1, 4), "response_mask": torch.tensor([[1, 0, 0, 1]]),
    ...          "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])}  # tool output: attended, not trained
    >>> m = compute_timing_metrics(batch, {"gen": 0.3, "ref": 0.5})
    >>> m["timing_s/gen"], m["timing_per_token_ms/gen"], m["timing_per_token_ms/ref"]
    (0.3, 100.0, 100.0)
    """
    from rlmetrics.metrics.data import verl_lengths
    from rlmetrics.metrics.timing import stage_seconds
    from rlmetrics.stat import to_host

    seconds = stage_seconds(timing_raw)
    out: dict[str, Value] = {f"timing_s/{stage}": Value(s, Stat.of(s)) for stage, s in seconds.items()}
    lengths = verl_lengths(batch)
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
    """verl's ``compute_throughout_metrics`` (its spelling): ``perf/total_num_tokens`` (the sum of
    ``meta_info["global_token_num"]``), ``perf/time_per_step`` (``timing_raw["step"]``) and
    ``perf/throughput`` (tokens per second per GPU). A shard's ``meta_info`` lists every sequence of
    the batch it was cut from (``DataProto.chunk`` copies it), so where its length is not the
    shard's, the shard's own tokens are counted from ``attention_mask``; merged, the tokens are summed.

    >>> m = compute_throughout_metrics({"global_token_num": [100, 300]}, {"step": 2.0}, n_gpus=4)
    >>> m["perf/total_num_tokens"], m["perf/time_per_step"], m["perf/throughput"]
    (400.0, 2.0, 50.0)
    """
    from rlmetrics.metrics.timing import batch_tokens

    tokens = batch_tokens(batch, "compute_throughout_metrics")
    step = float(timing_raw["step"])
    throughput = tokens / (step * n_gpus)
    aux = {THROUGHPUT_TOKENS: Stat.of(tokens), THROUGHPUT_GPU_SECONDS: Stat.of(step * n_gpus)}
    return {
        "perf/total_num_tokens": Value(tokens, Stat.of(tokens)),
        "perf/time_per_step": Value(step, Stat.of(step)),
        "perf/throughput": Value(throughput, Stat.of(throughput), aux),
    }


def compute_variance_proxy_metrics(batch: Any, gradient_norm: float | None = None) -> dict[str, Value]:
    """verl's ``compute_variance_proxy_metrics``: ``variance_proxy/proxy1_signal_strength``,
    ``proxy2_total_power`` (a mean over sequences, merged as one), ``proxy3_pure_noise`` (derived from
    the merged values and sequence count), ``expected_a_squared``, ``expected_w``; empty without
    ``sum_pi_squared``, ``old_log_probs`` or ``advantages``. See
    :func:`rlmetrics.metrics.data.compute_variance_proxy_stats`.
    """
    from rlmetrics.metrics.data import compute_variance_proxy_stats

    return _values(compute_variance_proxy_stats(batch, gradient_norm))


def process_validation_metrics(
    data_sources: Sequence[Any],
    sample_uids: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    expected_acc_counts: Mapping[tuple[Any, Any], int] | None = None,
) -> dict[Any, dict[str, dict[str, float]]]:
    """verl's ``process_validation_metrics``: ``{data_source: {var: {metric: value}}}`` with
    ``mean@n``, ``std@n``, ``best|worst|maj@k/mean|std`` averaged over the prompts (``sample_uids``)
    of each data source, ``None`` values dropped per prompt, and ``expected_acc_counts`` (see
    :mod:`rlmetrics.metrics.validation`, ``style="verl"``), vectorised.

    >>> m = process_validation_metrics(["gsm8k"] * 4, ["q1", "q1", "q2", "q2"],
    ...                                {"acc": [1.0, None, 1.0, 0.0], "pred": ["4", "5", "7", "7"]})
    >>> m["gsm8k"]["acc"]["mean@1"], m["gsm8k"]["acc"]["mean@2"], m["gsm8k"]["acc"]["maj@2/mean"]
    (1.0, 0.5, 0.513)
    """
    record = encode_samples(
        data_sources, sample_uids, infos_dict, style="verl", seed=seed, expected_counts=expected_acc_counts
    )
    return samples_by_source(record)


# ----------------------------------------------------------------------------- worker metrics
class AggregationType(Enum):
    """How a :class:`Metric` aggregates its values (verl's)."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_BY_AGGREGATION = {
    AggregationType.MEAN: MEAN,
    AggregationType.SUM: SUM,
    AggregationType.MIN: MIN,
    AggregationType.MAX: MAX,
}


class Metric:
    """verl's ``Metric``: one metric's values (one per micro-batch) and how they aggregate.

    >>> m = Metric(aggregation="mean", value=1.0)
    >>> m.append(2.0); m.extend([3.0])
    >>> float(m.aggregate())
    2.0
    >>> rank0, rank1 = Metric("sum", 1.0), Metric("sum", 3.0)
    >>> rank0.append(2.0); rank1.append(6.0)
    >>> float(Metric.aggregate_dp([rank0, rank1]))  # sum over micro-batches of the mean over ranks
    6.0
    """

    def __init__(self, aggregation: str | AggregationType, value: Any = None) -> None:
        self.aggregation = AggregationType(aggregation) if isinstance(aggregation, str) else aggregation
        if not isinstance(self.aggregation, AggregationType):
            raise ValueError(f"Unsupported aggregation type: {aggregation}")
        self.values: list[Any] = []
        if value is not None:
            self.append(value)

    def append(self, value: Any) -> None:
        """Add one value (a number, a one-element tensor or an array), or every value of a Metric."""
        if _is_metric(value):
            self.extend(value)
            return
        if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
            if value.numel() != 1:
                raise ValueError("Only scalar tensors can be converted to float")
            value = value.detach().item()
        if not isinstance(value, (numbers.Number, np.ndarray)) or isinstance(value, complex):
            raise ValueError(f"Unsupported value type: {type(value)}")
        self.values.append(value)

    def extend(self, values: Any) -> None:
        """Add every value of ``values`` (a list, or a Metric of the same aggregation)."""
        if _is_metric(values):
            if _aggregation_of(values) != self.aggregation:
                raise ValueError(f"Aggregation type mismatch: {self.aggregation} != {values.aggregation}")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        """The values' mean, sum, min or max."""
        return _BY_AGGREGATION[self.aggregation].apply(Stat.of(self.values))

    @classmethod
    def aggregate_dp(cls, metric_lists: Sequence[Any]) -> float:
        """One value from each data-parallel rank's Metric, as verl: ``MEAN``/``SUM`` aggregate the
        means over ranks of each micro-batch, ``MIN``/``MAX`` all values. Ranks must hold as many
        values each."""
        if not metric_lists:
            raise ValueError("Cannot aggregate an empty list of metrics.")
        lengths = [len(m.values) for m in metric_lists]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"All Metric instances must have the same number of values for dp aggregation: {lengths}"
            )
        aggregation = _aggregation_of(metric_lists[0])
        table = np.asarray([m.values for m in metric_lists], dtype=np.float64)  # (ranks, micro-batches)
        if aggregation in (AggregationType.MEAN, AggregationType.SUM):
            table = table.mean(axis=0)
        return _BY_AGGREGATION[aggregation].apply(Stat.of(table))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], aggregation: str | AggregationType) -> dict[str, Metric]:
        """A Metric per entry of ``data``, all of ``aggregation``."""
        return {key: cls(aggregation=aggregation, value=value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty Metric of the same aggregation."""
        return type(self)(aggregation=self.aggregation)

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value!r}, values={self.values!r})"


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's ``reduce_metrics``: a :class:`Metric` (or verl's) aggregates, a list of values is
    reduced by its name: the max where a token of the name is ``max`` (or ``maximum``), else the min
    where one is ``min`` (or ``minimum``), else the mean. A new dict (verl writes into ``metrics``).

    >>> reduce_metrics({"loss": [1.0, 2.0], "max_reward": [5.0, 8.0], "actor/minibatch_loss": [1.0, 3.0]})
    {'loss': 1.5, 'max_reward': 8.0, 'actor/minibatch_loss': 2.0}
    """
    out = {}
    for key, value in metrics.items():
        if _is_metric(value):
            out[key] = float(value.aggregate())
        else:
            out[key] = _list_reduction(key).apply(Stat.of(value, name=key))
    return out


def _list_reduction(key: str) -> Reduction:
    tokens = set(re.split(r"[/_@.\-]", key.lower()))
    if tokens & {"max", "maximum"}:
        return MAX
    return MIN if tokens & {"min", "minimum"} else MEAN


# --------------------------------------------------------------------------------- submission
class Naming:
    """verl's naming for a client: what ``submit_metric`` sends in place of verl's values, and the
    reductions verl's names need (:data:`VERL_REDUCTIONS`; a number or list under a ``.../std`` name is
    averaged). ``renames``: the aggregator keeps every name (``timing_s/*`` stays)."""

    renames: dict[str, str] = {}

    def prepare(self, metrics: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Reduction]]:
        """``metrics`` with :class:`Value` and :class:`Metric` entries replaced by Stats (and the
        auxiliary Stats a Value carries), and the reductions that differ from the names' own."""
        out: dict[str, Any] = {}
        reductions: dict[str, Reduction] = {}
        for name, value in metrics.items():
            if isinstance(value, Value):
                out[name] = value.stat
                out.update(value.aux)
            elif _is_metric(value):
                out[name], reductions[name] = _metric_stat(value)
            else:
                out[name] = value
                if isinstance(name, str) and resolve(name) is STD and not isinstance(value, Stat):
                    reductions[name] = MEAN  # a std per micro-batch or rank: verl takes the mean
            if isinstance(name, str) and name in VERL_REDUCTIONS:
                reductions[name] = VERL_REDUCTIONS[name]
        return out, reductions


NAMING = Naming()
"""verl's naming: ``rlmetrics.connect(..., naming=NAMING)``."""


def connect(backend: str = "local", *, world_size: int | None = None, name: str = "default", **options: Any):
    """:func:`rlmetrics.connect` with verl's naming (:data:`NAMING`).

    >>> import rlmetrics
    >>> client = connect("local", world_size=1, name="verl-doc")
    >>> client.submit_metric({"timing_s/gen": 0.5, "rollout_is_std": [0.1, 0.3]})
    >>> client.wait_submit()
    >>> dict(client.result(0))
    {'timing_s/gen': 0.5, 'rollout_is_std': 0.2}
    >>> rlmetrics.backends.local.drop_worker("verl-doc")
    """
    from rlmetrics.backends import connect as connect_backend

    return connect_backend(backend, world_size=world_size, name=name, naming=NAMING, **options)


def submit_validation_metrics(
    client: Any,
    data_sources: Sequence[Any],
    sample_uids: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    expected_acc_counts: Mapping[tuple[Any, Any], int] | None = None,
    *,
    sample_turns: Sequence[Any] = (),
    world_size: int | None = None,
    step: int | None = None,
) -> None:
    """Send this rank's validation samples with verl's semantics; the aggregator computes, once over
    every rank's samples (in rank order), the keys verl's trainer logs: ``val-core/{source}/{var}/
    {metric}`` for the core variable (``acc``, else ``reward``) at its largest ``@n`` on ``mean``,
    ``maj``, ``best``, ``val-aux/...`` for the others, and ``val-aux/num_turns/min|max|mean``."""
    client.process_local_validation_metrics(
        data_sources,
        sample_uids,
        infos_dict,
        sample_turns,
        world_size,
        step,
        style="verl",
        seed=seed,
        expected_counts=expected_acc_counts,
    )


# ---------------------------------------------------------------------------------- internals
def _values(stats: Mapping[str, Stat], plain: Mapping[str, float] | None = None) -> dict[str, Value]:
    """verl's value of each Stat (NaN where it holds nothing; ``plain``: those values, when known),
    the Stat and a derived metric's auxiliary Stats attached; auxiliary names left out."""
    if plain is None:
        plain = {name: _reduction(name).apply(stat) for name, stat in stats.items()}
    derived = derive_metrics({name: v for name, v in plain.items() if stats[name].count > 0})
    out = {}
    for name, stat in stats.items():
        if name.startswith(AUX_PREFIX):
            continue
        aux = {a: stats[a] for a in _DERIVED_AUX.get(name, ()) if a in stats}
        out[name] = Value(derived.get(name, plain[name]), stat, aux)
    return out


def _reduction(name: str) -> Reduction:
    return VERL_REDUCTIONS.get(name) or resolve(name)


def _is_metric(value: Any) -> bool:
    """A verl ``Metric`` (ours or verl's): ``values`` and an ``aggregation`` of verl's kinds."""
    aggregation = getattr(value, "aggregation", None)
    return hasattr(value, "values") and getattr(aggregation, "value", None) in ("mean", "sum", "min", "max")


def _aggregation_of(metric: Any) -> AggregationType:
    return AggregationType(metric.aggregation.value)


def _metric_stat(metric: Any) -> tuple[Stat, Reduction]:
    """What a rank submits for a Metric, and its reduction: its values (min, max, mean over every
    micro-batch of every rank), or for ``SUM`` the rank's sum as one value averaged over ranks."""
    aggregation = _aggregation_of(metric)
    if aggregation is AggregationType.SUM:
        return Stat.of(float(np.sum(np.asarray(metric.values, dtype=np.float64)))), MEAN
    return Stat.of(metric.values), _BY_AGGREGATION[aggregation]


__all__ = [
    "NAMING", "VERL_REDUCTIONS", "AggregationType", "Metric", "Naming", "Value", "compute_data_metrics",
    "compute_throughout_metrics", "compute_timing_metrics", "compute_variance_proxy_metrics", "connect",
    "process_validation_metrics", "reduce_metrics", "submit_validation_metrics",
]  # fmt: skip
