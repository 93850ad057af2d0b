"""Validation metrics (the seed's ``process_validation_metrics``), vectorised over prompts, numpy only.

Ranks' records merge exactly (:func:`encode_samples`, :func:`merge_samples`, :func:`process_samples`).
Rules: docs/validation.md, "Semantics, and how it is computed".

>>> m = process_validation_metrics(["gsm8k"] * 4, ["q1", "q1", "q2", "q2"],
...                                {"acc": [1.0, 0.0, 1.0, 1.0], "pred": ["4", "5", "7", "7"]})
>>> m["val-core/gsm8k/acc/mean@2"], m["val-aux/gsm8k/acc/std@2"]
(0.75, 0.25)
>>> sorted(name for name in m if name.startswith("val-core"))
['val-core/gsm8k/acc/best@2/mean', 'val-core/gsm8k/acc/best@2/std', 'val-core/gsm8k/acc/maj@2/mean', \
'val-core/gsm8k/acc/maj@2/std', 'val-core/gsm8k/acc/mean@2']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rlmetrics.metrics.validation.bootstrap import (
    CACHE_BYTES,
    CHUNK_BYTES,
    N_BOOTSTRAP,
    TABLE_MAX_N,
    bootstrap_indices,
    bootstrap_sizes,
)
from rlmetrics.metrics.validation.compute import at_n, compute
from rlmetrics.metrics.validation.exact import pass_at_k, pass_hat_k
from rlmetrics.metrics.validation.records import (
    RECORD_VERSION,
    STYLES,
    SampleRecord,
    encode_samples,
    is_number,
    merge_samples,
    record_digest,
)

_AXIS_REDUCERS: dict[Any, Callable[..., np.ndarray]] = {
    np.max: np.max, np.amax: np.max, np.min: np.min, np.amin: np.min, np.mean: np.mean,
    np.sum: np.sum, np.median: np.median, np.std: np.std, np.var: np.var,
}  # fmt: skip


def calc_maj_val(data: Iterable[Mapping[str, Any]], vote_key: str, val_key: str) -> Any:
    """``val_key`` of the first item with the top ``vote_key`` count (ties: first seen); ValueError if empty.

    >>> calc_maj_val([{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}],
    ...              vote_key="pred", val_key="val")
    0.9
    >>> calc_maj_val([{"p": 2, "v": 0}, {"p": 1, "v": 1}, {"p": 1, "v": 2}, {"p": 2, "v": 3}], "p", "v")
    0
    """
    count: dict[Any, int] = {}
    first: dict[Any, Any] = {}
    for item in data:
        vote = item[vote_key]
        if vote not in count:
            count[vote] = 0
            first[vote] = item[val_key]
        count[vote] += 1
    if not count:
        raise ValueError("calc_maj_val needs at least one item")
    top = max(count.values())
    return first[next(vote for vote, c in count.items() if c == top)]


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[Any], float]],
    n_bootstrap: int = N_BOOTSTRAP,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """``(mean, std)`` of each ``reduce_fn`` over the seed's resamples of ``data``; ValueError if empty.

    >>> bootstrap_metric([1.0, 2.0, 3.0, 4.0, 5.0], 3, [np.max, np.min])
    [(4.221, 0.9487670947076526), (1.788, 0.945016401974061)]
    """
    if len(data) == 0:
        raise ValueError("bootstrap_metric needs at least one data point")
    idx = bootstrap_indices(len(data), subset_size, n_bootstrap, seed)
    numeric = _float_array_or_none(data)
    out = []
    for fn in reduce_fns:
        axis_fn = _AXIS_REDUCERS.get(fn) if numeric is not None else None
        if axis_fn is not None:
            stats = axis_fn(numeric[idx], axis=1)
        else:
            stats = np.asarray([fn([data[i] for i in row]) for row in idx.tolist()])
        out.append((float(np.mean(stats)), float(np.std(stats))))
    return out


def process_validation_metrics(
    data_sources: Sequence[Any],
    sample_inputs: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    sample_turns: Sequence[Any] = (),
    seed: int = 42,
    *,
    exact: bool = False,
    n_bootstrap: int = N_BOOTSTRAP,
    nan_strategy: str = "propagate",
    tie: str = "first",
    missing: str | None = None,
) -> dict[str, float]:
    """The seed's validation metrics ``{name: value}``. ``exact``, ``tie``, ``missing``: docs/validation.md;
    ``nan_strategy``: docs/reductions.md, "The value policy" (all as :func:`encode_samples`).

    >>> m = process_validation_metrics(["a", "a", "b"], ["p", "p", "q"], {"reward": [1.0, 0.0, 0.5]},
    ...                                sample_turns=[2, 3, 4])
    >>> m["val-core/a/reward/mean@2"], m["val-core/b/reward/mean@1"], m["val/test_score/a"]
    (0.5, 0.5, 0.5)
    >>> m["val-aux/num_turns/max"], m["val-aux/num_turns/mean"]
    (4.0, 3.0)
    """
    record = encode_samples(
        data_sources, sample_inputs, infos_dict, sample_turns,
        nan_strategy=nan_strategy, tie=tie, missing=missing,
    )  # fmt: skip
    return process_samples(record, seed, exact=exact, n_bootstrap=n_bootstrap)


def aggregate_validation_metrics(
    data_sources: Sequence[Any],
    sample_inputs: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    *,
    exact: bool = False,
    n_bootstrap: int = N_BOOTSTRAP,
) -> dict[str, dict[str, dict[str, float]]]:
    """``{data_source: {var: {metric: value}}}`` as the seed's function of that name returns it, with
    ``pooled_std`` instead of ``std@n`` (docs/validation.md, "Semantics, and how it is computed").

    >>> r = aggregate_validation_metrics(["a"] * 4, ["p", "p", "q", "q"], {"acc": [1, 0, 1, 1]})
    >>> r["a"]["acc"]["mean@2"], round(r["a"]["acc"]["pooled_std"], 6), "std@2" in r["a"]["acc"]
    (0.75, 0.5, False)
    """
    record = encode_samples(data_sources, sample_inputs, infos_dict)
    res = compute(record, seed, n_bootstrap, exact)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (src, var), metrics in res.metrics.items():
        entry = {name: v for name, v in metrics.items() if not name.startswith("std@")}
        pooled = res.pooled_std.get((src, var))
        if pooled is not None:
            entry["pooled_std"] = pooled
        entry.update(res.extras.get((src, var), {}))
        out.setdefault(str(src), {})[var] = entry
    return out


def process_samples(
    record: SampleRecord,
    seed: int | None = None,
    *,
    exact: bool = False,
    n_bootstrap: int = N_BOOTSTRAP,
) -> dict[str, float]:
    """The validation metrics of a record; ``seed`` None: the record's.

    >>> r = merge_samples([encode_samples(["a"], ["p"], {"acc": [1.0]}),
    ...                    encode_samples(["a"], ["p"], {"acc": [0.0]})])
    >>> process_samples(r) == process_validation_metrics(["a", "a"], ["p", "p"], {"acc": [1.0, 0.0]})
    True
    """
    res = compute(record, record.seed if seed is None else seed, n_bootstrap, exact)
    out: dict[str, float] = {}
    for (src, var), metrics in res.metrics.items():
        core = "acc" if (src, "acc") in res.metrics else "reward"
        n_max = res.n_max[(src, var)]
        tag = var_key(record, var)
        for name, value in metrics.items():
            is_core = var == core and name.startswith(("mean", "maj", "best")) and at_n(name) == n_max
            out[f"{'val-core' if is_core else 'val-aux'}/{src}/{tag}/{metric_key(record, name)}"] = value
        for name, value in res.extras.get((src, var), {}).items():
            out[f"val-aux/{src}/{tag}/{metric_key(record, name)}"] = value
    turns = np.asarray(record.turns, dtype=np.float64)
    if len(turns):
        out["val-aux/num_turns/min"] = float(turns.min())
        out["val-aux/num_turns/max"] = float(turns.max())
        out["val-aux/num_turns/mean"] = float(turns.mean())
    score = var_key(record, "val/test_score")
    out.update({f"{score}/{src}": v for src, v in res.test_score.items()})
    if record.missing in ("count_as_zero", "drop"):  # how many samples each key's rule changed
        failed = dict.fromkeys(res.metrics, 0)
        for src, var, count in record.failed:
            failed[(src, var)] = failed.get((src, var), 0) + count
        out.update(
            {f"val-aux/{src}/{var_key(record, var)}/failed": float(c) for (src, var), c in failed.items()}
        )
    return out


def var_key(record: SampleRecord, var: str) -> str:
    """A variable's key segment: ``<var>:<missing>`` under a ``missing`` rule, else ``var``."""
    return var if record.missing is None else f"{var}:{record.missing}"


