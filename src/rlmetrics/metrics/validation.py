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
(:func:`_miss_table`, :func:`_tie_words`). Every statistic is the mean and std over rows of a value
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
Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)``, for ``k`` in 1 and :func:`bootstrap_sizes`), and the
exact expectation and std of the bootstrap distribution (``k`` draws with replacement), without
sampling noise: ``best@k/exact_mean|exact_std``, ``worst@k/...`` and ``maj@k/...`` (majority
vote by a dynamic program over the vote counts, exact up to float rounding; its cost grows with
``k**3`` times the number of distinct preds: 512 x 16 takes about 0.1 s more, 1000 x 64 about 3 s).
Like every key here, they are final values over all samples (computed once, after merging the
records), not inputs to a per-name reduction.

**Distributed.** :func:`encode_samples` turns one rank's samples into a compact record (codes plus
tables, float64 columns); :func:`merge_samples` concatenates records in the given (rank) order; and
:func:`process_samples` computes the metrics of a record. ``process_samples(merge_samples(records))``
equals ``process_validation_metrics`` on the concatenated inputs exactly; averaging per-rank
results instead is wrong whenever a prompt's samples sit on several ranks.

>>> m = process_validation_metrics(["gsm8k"] * 4, ["q1", "q1", "q2", "q2"],
...                                {"acc": [1.0, 0.0, 1.0, 1.0], "pred": ["4", "5", "7", "7"]})
>>> m["val-core/gsm8k/acc/mean@2"], m["val-aux/gsm8k/acc/std@2"]
(0.75, 0.25)
>>> sorted(name for name in m if name.startswith("val-core"))
['val-core/gsm8k/acc/best@2/mean', 'val-core/gsm8k/acc/best@2/std', 'val-core/gsm8k/acc/maj@2/mean', \
'val-core/gsm8k/acc/maj@2/std', 'val-core/gsm8k/acc/mean@2']
"""

from __future__ import annotations

import functools
import hashlib
import logging
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.stat import NAN_STRATEGIES, MetricValueError

logger = logging.getLogger(__name__)

N_BOOTSTRAP = 1000
"""Bootstrap rows per ``(n, k)``, as in the seed."""
CHUNK_BYTES = 16 << 20
"""Rough size of the largest temporary array; prompts are processed in chunks that fit it."""
CACHE_BYTES = 2 << 20
"""Rough size of the vote counts of one chunk of the majority vote (small enough to stay in cache)."""
RECORD_VERSION = 1

TABLE_MAX_N = 16
"""Prompts with at most this many samples get best@k / worst@k from subset-count tables
(:func:`_miss_table`, ``2**n`` entries per ``(n, k)``) rather than by gathering every bootstrap row."""
STYLES = ("seed", "verl")
"""Record styles: the seed's (siiRL's) semantics, or verl 0.9.1's (see the module docstring)."""

_WORD = 32  # bootstrap positions per float64 tie-break word (weights 2**31 .. 2**0, plus counts * 2**32)
_SHORT_K = 19  # up to this many draws, one float32 word holds count * 2**k + the k position bits (< 2**24)
_GEMM_MAX = 1 << 18  # multiply-adds per matrix product of the majority vote (see _products)
_EXTREMES = (("best", "mean"), ("best", "std"), ("worst", "mean"), ("worst", "std"))


# ------------------------------------------------------------------------------------------ the seed
def bootstrap_sizes(n: int) -> list[int]:
    """Subset sizes of the bootstrap metrics for a prompt with ``n`` samples: 2, 4, 8, ... below ``n``,
    then ``n`` (none when ``n < 2``).

    >>> bootstrap_sizes(16), bootstrap_sizes(5), bootstrap_sizes(2), bootstrap_sizes(1)
    ([2, 4, 8, 16], [2, 4, 5], [2], [])
    """
    if n < 2:
        return []
    sizes = [2**i for i in range(1, max(1, (n - 1).bit_length())) if 2**i < n]
    return [*sizes, n]


def bootstrap_indices(n: int, k: int, n_bootstrap: int = N_BOOTSTRAP, seed: int = 42) -> np.ndarray:
    """The seed's indices: ``np.random.seed(seed); np.random.choice(n, size=(n_bootstrap, k))``, drawn
    from a private generator (the global one is untouched).

    >>> np.random.seed(7); a = np.random.choice(5, size=(3, 2), replace=True)
    >>> bool((bootstrap_indices(5, 2, 3, seed=7) == a).all())
    True
    """
    return np.random.RandomState(seed).choice(n, size=(n_bootstrap, k), replace=True)


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


_AXIS_REDUCERS: dict[Any, Callable[..., np.ndarray]] = {
    np.max: np.max, np.amax: np.max, np.min: np.min, np.amin: np.min, np.mean: np.mean,
    np.sum: np.sum, np.median: np.median, np.std: np.std, np.var: np.var,
}  # fmt: skip


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
) -> dict[str, float]:
    """The seed's validation metrics ``{name: value}`` (see the module docstring for the names).

    ``sample_turns`` may be a flat sequence of turn counts or a sequence of arrays (the seed
    concatenates them). ``exact=True`` adds the ``pass@k`` and ``.../exact_mean|exact_std`` keys.
    ``nan_strategy``: as :func:`encode_samples`.

    >>> m = process_validation_metrics(["a", "a", "b"], ["p", "p", "q"], {"reward": [1.0, 0.0, 0.5]},
    ...                                sample_turns=[2, 3, 4])
    >>> m["val-core/a/reward/mean@2"], m["val-core/b/reward/mean@1"], m["val/test_score/a"]
    (0.5, 0.5, 0.5)
    >>> m["val-aux/num_turns/max"], m["val-aux/num_turns/mean"]
    (4.0, 3.0)
    """
    record = encode_samples(data_sources, sample_inputs, infos_dict, sample_turns, nan_strategy=nan_strategy)
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
    res = _compute(record, seed, n_bootstrap, exact)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (src, var), metrics in res.metrics.items():
        entry = {name: v for name, v in metrics.items() if not name.startswith("std@")}
        pooled = res.pooled_std.get((src, var))
        if pooled is not None:
            entry["pooled_std"] = pooled
        entry.update(res.extras.get((src, var), {}))
        out.setdefault(str(src), {})[var] = entry
    return out


