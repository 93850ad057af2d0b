"""Validation metrics (the seed's ``process_validation_metrics``), vectorised over prompts, numpy only.

Validation generates ``n`` responses per prompt; every numeric variable of ``infos_dict`` (``acc``,
``reward``, ...) is summarised per prompt and then averaged over the prompts of each data source.

**Reference semantics** (siiRL's ``process_validation_metrics``, reproduced to float rounding):

- Samples are grouped by ``(data_source, prompt)``; within a prompt they keep their input order.
  A variable is used for a prompt when the prompt's first value is not a string (nor any other
  non-number: siiRL would crash on ``None``, we skip it); a non-number further in such a prompt
  counts as NaN, with a warning (siiRL would crash).
- Per prompt with ``n`` samples: ``mean@n``; if ``n > 1``: ``std@n`` (population) and, for ``k`` in
  :func:`bootstrap_sizes` (2, 4, 8, ... below ``n``, then ``n``), with the indices
  :func:`bootstrap_indices` (``np.random.seed(seed)`` then ``np.random.choice(n, (1000, k))``, reseeded
  for every call, so they depend on ``(n, k, seed)`` only): ``best@k/mean|std`` and ``worst@k/mean|std``
  (mean and population std of the row maxima / minima) and, when a ``pred`` variable exists,
  ``maj@k/mean|std`` of the value at the first position of the row's most frequent ``pred`` (ties:
  the pred that appears first in the row), as :func:`calc_maj_val`.
- Each metric is averaged over the prompts of its data source that have it. Keys are
  ``{section}/{data_source}/{var}/{metric}``, section ``val-core`` for the core variable (``acc`` if
  present, else ``reward``) on metrics starting with ``mean``, ``maj`` or ``best`` at the largest
  ``@N`` of that variable, ``val-aux`` otherwise. Plus ``val/test_score/{data_source}`` (mean
  ``reward`` over the data source's samples; skipped without a ``reward`` variable, where siiRL
  raises ``KeyError``) and ``val-aux/num_turns/min|max|mean`` (``sample_turns`` may be a flat list of
  ints as well as the list of arrays that siiRL's ``np.concatenate`` needs).

**verl's semantics** (``style="verl"`` of :func:`encode_samples`, verl 0.9.1's
``process_validation_metrics``): per prompt and variable, ``None`` values are dropped (so ``n`` is the
number of values left, and may differ between variables of one prompt); a prompt votes (``maj@k``)
for a variable only when none of its preds is None and the variable kept all its values. verl's
``expected_acc_counts`` (``expected_counts``: ``{(data_source, prompt): count}``, for data sources
where some ``acc`` is not None) pads a prompt's ``acc`` with zeros up to the count (a prompt without
samples gets one) and adds ``acc_success_only``, the ``acc`` values it had. verl's trainer reports
no ``val/test_score/*``; :func:`samples_by_source` gives verl's nested return.

**How it is fast.** Prompts are grouped by ``n``; only ``(n, k)`` decides the bootstrap indices, so
everything that depends on them alone is computed once per ``(n, k)`` and kept
(:mod:`~rlmetrics.metrics.validation.bootstrap`). Every statistic is the mean and std over rows of a value
each row takes from the prompt, so it follows from how many rows take each value
(:func:`_row_stats`). best/worst@k: the rows whose maximum is at least a prompt's i-th smallest value
are those that draw a position holding one of its largest ``n - i`` values, counted for all
prompts at once by a lookup in a table of how many rows miss each set of positions (``2**n``
entries, built by a sum over subsets; up to :data:`TABLE_MAX_N` samples, beyond which every row is
gathered). maj@k: the preds of each prompt become dense codes; the vote count of every class in
every bootstrap row is a matrix product ``(counts per sample) @ (one-hot classes)``, and the tie-break
(earliest first position) rides in the same product as a sum of distinct powers of two (exact in
float32 up to 19 draws, in float64 words beyond); the winners' positions are counted per prompt (and
with ``k == 2`` the first draw always wins). Prompts are processed in chunks of about
:data:`CHUNK_BYTES`, so memory stays bounded.

**NaN and order.** NaN values propagate exactly as numpy's would in the seed: a NaN in a bootstrap
row makes its best/worst NaN; maj is NaN when the chosen value is NaN; ``mean@n``/``std@n`` of a
prompt with a NaN are NaN, and so is the data source's average; its exact keys are NaN and it has
no ``pass@k`` (NaN is not 0/1). Averages over prompts do not depend
on the order of prompts (up to float rounding), but best/worst/maj do depend on the order of the
samples *within* a prompt (the bootstrap indices pick positions), so distributed use must
concatenate the ranks in a fixed order; see :func:`merge_samples`. siiRL reseeds the global numpy
generator; we draw the same numbers from a private ``RandomState`` and leave the global one alone.

**Beyond the seed** (``exact=True``; extra keys, always ``val-aux``, the seed's keys unchanged):
``pass@k`` for variables whose values in the data source are all 0/1 (the unbiased estimator of
Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)``, for ``k`` in 1 and :func:`bootstrap_sizes`); the
exact expectation and std of the bootstrap distribution (``k`` draws with replacement), without
sampling noise: ``best@k/exact_mean|exact_std``, ``worst@k/...`` and ``maj@k/...``; the unbiased
estimators over all ``k``-subsets of distinct samples, ``best@k/unbiased``, ``worst@k/unbiased`` and
``maj@k/unbiased`` (:mod:`~rlmetrics.metrics.validation.exact` says why the bootstrap is biased);
and a 95 % confidence interval across prompts, ``<name>/ci_low|ci_high``, for each ``pass@k``,
``exact_mean`` and ``unbiased`` (:mod:`~rlmetrics.metrics.validation.compute`). maj@k is computed
by a dynamic program over the vote counts, exact up to float rounding, once per distinct multiset
of class sizes (``docs/validation.md`` has the cost). Like every key here, they are final values
over all samples (computed once, after merging the records), not inputs to a per-name reduction.
Also ``pass^k`` (all ``k`` correct, ``C(c, k) / C(n, k)``, next to each ``pass@k``); ``tie="none"``
(a tied maj@k vote is no majority and reports 0, keys ``maj_strict@k/...``) and ``missing=`` (what a
None or NaN score counts as, named in the keys ``<var>:<choice>``) of :func:`encode_samples`; the
defaults keep the seed's numbers and keys (``docs/validation.md``).

**Distributed.** :func:`encode_samples` turns one rank's samples into a compact
:class:`SampleRecord` (codes plus tables, float64 columns); :func:`merge_samples` concatenates
records in the given (rank) order; and :func:`process_samples` computes the metrics of a record.
``process_samples(merge_samples(records))`` equals ``process_validation_metrics`` on the
concatenated inputs exactly; averaging per-rank results instead is wrong whenever a prompt's samples
sit on several ranks.

>>> m = process_validation_metrics(["gsm8k"] * 4, ["q1", "q1", "q2", "q2"],
...                                {"acc": [1.0, 0.0, 1.0, 1.0], "pred": ["4", "5", "7", "7"]})
>>> m["val-core/gsm8k/acc/mean@2"], m["val-aux/gsm8k/acc/std@2"]
(0.75, 0.25)
>>> sorted(name for name in m if name.startswith("val-core"))
['val-core/gsm8k/acc/best@2/mean', 'val-core/gsm8k/acc/best@2/std', 'val-core/gsm8k/acc/maj@2/mean', \
'val-core/gsm8k/acc/maj@2/std', 'val-core/gsm8k/acc/mean@2']

**Where it lives.** This module: the public functions. :mod:`~rlmetrics.metrics.validation.records`:
records (encode, merge, digest); :mod:`~rlmetrics.metrics.validation.views`: how samples are grouped
(the seed's and verl's styles); :mod:`~rlmetrics.metrics.validation.compute`: the per-prompt metrics
and their averages; :mod:`~rlmetrics.metrics.validation.bootstrap`: the vectorised bootstrap;
:mod:`~rlmetrics.metrics.validation.exact`: the ``exact=True`` extras.
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
    """The ``val_key`` of the first item whose ``vote_key`` is the most frequent vote (ties: the vote
    seen first), as the seed.

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
    """``(mean, std)`` over ``n_bootstrap`` resamples of ``subset_size`` items of ``data`` (with
    replacement) of each ``reduce_fn(resample)``, the seed's function with the same draws.

    numpy's ``max min mean sum median std var`` on numeric data run on all resamples at once; any
    other function is called once per resample with a list, as in the seed.

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
    """The seed's validation metrics ``{name: value}`` (see the module docstring for the names).

    ``sample_turns`` may be a flat sequence of turn counts or a sequence of arrays (the seed
    concatenates them). ``exact=True`` adds the ``pass@k``, ``.../exact_mean|exact_std``,
    ``.../unbiased`` and ``.../ci_low|ci_high`` keys.
    ``nan_strategy``, ``tie`` (``"none"``: a tied vote is no majority, maj reports 0, keys
    ``maj_strict@k/...``) and ``missing`` (None, ``"count_as_zero"``, ``"drop"``, ``"error"``: what a
    None or NaN score counts as; the choice is in the keys, ``<var>:<choice>``): as
    :func:`encode_samples`.

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
    """``{data_source: {var: {metric: value}}}`` as the seed's function of that name returns it.

    Its metrics are those of :func:`process_validation_metrics` without ``std@n`` (an average of
    per-prompt stds), plus ``pooled_std``: ``sqrt(sum of squared deviations from each prompt's mean
    / sum of (n - 1))`` over the data source's prompts with ``n > 1``, the within-prompt std pooled
    the way the seed pools it (absent when no prompt has two samples).

    The seed's version draws its bootstrap indices from one stream per prompt (not reseeded per
    variable and size), breaks maj ties towards the smallest pred (``scipy.stats.mode``) and skips
    NaN (pandas); here the numbers are those of :func:`process_validation_metrics`, so both functions
    agree on every key they share.

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
    """The validation metrics of a record (:func:`encode_samples` / :func:`merge_samples`); ``seed``
    None: the record's. The ``"verl"`` style has no ``val/test_score/*`` (verl's trainer reports none).

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
    """A variable's segment of the keys: ``<var>:<missing>`` when the record says what its missing
    scores were made into (runs with different rules never share a key), else ``var``."""
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
    """The metrics of a record nested as ``{data_source: {var: {metric: value}}}`` (verl's return of
    ``process_validation_metrics``), with the ``exact=True`` keys when asked; ``seed`` None: the record's.

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