def metric_key(record: SampleRecord, name: str) -> str:
    """A metric's name as keyed: ``maj@k`` is ``maj_strict@k`` when a tie is no majority."""
    return "maj_strict@" + name[4:] if record.tie == "none" and name.startswith("maj@") else name


def samples_by_source(
    record: SampleRecord,
    seed: int | None = None,
    *,
    exact: bool = False,
    n_bootstrap: int = N_BOOTSTRAP,
) -> dict[Any, dict[str, dict[str, float]]]:
    """A record's metrics nested as verl's, ``{source: {var: {metric: value}}}``; ``seed`` None: the record's.

    >>> r = encode_samples(["a", "a"], ["p", "p"], {"acc": [1.0, None]}, style="verl")
    >>> samples_by_source(r)
    {'a': {'acc': {'mean@1': 1.0}}}
    """
    res = compute(record, record.seed if seed is None else seed, n_bootstrap, exact)
    out: dict[Any, dict[str, dict[str, float]]] = {}
    for (src, var), metrics in res.metrics.items():
        entry = {**metrics, **res.extras.get((src, var), {})}
        out.setdefault(src, {})[var_key(record, var)] = {metric_key(record, k): v for k, v in entry.items()}
    return out


def _float_array_or_none(data: Sequence[Any]) -> np.ndarray | None:
    if isinstance(data, np.ndarray):
        return data.astype(np.float64) if data.dtype.kind in "biuf" and data.ndim == 1 else None
    if not all(is_number(v) for v in data):
        return None
    return np.asarray(data, dtype=np.float64)


__all__ = [
    "CACHE_BYTES", "CHUNK_BYTES", "N_BOOTSTRAP", "RECORD_VERSION", "STYLES", "TABLE_MAX_N", "SampleRecord",
    "aggregate_validation_metrics", "bootstrap_indices", "bootstrap_metric", "bootstrap_sizes",
    "calc_maj_val", "encode_samples", "merge_samples", "pass_at_k", "pass_hat_k", "process_samples",
    "process_validation_metrics", "record_digest", "samples_by_source",
]  # fmt: skip