# ------------------------------------------------------------------------------------------ records
def encode_samples(
    data_sources: Sequence[Any],
    sample_inputs: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    sample_turns: Sequence[Any] = (),
    *,
    digest_prompts: bool = False,
    exact: bool = False,
    style: str = "seed",
    seed: int = 42,
    expected_counts: Mapping[tuple[Any, Any], int] | None = None,
    nan_strategy: str = "propagate",
) -> dict[str, Any]:
    """One rank's validation samples as a compact record (plain dict of numpy arrays and lists):

    - ``sources``: data source names in order of first appearance;
    - ``prompts``, ``group_source`` (int32): one entry per ``(data_source, prompt)`` group in order of
      first appearance: the prompt (its 16-byte blake2b digest with ``digest_prompts=True``) and the
      index of its data source;
    - ``group`` (int32, one per sample): the sample's group;
    - ``values``: ``{var: float64 array}`` in ``infos_dict`` order, NaN where a value is not a number,
      ``None`` when no value is; ``numeric``: ``{var: bool array}`` only for variables that mix numbers
      and non-numbers (which samples are numbers);
    - ``pred`` (int32 codes) and ``pred_table`` (distinct preds, order of first appearance), when
      ``infos_dict`` has ``pred`` (preds are compared as dict keys, as the seed does);
    - ``turns``: the turn counts (float64);
    - ``exact``: whether :func:`process_samples` of the merged records adds the ``exact=True`` keys;
    - ``none``: ``{var: bool array}`` for variables with ``None`` values (which samples are None);
    - ``style`` (:data:`STYLES`), ``seed`` (of the bootstrap) and ``expected``: ``(data_source, prompt,
      count)`` triples of ``expected_counts`` (verl's ``expected_acc_counts``, keyed by
      ``(data_source, prompt)``), which only the ``"verl"`` style reads.

    Non-finite numbers (NaN, inf) follow ``nan_strategy``: ``"propagate"`` keeps them (they reach the
    metrics as in the seed), ``"drop"`` leaves out every sample that has one (in any variable, with
    its turn count when ``sample_turns`` has one per sample; and non-finite turn counts),
    ``"error"`` raises :class:`~rlmetrics.stat.MetricValueError` naming the variable.

    >>> r = encode_samples(["a", "b", "a"], ["p", "p", "p"], {"acc": [1, 0, 1], "pred": ["x", "y", "x"]})
    >>> r["sources"], r["group"].tolist(), r["values"]["pred"], r["pred"].tolist(), r["pred_table"]
    (['a', 'b'], [0, 1, 0], None, [0, 1, 0], ['x', 'y'])
    >>> encode_samples(["a", "a"], ["p", "p"], {"acc": [1.0, float("nan")]}, nan_strategy="drop")["group"]
    array([0], dtype=int32)
    """
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    n = len(data_sources)
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if len(sample_inputs) != n:
        raise ValueError(f"{len(sample_inputs)} sample_inputs for {n} data_sources")
    for var, col in infos_dict.items():
        if len(col) != n:
            raise ValueError(f"infos_dict[{var!r}] has {len(col)} values for {n} samples")
    if nan_strategy != "propagate":
        keep, turns = _finite_samples(infos_dict, n, _turns_array(sample_turns), nan_strategy)
        if keep is not None or turns is not None:
            sel = np.ones(n, bool) if keep is None else keep
            return encode_samples(
                [v for v, k in zip(data_sources, sel) if k],
                [v for v, k in zip(sample_inputs, sel) if k],
                {var: [v for v, k in zip(col, sel) if k] for var, col in infos_dict.items()},
                sample_turns if turns is None else turns,
                digest_prompts=digest_prompts,
                exact=exact,
                style=style,
                seed=seed,
                expected_counts=expected_counts,
            )
    groups: dict[tuple[Any, Any], int] = {}
    codes = [groups.setdefault(key, len(groups)) for key in zip(data_sources, sample_inputs)]
    sources: dict[Any, int] = {}
    group_source = [sources.setdefault(src, len(sources)) for src, _ in groups]
    prompts = [_digest(p) if digest_prompts else p for _, p in groups]
    values: dict[str, np.ndarray | None] = {}
    numeric: dict[str, np.ndarray] = {}
    none: dict[str, np.ndarray] = {}
    for var, col in infos_dict.items():
        vals, mask, nones = _numeric_column(col, var)
        values[var] = vals
        if mask is not None:
            numeric[var] = mask
        if nones is not None:
            none[var] = nones
    record: dict[str, Any] = {
        "version": RECORD_VERSION,
        "sources": list(sources),
        "prompts": prompts,
        "group_source": np.asarray(group_source, dtype=np.int32),
        "group": np.asarray(codes, dtype=np.int32),
        "values": values,
        "numeric": numeric,
        "pred": None,
        "pred_table": [],
        "turns": _turns_array(sample_turns),
        "exact": bool(exact),
        "none": none,
        "style": style,
        "seed": int(seed),
        "expected": [
            (src, _digest(p) if digest_prompts else p, int(c))
            for (src, p), c in (expected_counts or {}).items()
        ],
    }
    if "pred" in infos_dict:
        col = infos_dict["pred"]
        table: dict[Any, int] = {}
        items = col.tolist() if isinstance(col, np.ndarray) else col
        record["pred"] = np.asarray([table.setdefault(v, len(table)) for v in items], dtype=np.int32)
        record["pred_table"] = list(table)
    return record


def merge_samples(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Concatenate records in the given order (rank order): the samples of record 0, then record 1, ...

    The merged record equals :func:`encode_samples` of the concatenated inputs, so the order of the
    samples within a prompt, which best/worst/maj depend on, is that of the concatenation. Records
    without samples are ignored; the others must have the same variables (and all or none a pred).

    >>> r0 = encode_samples(["a", "a"], ["p", "q"], {"acc": [1.0, 0.0]})
    >>> r1 = encode_samples(["a", "b"], ["q", "p"], {"acc": [1.0, 1.0]})
    >>> m = merge_samples([r0, r1])
    >>> m["sources"], m["prompts"], m["group"].tolist(), m["values"]["acc"].tolist()
    (['a', 'b'], ['p', 'q', 'p'], [0, 1, 1, 2], [1.0, 0.0, 1.0, 1.0])
    """
    records = [r for r in records]
    for r in records:
        if r.get("version") != RECORD_VERSION:
            raise ValueError(f"unknown validation record version {r.get('version')!r}")
    settings = {(r.get("style", "seed"), r.get("seed", 42)) for r in records}
    if len(settings) > 1:
        raise ValueError(f"records of different styles or seeds: {sorted(settings)}")
    style, seed = settings.pop() if settings else ("seed", 42)
    common = {
        "style": style,
        "seed": seed,
        "expected": [triple for r in records for triple in r.get("expected", ())],
        "turns": _concat([r["turns"] for r in records], np.float64),
        "exact": any(r.get("exact", False) for r in records),
    }
    full = [r for r in records if len(r["group"])]
    if not full:
        base = dict(records[0]) if records else encode_samples([], [], {})
        return {**base, **common}
    variables = list(full[0]["values"])
    has_pred = full[0]["pred"] is not None
    for r in full[1:]:
        if set(r["values"]) != set(variables):
            raise ValueError(f"records have different variables: {variables} vs {list(r['values'])}")
        if (r["pred"] is not None) != has_pred:
            raise ValueError("some records have a 'pred' variable and some do not")

    sources: dict[Any, int] = {}
    groups: dict[tuple[Any, Any], int] = {}
    preds: dict[Any, int] = {}
    prompts: list[Any] = []
    group_source: list[int] = []
    group_parts, pred_parts = [], []
    for r in full:
        src_map = [sources.setdefault(s, len(sources)) for s in r["sources"]]
        group_map = np.empty(len(r["prompts"]), dtype=np.int64)
        for g, (s, prompt) in enumerate(zip(r["group_source"].tolist(), r["prompts"])):
            key = (r["sources"][s], prompt)
            code = groups.get(key)
            if code is None:
                code = groups[key] = len(groups)
                prompts.append(prompt)
                group_source.append(src_map[s])
            group_map[g] = code
        group_parts.append(group_map[r["group"]])
        if has_pred:
            pred_map = np.asarray([preds.setdefault(v, len(preds)) for v in r["pred_table"]], dtype=np.int64)
            pred_parts.append(pred_map[r["pred"]] if len(pred_map) else np.zeros(0, np.int64))

    values: dict[str, np.ndarray | None] = {}
    numeric: dict[str, np.ndarray] = {}
    none: dict[str, np.ndarray] = {}
    sizes = [len(r["group"]) for r in full]
    for var in variables:
        if any(var in r.get("none", {}) for r in full):
            none[var] = _concat(
                [r.get("none", {}).get(var, np.zeros(n, bool)) for r, n in zip(full, sizes)], bool
            )
        cols = [r["values"][var] for r in full]
        if all(c is None for c in cols):
            values[var] = None
            continue
        values[var] = _concat(
            [np.full(n, np.nan) if c is None else c for c, n in zip(cols, sizes)], np.float64
        )
        if any(c is None or var in r["numeric"] for c, r in zip(cols, full)):
            masks = [
                np.zeros(n, bool) if c is None else r["numeric"].get(var, np.ones(n, bool))
                for c, r, n in zip(cols, full, sizes)
            ]
            numeric[var] = _concat(masks, np.bool_)
    return {
        "version": RECORD_VERSION,
        "sources": list(sources),
        "prompts": prompts,
        "group_source": np.asarray(group_source, dtype=np.int32),
        "group": _concat(group_parts, np.int32),
        "values": values,
        "numeric": numeric,
        "pred": _concat(pred_parts, np.int32) if has_pred else None,
        "pred_table": list(preds),
        "none": none,
        **common,
    }


def process_samples(
    record: Mapping[str, Any],
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
    res = _compute(record, record.get("seed", 42) if seed is None else seed, n_bootstrap, exact)
    out: dict[str, float] = {}
    for (src, var), metrics in res.metrics.items():
        core = "acc" if (src, "acc") in res.metrics else "reward"
        n_max = res.n_max[(src, var)]
        for name, value in metrics.items():
            is_core = var == core and name.startswith(("mean", "maj", "best")) and _at_n(name) == n_max
            out[f"{'val-core' if is_core else 'val-aux'}/{src}/{var}/{name}"] = value
        for name, value in res.extras.get((src, var), {}).items():
            out[f"val-aux/{src}/{var}/{name}"] = value
    turns = np.asarray(record["turns"], dtype=np.float64)
    if len(turns):
        out["val-aux/num_turns/min"] = float(turns.min())
        out["val-aux/num_turns/max"] = float(turns.max())
        out["val-aux/num_turns/mean"] = float(turns.mean())
    out.update({f"val/test_score/{src}": v for src, v in res.test_score.items()})
    return out


def samples_by_source(
    record: Mapping[str, Any],
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
    res = _compute(record, record.get("seed", 42) if seed is None else seed, n_bootstrap, exact)
    out: dict[Any, dict[str, dict[str, float]]] = {}
    for (src, var), metrics in res.metrics.items():
        out.setdefault(src, {})[var] = {**metrics, **res.extras.get((src, var), {})}
    return out


def pass_at_k(n: int, c: np.ndarray | int, k: int) -> np.ndarray:
    """Unbiased pass@k (Chen et al. 2021): ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct of ``n``
    samples, as the product ``prod_{i<k} (n - c - i) / (n - i)`` (no large binomials).

    >>> pass_at_k(10, np.array([0, 1, 5, 10]), 3).round(6).tolist()
    [0.0, 0.3, 0.916667, 1.0]
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    table = np.ones(n + 1)
    miss = np.arange(n, -1, -1, dtype=np.float64)  # n - c for c = 0..n
    for i in range(k):
        table *= np.clip(miss - i, 0.0, None) / (n - i)
    return 1.0 - table[np.asarray(c, dtype=np.intp)]


# ------------------------------------------------------------------------------------------ internals
def _digest(prompt: Any) -> bytes:
    text = prompt if isinstance(prompt, bytes) else str(prompt).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=16).digest()


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _turns_array(sample_turns: Any) -> np.ndarray:
    if isinstance(sample_turns, np.ndarray):
        return sample_turns.astype(np.float64).ravel()
    if len(sample_turns) == 0:
        return np.zeros(0)
    return np.concatenate([np.asarray(t, dtype=np.float64).ravel() for t in sample_turns])


def _finite_samples(
    infos_dict: Mapping[str, Sequence[Any]], n: int, turns: np.ndarray, nan_strategy: str
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Samples to keep and turn counts under ``"drop"`` (None: all), or raise under ``"error"``."""
    keep = np.ones(n, bool)
    for var, col in infos_dict.items():
        vals, numeric, _ = _numeric_column(col, var)
        if vals is None:
            continue
        bad = ~np.isfinite(vals) if numeric is None else numeric & ~np.isfinite(vals)
        if bad.any() and nan_strategy == "error":
            raise MetricValueError(
                f"validation variable {var!r}: {int(bad.sum())} non-finite value(s) (nan_strategy='error')"
            )
        keep &= ~bad
    bad_turns = ~np.isfinite(turns)
    if bad_turns.any() and nan_strategy == "error":
        raise MetricValueError(
            f"validation turns: {int(bad_turns.sum())} non-finite value(s) (nan_strategy='error')"
        )
    if keep.all() and not bad_turns.any():
        return None, None
    if len(turns) == n:  # one turn count per sample: it goes with its sample
        bad_turns |= ~keep
    return (None if keep.all() else keep), turns[~bad_turns]


def record_digest(record: Mapping[str, Any]) -> str:
    """A hash of a record's content (independent of when or where it was made): the order of
    records from clients without a rank.

    >>> a = encode_samples(["s"], ["p"], {"acc": [1.0]})
    >>> record_digest(a) == record_digest(encode_samples(["s"], ["p"], {"acc": [1.0]}))
    True
    >>> record_digest(a) == record_digest(encode_samples(["s"], ["p"], {"acc": [0.0]}))
    False
    """
    h = hashlib.blake2b(digest_size=16)

    def add(x: Any) -> None:
        if isinstance(x, np.ndarray):
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        else:
            h.update(repr(x).encode("utf-8", "surrogatepass"))
        h.update(b"\0")

    for key in ("sources", "prompts", "group_source", "group", "pred", "pred_table", "turns"):
        add(record[key])
    for var, vals in record["values"].items():
        add(var)
        add(vals)
        add(record["numeric"].get(var))
    return h.hexdigest()


def _is_number(v: Any) -> bool:
    return isinstance(v, (numbers.Real, np.bool_)) and not isinstance(v, str)


def _numeric_column(col: Any, var: str) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(float64 values with NaN for non-numbers or None if there is no number, mask of numbers or None
    if all are numbers, mask of ``None`` values or None if there is none)."""
    if isinstance(col, np.ndarray) and col.dtype.kind in "biuf":
        return col.astype(np.float64).ravel(), None, None
    if isinstance(col, np.ndarray) and col.dtype.kind in "US":
        return None, None, None
    items = col.tolist() if isinstance(col, np.ndarray) else col
    if len(items) and isinstance(items[0], str) and all(isinstance(v, str) for v in items):
        return None, None, None  # the common case of a string column (pred)
    try:
        arr = np.asarray(items)
    except ValueError:  # ragged
        arr = np.asarray(items, dtype=object)
    if arr.dtype.kind in "biuf" and arr.ndim == 1:
        return arr.astype(np.float64), None, None
    nones = np.fromiter((v is None for v in items), dtype=bool, count=len(items))
    nones = nones if nones.any() else None
    mask = np.fromiter((_is_number(v) for v in items), dtype=bool, count=len(items))
    if not mask.any():
        return None, None, nones
    vals = np.full(len(items), np.nan)
    vals[mask] = [float(v) for v, ok in zip(items, mask) if ok]
    return vals, mask, nones


def _float_array_or_none(data: Sequence[Any]) -> np.ndarray | None:
    if isinstance(data, np.ndarray):
        return data.astype(np.float64) if data.dtype.kind in "biuf" and data.ndim == 1 else None
    if not all(_is_number(v) for v in data):
        return None
    return np.asarray(data, dtype=np.float64)


def _at_n(name: str) -> int:
    return int(name.split("@")[-1].split("/")[0])


class _Sums:
    """Per data source sums and counts of per-prompt values, keyed by (var, metric name)."""

    def __init__(self, n_sources: int) -> None:
        self.n = n_sources
        self.data: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    def add(self, var: str, name: str, src: np.ndarray, values: np.ndarray) -> None:
        entry = self.data.get((var, name))
        if entry is None:
            entry = self.data[(var, name)] = (np.zeros(self.n), np.zeros(self.n))
        entry[0][:] += np.bincount(src, weights=values, minlength=self.n)
        entry[1][:] += np.bincount(src, minlength=self.n)

    def mean(self, var: str, name: str, s: int) -> float | None:
        entry = self.data.get((var, name))
        if entry is None or entry[1][s] == 0:
            return None
        return float(entry[0][s] / entry[1][s])


class _Result:
    def __init__(self) -> None:
        self.metrics: dict[tuple[Any, str], dict[str, float]] = {}  # the seed's names, in its order
        self.extras: dict[tuple[Any, str], dict[str, float]] = {}
        self.n_max: dict[tuple[Any, str], int] = {}
        self.pooled_std: dict[tuple[Any, str], float] = {}
        self.test_score: dict[Any, float] = {}


def _seed_names(n: int, has_pred: bool) -> list[str]:
    names = [f"mean@{n}"]
    if n > 1:
        names.append(f"std@{n}")
    for k in bootstrap_sizes(n):
        names += [f"best@{k}/mean", f"best@{k}/std", f"worst@{k}/mean", f"worst@{k}/std"]
        if has_pred:
            names += [f"maj@{k}/mean", f"maj@{k}/std"]
    return names


def _extra_names(n: int, has_pred: bool) -> list[str]:
    names = [f"pass@{k}" for k in (1, *bootstrap_sizes(n))]
    for k in bootstrap_sizes(n):
        for metric in ("best", "worst", "maj") if has_pred else ("best", "worst"):
            names += [f"{metric}@{k}/exact_mean", f"{metric}@{k}/exact_std"]
    return names


@dataclass
class _View:
    """Samples as the metrics group them: one slot per value, in input order within a group.

    The seed's style has one view of all samples. verl's drops None values per prompt and variable,
    so variables with different None patterns see different slots (:func:`_verl_views`); variables
    with the same slots share a view, hence one majority-vote computation.
    """

    group: np.ndarray  # (slots,) group of each slot
    values: dict[str, np.ndarray]  # float64 per slot
    numeric: dict[str, np.ndarray]  # which slots hold numbers, for variables mixing non-numbers
    pred: np.ndarray | None = None  # pred code per slot: maj@k is computed when given
    vote: np.ndarray | None = None  # per group: whether its prompts vote (None: all of them)


def _seed_view(record: Mapping[str, Any]) -> _View:
    pred = record.get("pred")
    return _View(
        group=np.asarray(record["group"], dtype=np.intp),
        values={v: vals for v, vals in record["values"].items() if vals is not None},
        numeric=record.get("numeric", {}),
        pred=None if pred is None else np.asarray(pred, dtype=np.intp),
    )


def _verl_views(record: Mapping[str, Any]) -> tuple[list[_View], np.ndarray, list[str]]:
    """verl's grouping of a record: per prompt and variable, its values that are not None, in order.

    With ``expected`` (verl's ``expected_acc_counts``; only for data sources where some ``acc`` is
    not None): ``acc_success_only`` holds the prompt's ``acc`` values, and ``acc`` is padded with
    zeros up to the expected count (a prompt without samples gets one). A prompt votes (maj@k) for a
    variable when none of its preds is None and the variable kept as many values as the prompt has
    samples; the variable's i-th value then pairs with the prompt's i-th pred, as verl's ``zip``.
    Returns the views, the groups' data sources (new prompts appended) and the variables in order.
    """
    group = np.asarray(record["group"], dtype=np.intp)
    group_source = np.asarray(record["group_source"], dtype=np.intp)
    values, numeric, none = record["values"], record.get("numeric", {}), record.get("none", {})
    expected = _expected_counts(record, group, group_source)
    if expected and "acc_success_only" in values:
        raise ValueError(
            "'acc_success_only' is computed from 'acc' with expected counts; rename the variable"
        )
    group_source = np.concatenate([group_source, np.asarray([s for _, s in expected.get(None, [])], np.intp)])
    expected.pop(None, None)
    raw = np.bincount(group, minlength=len(group_source))
    order = np.argsort(group, kind="stable")
    starts = np.concatenate([[0], np.cumsum(raw)[:-1]]).astype(np.intp)
    pred = record.get("pred")
    vote_ok = None
    if pred is not None:
        none_codes = [i for i, p in enumerate(record["pred_table"]) if p is None]
        bad = np.isin(pred, none_codes)
        vote_ok = (np.bincount(group, weights=bad, minlength=len(group_source)) == 0) & (raw > 0)

    def view(slot_sample: np.ndarray, slot_group: np.ndarray, names: list[tuple[str, str]]) -> _View:
        real = slot_sample >= 0  # the others are zeros that pad acc
        src = slot_sample[real]
        vals, nums = {}, {}
        for name, var in names:
            col = values[var]
            vals[name] = np.zeros(len(slot_sample))
            vals[name][real] = np.nan if col is None else col[src]
            if col is None or var in numeric:
                nums[name] = np.ones(len(slot_sample), bool)
                nums[name][real] = False if col is None else numeric[var][src]
        out = _View(slot_group, vals, nums)
        if pred is not None:
            ordered = np.argsort(slot_group, kind="stable")
            size = np.bincount(slot_group, minlength=len(group_source))
            rank = np.empty(len(slot_group), np.intp)
            rank[ordered] = np.arange(len(slot_group)) - (np.cumsum(size) - size)[slot_group[ordered]]
            codes = np.full(len(slot_group), -1, np.intp)
            inside = np.flatnonzero(rank < raw[slot_group])
            codes[inside] = pred[order[starts[slot_group[inside]] + rank[inside]]]
            out.pred, out.vote = codes, vote_ok & (size == raw)
        return out

    views: list[_View] = []
    shared: dict[bytes, list[tuple[str, str]]] = {}
    everyone = np.arange(len(group))
    for var in values:
        present = ~none[var] if var in none else None
        if values[var] is None and not (var == "acc" and expected):
            continue  # no number: never used
        if var == "acc" and expected:
            kept = everyone if present is None else np.flatnonzero(present)
            seen = np.bincount(group[kept], minlength=len(group_source))
            gs = np.fromiter(expected, np.intp, len(expected))
            pad = np.maximum(np.fromiter(expected.values(), np.int64, len(expected)) - seen[gs], 0)
            padded = np.concatenate([kept, np.full(int(pad.sum()), -1)])
            views.append(view(padded, np.concatenate([group[kept], np.repeat(gs, pad)]), [("acc", "acc")]))
            success = kept[np.isin(group[kept], gs)]
            views.append(view(success, group[success], [("acc_success_only", "acc")]))
            continue
        shared.setdefault(b"" if present is None else present.tobytes(), []).append((var, var))
    for key, names in shared.items():
        kept = everyone if not key else np.flatnonzero(np.frombuffer(key, dtype=bool))
        views.append(view(kept, group[kept], names))
    order_out = [*values, *(["acc_success_only"] if expected and "acc" in values else [])]
    return views, group_source, order_out


def _expected_counts(record: Mapping[str, Any], group: np.ndarray, group_source: np.ndarray) -> dict:
    """``{group: expected count}`` of the record's ``expected`` triples whose data source has an
    ``acc`` that is not None (the largest count where ranks name a prompt twice); under the key None
    the ``(prompt, source index)`` of prompts without samples, which become new groups."""
    triples = record.get("expected") or []
    if not triples or "acc" not in record["values"]:
        return {}
    sources = record["sources"]
    not_none = ~record.get("none", {}).get("acc", np.zeros(len(group), bool))
    acc_sources = {sources[s] for s in np.unique(group_source[group[not_none]]).tolist()}
    index = {(sources[s], p): g for g, (s, p) in enumerate(zip(group_source.tolist(), record["prompts"]))}
    source_index = {src: s for s, src in enumerate(sources)}
    out: dict[Any, Any] = {}
    new: list[tuple[Any, int]] = []
    for src, prompt, count in triples:
        if src not in acc_sources:
            continue
        g = index.get((src, prompt))
        if g is None:
            g = index[(src, prompt)] = len(group_source) + len(new)
            new.append((prompt, source_index[src]))
        out[g] = max(out.get(g, 0), int(count))
    if new:
        out[None] = new
    return out


def _compute(record: Mapping[str, Any], seed: int, n_bootstrap: int, exact: bool) -> _Result:
    sources = record["sources"]
    n_src = len(sources)
    verl = record.get("style", "seed") == "verl"
    if verl:
        views, group_source, variables = _verl_views(record)
    else:
        views, group_source = [_seed_view(record)], np.asarray(record["group_source"], dtype=np.intp)
        variables = list(views[0].values)
    run = _Run(group_source, _Sums(n_src), seed, n_bootstrap, exact)
    run.pooled = {v: (np.zeros(n_src), np.zeros(n_src)) for v in variables}
    run.binary = {v: np.zeros(n_src) for v in variables}
    per_var: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # used groups and group sizes
    for view in views:
        per_var.update(_add_view(view, run))
    sums, pooled, binary = run.sums, run.pooled, run.binary

    res = _Result()
    for s, src_name in enumerate(sources):
        in_src = group_source == s
        for v in variables:
            if v not in per_var:
                continue
            used, counts = per_var[v]
            sel = np.flatnonzero(in_src & used)
            if not len(sel):
                continue
            seq = counts[sel]
            ns = seq[np.sort(np.unique(seq, return_index=True)[1])].tolist()  # order of first appearance
            key = (src_name, v)
            res.n_max[key] = max(ns)
            metrics = res.metrics[key] = {}
            for n in ns:
                for name in _seed_names(n, True):
                    value = sums.mean(v, name, s)
                    if name not in metrics and value is not None:  # maj: where prompts voted
                        metrics[name] = value
            if pooled[v][1][s] > 0:
                res.pooled_std[key] = float(np.sqrt(pooled[v][0][s] / pooled[v][1][s]))
            if exact:
                extras = res.extras[key] = {}
                for n in ns:
                    for name in _extra_names(n, True):
                        if name.startswith("pass@") and binary[v][s] > 0:
                            continue
                        value = sums.mean(v, name, s)
                        if name not in extras and value is not None:
                            extras[name] = value
    reward = record["values"].get("reward")
    if reward is not None and not verl:
        group = np.asarray(record["group"], dtype=np.intp)
        masks = record.get("numeric", {})
        sample_src = group_source[group]
        weight = masks["reward"].astype(np.float64) if "reward" in masks else np.ones(len(reward))
        total = np.bincount(sample_src, weights=reward, minlength=n_src)
        size = np.bincount(sample_src, minlength=n_src)
        numbers_in = np.bincount(sample_src, weights=weight, minlength=n_src)
        for s, src_name in enumerate(sources):
            if numbers_in[s] > 0:
                res.test_score[src_name] = float(total[s] / size[s])
    return res


@dataclass
class _Run:
    """One computation: the groups' data sources, its settings, and what the views add up."""

    group_source: np.ndarray
    sums: _Sums
    seed: int
    n_bootstrap: int
    exact: bool
    pooled: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # sum of squares, dof
    binary: dict[str, np.ndarray] = field(default_factory=dict)  # prompts with a value outside {0, 1}


def _add_view(view: _View, run: _Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Add the per-prompt metrics of a view to ``run``; return per variable the groups that use it
    and the group sizes."""
    n_groups = len(run.group_source)
    counts = np.bincount(view.group, minlength=n_groups)
    order = np.argsort(view.group, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.intp)
    has = counts > 0
    first = order[np.minimum(starts, max(len(order) - 1, 0))] if len(order) else starts
    # a variable counts for a prompt when the prompt's first value is a number
    used = {v: has & (view.numeric[v][first] if v in view.numeric else True) for v in view.values}
    for v, mask in view.numeric.items():
        bad = int((used[v][view.group] & ~mask).sum())
        if bad:
            logger.warning("validation variable %r: %d non-numeric values counted as NaN", v, bad)
    for n in np.unique(counts[has]).tolist():
        gids = np.flatnonzero(counts == n)
        rows = order[starts[gids][:, None] + np.arange(n)]  # (P, n) slots, input order
        votes = np.full(len(gids), view.pred is not None)
        if view.pred is not None and view.vote is not None:
            votes = view.vote[gids]
        for sel, voting in ((votes, True), (~votes, False)):
            if sel.any():
                _add_prompts(view, gids[sel], rows[sel], voting, used, run)
    return {v: (used[v], counts) for v in view.values}


def _add_prompts(
    view: _View, gids: np.ndarray, rows: np.ndarray, voting: bool, used: dict[str, np.ndarray], run: _Run
) -> None:
    """The metrics of prompts with ``n`` slots each (``rows``, ``(P, n)``), maj@k when ``voting``."""
    n_src, n = run.sums.n, rows.shape[1]
    pooled, binary = run.pooled, run.binary
    dense = n_classes = None
    if voting and view.pred is not None:
        dense, n_classes = _dense_codes(view.pred[rows])
        perm = np.argsort(n_classes, kind="stable")  # similar class counts share a chunk
        gids, rows, dense, n_classes = gids[perm], rows[perm], dense[perm], n_classes[perm]
    src = run.group_source[gids]
    keep = {v: used[v][gids] for v in view.values}
    mats = {v: vals[rows] for v, vals in view.values.items() if keep[v].any()}
    per_prompt: dict[tuple[str, str], np.ndarray] = {}
    for v, mat in mats.items():
        per_prompt[(v, f"mean@{n}")] = mat.mean(axis=1)
        if n > 1:
            std = mat.std(axis=1)
            per_prompt[(v, f"std@{n}")] = std
            ss = np.bincount(src[keep[v]], weights=(std**2 * n)[keep[v]], minlength=n_src)
            pooled[v][0][:] += ss
            pooled[v][1][:] += np.bincount(src[keep[v]], minlength=n_src) * (n - 1)
    if n > 1:
        per_prompt.update(_bootstrap_group(mats, dense, n_classes, n, run.seed, run.n_bootstrap))
    if run.exact:
        per_prompt.update(_exact_group(mats, dense, n_classes, n))
        for v, mat in mats.items():
            nonbinary = ~np.all((mat == 0) | (mat == 1), axis=1)
            binary[v] += np.bincount(src[keep[v]], weights=nonbinary[keep[v]], minlength=n_src)
    for (v, name), vals in per_prompt.items():
        run.sums.add(v, name, src[keep[v]], vals[keep[v]])


def _dense_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, codes relabelled 0..d-1 (d = distinct codes of the row), and d per row."""
    srt = np.argsort(codes, axis=1, kind="stable")
    vals = np.take_along_axis(codes, srt, axis=1)
    new = np.ones(vals.shape, dtype=bool)
    new[:, 1:] = vals[:, 1:] != vals[:, :-1]
    rank = np.cumsum(new, axis=1) - 1
    dense = np.empty_like(rank)
    np.put_along_axis(dense, srt, rank, axis=1)
    return dense, rank[:, -1] + 1


def _bootstrap_group(
    mats: dict[str, np.ndarray],
    dense: np.ndarray | None,
    n_classes: np.ndarray | None,
    n: int,
    seed: int,
    n_bootstrap: int,
) -> dict[tuple[str, str], np.ndarray]:
    """best/worst/maj @k mean and std per prompt for prompts with ``n`` samples (rows of ``mats``).

    Each comes from how many bootstrap rows take each of a prompt's values (:func:`_row_stats`):
    best/worst from the subset-count tables of :func:`_miss_table` for ``n <= TABLE_MAX_N``
    (prompts with a NaN, which makes numpy's max and min NaN, and larger ``n``: by gathering
    every row), maj from the winners of the vote in every row (:func:`_winner_histogram`).
    """
    out: dict[tuple[str, str], np.ndarray] = {}
    if not mats:
        return out
    ranked = {v: _ranked(mat) for v, mat in mats.items()} if n <= TABLE_MAX_N else {}
    for k in bootstrap_sizes(n):
        idx = _indices(n, k, n_bootstrap, seed)
        for v, mat in mats.items():
            if v in ranked:
                stats = _extremes_by_table(*ranked[v], _miss_table(n, k, n_bootstrap, seed), n_bootstrap)
                nan_rows = np.flatnonzero(np.isnan(mat).any(axis=1))
                if len(nan_rows):
                    for whole, part in zip(stats, _extremes_by_rows(mat[nan_rows], idx)):
                        whole[nan_rows] = part
            else:
                stats = _extremes_by_rows(mat, idx)
            for (name, stat), values in zip(_EXTREMES, stats):
                out[(v, f"{name}@{k}/{stat}")] = values
        if dense is not None and n_classes is not None:
            winners = _winner_histogram(dense, n_classes, idx, n, seed)
            for v, mat in mats.items():
                out[(v, f"maj@{k}/mean")], out[(v, f"maj@{k}/std")] = _row_stats(mat, winners, n_bootstrap)
    return out


def _row_stats(x: np.ndarray, rows: np.ndarray, n_bootstrap: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and population std over the bootstrap rows of a statistic that ``rows[p, j]`` rows of
    prompt ``p`` take as ``x[p, j]`` (a value no row takes plays no part, a NaN neither)."""
    taken = rows > 0
    with np.errstate(invalid="ignore"):
        mean = np.where(taken, rows * x, 0.0).sum(axis=1) / n_bootstrap
        dev = np.where(taken, x - mean[:, None], 0.0)
        return mean, np.sqrt((rows * dev * dev).sum(axis=1) / n_bootstrap)


def _ranked(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt: its values in ascending order, and the bitmasks of the positions of rank at most
    / at least each rank (the positions of the smallest 1, 2, ... values; of the largest ...)."""
    order = np.argsort(mat, axis=1, kind="stable")
    bits = np.left_shift(np.int64(1), order)
    below = np.bitwise_or.accumulate(bits, axis=1)
    above = np.bitwise_or.accumulate(bits[:, ::-1], axis=1)[:, ::-1]
    return np.take_along_axis(mat, order, axis=1), below, above


def _extremes_by_table(
    srt: np.ndarray, below: np.ndarray, above: np.ndarray, miss: np.ndarray, n_bootstrap: int
) -> list[np.ndarray]:
    """best mean, best std, worst mean, worst std per prompt: the rows whose maximum has rank ``i``
    are those that draw a position of rank >= i minus those that draw one of rank >= i + 1."""
    reach_up = n_bootstrap - miss[above]  # rows drawing a position of rank >= i
    reach_down = n_bootstrap - miss[below]  # rows drawing a position of rank <= i
    zero = np.zeros((len(srt), 1), np.int64)
    top = reach_up - np.concatenate([reach_up[:, 1:], zero], axis=1)
    bottom = reach_down - np.concatenate([zero, reach_down[:, :-1]], axis=1)
    return [*_row_stats(srt, top, n_bootstrap), *_row_stats(srt, bottom, n_bootstrap)]


def _extremes_by_rows(mat: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """best mean, best std, worst mean, worst std per prompt by gathering every bootstrap row (numpy's
    max and min per row, NaN included), in chunks of prompts."""
    n_prompts, k = len(mat), idx.shape[1]
    out = [np.empty(n_prompts) for _ in range(4)]
    chunk = max(1, CHUNK_BYTES // (8 * len(idx) * 8))
    idx_t = np.ascontiguousarray(idx.T)
    transposed = np.ascontiguousarray(mat.T)  # (n, P): a sample is a row
    for lo in range(0, n_prompts, chunk):
        hi = min(n_prompts, lo + chunk)
        x = np.ascontiguousarray(transposed[:, lo:hi])
        best = np.take(x, idx_t[0], axis=0)
        worst = best.copy()
        buf = np.empty_like(best)
        for t in range(1, k):
            np.take(x, idx_t[t], axis=0, out=buf)
            np.maximum(best, buf, out=best)
            np.minimum(worst, buf, out=worst)
        for i, rows in enumerate((best, worst)):
            out[2 * i][lo:hi] = rows.mean(axis=0)
            out[2 * i + 1][lo:hi] = rows.std(axis=0)
    return out


@functools.lru_cache(maxsize=64)
def _indices(n: int, k: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """:func:`bootstrap_indices`, drawn once per shape (read-only)."""
    idx = bootstrap_indices(n, k, n_bootstrap, seed)
    idx.flags.writeable = False
    return idx


@functools.lru_cache(maxsize=64)
def _miss_table(n: int, k: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """``miss[M]``: how many bootstrap rows draw no position of the bitmask ``M`` (for every ``M`` of
    ``n`` bits). The rows whose set of positions lies within each ``S`` are counted by a sum over
    subsets (one pass per bit), and a row misses ``M`` when its set lies within the complement."""
    idx = _indices(n, k, n_bootstrap, seed)
    within = np.bincount(np.bitwise_or.reduce(np.left_shift(np.int64(1), idx), axis=1), minlength=1 << n)
    for bit in range(n):
        pairs = within.reshape(-1, 2, 1 << bit)
        pairs[:, 1] += pairs[:, 0]
    miss = np.ascontiguousarray(within[::-1])  # complement of M: (2**n - 1) - M
    miss.flags.writeable = False
    return miss


def _winner_histogram(
    dense: np.ndarray, n_classes: np.ndarray, idx: np.ndarray, n: int, seed: int
) -> np.ndarray:
    """``(P, n)``: per prompt, how many bootstrap rows the maj@k vote reports the value at each
    position. With ``k == 2`` the first draw always wins (a pair agrees, or ties and the first
    seen wins), whatever the preds."""
    n_boot, k = idx.shape
    if k == 2:
        first = np.bincount(idx[:, 0], minlength=n).astype(np.float64)
        return np.broadcast_to(first, (len(dense), n))
    words = _words(n, k, n_boot, seed)
    out = np.empty((len(dense), n))
    chunk = max(1, CHUNK_BYTES // (8 * n_boot * 2))
    for lo in range(0, len(dense), chunk):
        hi = min(len(dense), lo + chunk)
        winners = _majority_winners(dense[lo:hi], n_classes[lo:hi], words, idx)  # (m, n_bootstrap)
        flat = (winners + n * np.arange(hi - lo)[:, None]).ravel()
        out[lo:hi] = np.bincount(flat, minlength=(hi - lo) * n).reshape(hi - lo, n)
    return out


@functools.lru_cache(maxsize=64)
def _words(n: int, k: int, n_bootstrap: int, seed: int) -> list[np.ndarray]:
    """:func:`_tie_words` of the bootstrap indices, once per shape."""
    return _tie_words(_indices(n, k, n_bootstrap, seed), n)


def _tie_words(idx: np.ndarray, n: int) -> list[np.ndarray]:
    """``(n_bootstrap, n)`` matrices whose product with a one-hot class matrix gives, per row and class,
    ``count * 2**w + sum of 2**(w - 1 - t)`` over the class's positions ``t < w`` (then one word per
    further ``w`` positions): exact integers, ordered as (count, earliest position). For ``k`` up to
    :data:`_SHORT_K` draws, one float32 word of ``w = k`` bits; beyond, float64 words of 32 bits."""
    n_boot, k = idx.shape
    width, dtype = (k, np.float32) if k <= _SHORT_K else (_WORD, np.float64)
    flat = (np.arange(n_boot)[:, None] * n + idx).ravel()
    count = np.bincount(flat, minlength=n_boot * n).reshape(n_boot, n).astype(np.float64)
    weight = np.ldexp(1.0, width - 1 - np.arange(k) % width)
    word_of = np.arange(k) // width
    words = []
    for w in range(word_of[-1] + 1):
        cols = word_of == w
        weights = np.broadcast_to(weight[cols], (n_boot, int(cols.sum()))).ravel()
        sel = (np.arange(n_boot)[:, None] * n + idx[:, cols]).ravel()
        words.append(np.bincount(sel, weights=weights, minlength=n_boot * n).reshape(n_boot, n))
    words[0] += count * float(2**width)
    return [w.astype(dtype) for w in words]


def _majority_winners(
    dense: np.ndarray, n_classes: np.ndarray, words: list[np.ndarray], idx: np.ndarray
) -> np.ndarray:
    """``(c, n_bootstrap)``: per prompt and bootstrap row, the sample whose value maj@k reports."""
    n_boot, k = idx.shape
    c, n = dense.shape
    width = k if words[0].dtype == np.float32 else _WORD
    words_t = [np.ascontiguousarray(w.T) for w in words]  # (n, n_bootstrap)
    row_start = np.arange(n_boot, dtype=np.int64) * k  # idx[b, t] is idx.flat[b * k + t]
    first_of = _first_positions(k) if width == k and k <= TABLE_MAX_N else None
    out = np.empty((c, n_boot), dtype=np.intp)
    # chunks whose vote counts stay in cache, of prompts with the same number of classes (they come
    # sorted by it): no padding classes
    budget = max(1, min(CHUNK_BYTES, CACHE_BYTES) // (words[0].itemsize * n_boot * int(n_classes.max())))
    cuts = np.flatnonzero(np.diff(n_classes)) + 1
    bounds = sorted({*range(0, c, budget), *cuts.tolist(), c})
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        m, d = hi - lo, int(n_classes[lo:hi].max())
        if d == 1:  # one class: the first draw's sample
            out[lo:hi] = idx[:, 0]
            continue
        onehot = np.zeros((d, m, n), dtype=words[0].dtype)
        onehot[dense[lo:hi], np.arange(m)[:, None], np.arange(n)[None, :]] = 1.0
        onehot = onehot.reshape(d * m, n)
        key = _products(onehot, words_t[0]).reshape(d, m, n_boot)
        top = key.max(axis=0)  # (m, n_bootstrap): the winning class's key
        if first_of is not None:  # its first position, looked up from the whole key
            pos = first_of[top.astype(np.int32)]
        else:
            ints = top.astype(np.int32 if width < 31 else np.int64)  # exact: float32 keys stay below 2**24
            low = (ints & (2**width - 1)).astype(top.dtype)  # the winner's positions < width, as bits
            pos = width - np.frexp(low)[1]  # its highest bit is its first position; width when it has none
            if len(words) > 1:
                found = low > 0
                cand = key == top[None]  # same count, same positions among the first words
                for w in range(1, len(words)):
                    if found.all():
                        break
                    kw = np.where(cand, _products(onehot, words_t[w]).reshape(d, m, n_boot), -1.0)
                    tw = kw.max(axis=0)
                    new = ~found & (tw > 0)
                    pos = np.where(new, w * width + width - np.frexp(tw)[1], pos)
                    found |= new
                    cand &= kw == tw[None]
        out[lo:hi] = np.take(idx, row_start + pos)  # idx[b, pos]
    return out


@functools.lru_cache(maxsize=32)
def _first_positions(k: int) -> np.ndarray:
    """For every float32 tie-break key of ``k`` draws (``count * 2**k`` + position bits), the first
    position among its bits (the highest bit: draw 0 has weight ``2**(k - 1)``)."""
    bits = np.arange((k + 1) << k, dtype=np.int64) & ((1 << k) - 1)
    first = (k - np.frexp(bits.astype(np.float64))[1]).astype(np.uint8)
    first.flags.writeable = False
    return first


def _products(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in blocks of rows of at most :data:`_GEMM_MAX` multiply-adds each. BLAS runs products
    this small on one thread: here (an inner dimension of ``n``) threads cost more than they save,
    and on a busy machine they cost many times the product itself."""
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    step = max(1, _GEMM_MAX // (a.shape[1] * b.shape[1]))
    for lo in range(0, len(a), step):
        np.matmul(a[lo : lo + step], b, out=out[lo : lo + step])
    return out


# ------------------------------------------------------------------------------------ exact extras
def _exact_group(
    mats: dict[str, np.ndarray], dense: np.ndarray | None, n_classes: np.ndarray | None, n: int
) -> dict[tuple[str, str], np.ndarray]:
    """pass@k and the exact best/worst/maj expectations and stds per prompt (``n`` samples each)."""
    out: dict[tuple[str, str], np.ndarray] = {}
    ks = bootstrap_sizes(n)
    for v, mat in mats.items():
        ones = np.where((mat == 0) | (mat == 1), mat, 0).sum(axis=1).astype(np.intp)
        for k in (1, *ks):
            out[(v, f"pass@{k}")] = pass_at_k(n, ones, k)
        srt = np.sort(mat, axis=1)  # NaN last: any NaN makes the expectations NaN
        i = np.arange(1, n + 1, dtype=np.float64)
        for k in ks:
            w_best = (i / n) ** k - ((i - 1) / n) ** k  # P(max of k draws is the i-th smallest)
            for metric, w in (("best", w_best), ("worst", w_best[::-1])):
                mean = srt @ w
                out[(v, f"{metric}@{k}/exact_mean")] = mean
                with np.errstate(invalid="ignore"):
                    out[(v, f"{metric}@{k}/exact_std")] = np.sqrt(((srt - mean[:, None]) ** 2) @ w)
    if dense is not None and n_classes is not None and ks and mats:
        names = list(mats)
        for k in ks:
            first, second = _exact_majority(mats, names, dense, n_classes, n, k)
            for j, v in enumerate(names):
                out[(v, f"maj@{k}/exact_mean")] = first[:, j]
                with np.errstate(invalid="ignore"):
                    out[(v, f"maj@{k}/exact_std")] = np.sqrt(np.maximum(second[:, j] - first[:, j] ** 2, 0.0))
    return out


def _exact_majority(
    mats: dict[str, np.ndarray], names: list[str], dense: np.ndarray, n_classes: np.ndarray, n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """E[maj value] and E[maj value**2] per prompt and variable, under ``k`` draws with replacement.

    Given the vote counts, the reported value is that of a uniform member of the winning class, and
    among tied classes each wins with probability 1/(number tied). So E = sum over classes c of
    P(c wins) * (mean of c). P(c wins) comes from a dynamic program per level L (the winning count):
    classes are visited in turn, each taking j <= L of the remaining r draws (binomial), tracking how
    many classes reached exactly L; the channel sums carry the class means of those that did."""
    n_prompts = len(dense)
    rows = np.arange(n_prompts)[:, None]
    size = np.zeros((n_prompts, n))
    np.add.at(size, (rows, dense), 1.0)
    chans = [np.zeros_like(size)]  # channel 0: the probability mass itself (adds no class value)
    for v in names:
        total = np.zeros((n_prompts, n))
        squares = np.zeros((n_prompts, n))
        np.add.at(total, (rows, dense), mats[v])
        np.add.at(squares, (rows, dense), mats[v] ** 2)
        with np.errstate(invalid="ignore", divide="ignore"):  # empty (padding) classes: 0, not NaN
            chans += [np.where(size > 0, total / size, 0.0), np.where(size > 0, squares / size, 0.0)]
    chan = np.stack(chans, axis=-1).astype(np.float64)  # (P, classes, 1 + 2 * vars)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, k + 1)))])
    out = np.empty((n_prompts, chan.shape[-1]))
    d_max = int(n_classes.max())
    per_prompt = 8 * (d_max * (k // 2 + 1) * (k + 1) + 3 * (k + 1) * (d_max + 1) * chan.shape[-1])
    step = max(1, 4 * CHUNK_BYTES // per_prompt)
    for lo in range(0, n_prompts, step):  # prompts come sorted by class count: little padding
        d = int(n_classes[lo : lo + step].max())
        out[lo : lo + step] = _majority_dp(size[lo : lo + step, :d], chan[lo : lo + step, :d], n, k, log_fact)
    return out[:, 1::2], out[:, 2::2]


def _binom_pmf(r: np.ndarray, j: np.ndarray, q: np.ndarray, log_fact: np.ndarray) -> np.ndarray:
    """P(Bin(r, q) = j), broadcasting; 0 where j > r, exact 0/1 at q in {0, 1}."""
    r, j, q = np.broadcast_arrays(r, j, q)
    valid = j <= r
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = log_fact[r] - log_fact[np.where(valid, j, 0)] - log_fact[np.where(valid, r - j, 0)]
        log_p = log_p + np.where(j > 0, j * np.log(q), 0.0) + np.where(r > j, (r - j) * np.log1p(-q), 0.0)
    return np.where(valid, np.exp(log_p), 0.0)


def _majority_dp(size: np.ndarray, chan: np.ndarray, n: int, k: int, log_fact: np.ndarray) -> np.ndarray:
    """E[channel of the winning class] for prompts with (at most) ``d`` classes of the given sizes;
    empty classes (size 0) are padding."""
    n_prompts, d = size.shape
    n_chan = chan.shape[-1]
    prob = size / n
    remaining = n - np.cumsum(size, axis=1) + size
    with np.errstate(invalid="ignore", divide="ignore"):
        cond = np.where(remaining > 0, size / remaining, 0.0)  # P(class c | not one of the classes before)
    half = k // 2
    r_all, j_all = np.arange(k + 1), np.arange(half + 1)
    tables = [
        _binom_pmf(r_all[None, None, :], j_all[None, :, None], cond[:, c, None, None], log_fact)
        for c in range(d)
    ]
    result = np.zeros((n_prompts, n_chan))
    for level in range(-(-k // d), k + 1):
        if 2 * level > k:  # only one class can reach the level, and it wins
            pmf = _binom_pmf(np.array(k), np.array(level), prob, log_fact)  # (P, d)
            result += np.einsum("pd,pdc->pc", pmf, chan)
            continue
        tied = k // level
        acc = np.zeros(
            (n_prompts, k + 1, tied + 1, n_chan)
        )  # [prompt, draws left, classes at level, channel]
        acc[:, k, 0, 0] = 1.0
        for c in range(d):
            new = np.zeros_like(acc)
            r_lo, r_hi = max(0, k - c * level), min(k, (d - c) * level)  # states that can still end at 0
            for j in range(level + 1):
                lo = max(j, r_lo)
                if lo > r_hi:
                    continue
                w = tables[c][:, j, lo : r_hi + 1, None, None]
                if j < level:
                    new[:, lo - j : r_hi + 1 - j] += acc[:, lo : r_hi + 1] * w
                else:
                    src = acc[:, lo : r_hi + 1, :-1]
                    new[:, lo - j : r_hi + 1 - j, 1:] += (src + src[..., :1] * chan[:, None, None, c]) * w
            acc = new
        ways = np.arange(1, tied + 1, dtype=np.float64)
        result += (acc[:, 0, 1:] / ways[None, :, None]).sum(axis=1)
    return result


__all__ = [
    "CACHE_BYTES", "CHUNK_BYTES", "N_BOOTSTRAP", "STYLES", "TABLE_MAX_N", "aggregate_validation_metrics",
    "bootstrap_indices", "bootstrap_metric", "bootstrap_sizes", "calc_maj_val", "encode_samples",
    "merge_samples", "pass_at_k", "process_samples", "process_validation_metrics", "record_digest",
    "samples_by_source",
]  # fmt: skip
