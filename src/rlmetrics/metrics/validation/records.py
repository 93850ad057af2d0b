"""One rank's validation samples as a compact :class:`SampleRecord`, merged over ranks, and its digest.

Over 400 lines on purpose: encoding, merge, checks and digest share one layout nothing else reads.
Rules: docs/validation.md, "Semantics, and how it is computed" and "pass^k, ties, failed samples and the RNG".
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.core.summary import NAN_STRATEGIES
from rlmetrics.core.values import MetricValueError

RECORD_VERSION = 1

STYLES = ("seed", "verl")
"""Record styles: the seed's (siiRL's) semantics, or verl 0.9.1's."""
TIES = ("first", "none")
"""How maj@k treats a tied vote: the seed's (the pred seen first wins), or no majority (reports 0)."""
MISSING = (None, "count_as_zero", "drop", "error")
"""What a None or NaN score counts as: None keeps the seed's behaviour, the others are named in the keys."""


@dataclass
class SampleRecord:
    """Samples of one or more ranks as codes plus tables (first appearance order): per group its prompt
    (or digest) and source, per sample its ``group``; ``values`` (NaN: not a number; None: none is), with
    ``numeric`` / ``none`` flags; ``pred`` codes into ``pred_table``; triples ``expected`` (source, prompt,
    count) and ``failed`` (source, var, count); settings ``exact``, ``style``, ``seed``, ``tie``, ``missing``.
    """

    sources: list[Any]
    prompts: list[Any]
    group_source: np.ndarray
    group: np.ndarray
    values: dict[str, np.ndarray | None]
    numeric: dict[str, np.ndarray]
    none: dict[str, np.ndarray]
    turns: np.ndarray
    pred: np.ndarray | None = None
    pred_table: list[Any] = field(default_factory=list)
    exact: bool = False
    style: str = "seed"
    seed: int = 42
    expected: list[tuple[Any, Any, int]] = field(default_factory=list)
    tie: str = "first"
    missing: str | None = None
    failed: list[tuple[Any, str, int]] = field(default_factory=list)
    version: int = RECORD_VERSION

    @property
    def n_samples(self) -> int:
        return len(self.group)


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
    tie: str = "first",
    missing: str | None = None,
) -> SampleRecord:
    """One rank's samples as a :class:`SampleRecord`. ``digest_prompts``: keep 16-byte digests of prompts;
    ``expected_counts``: verl's; ``nan_strategy``: docs/reductions.md; ``tie``, ``missing`` (first):
    docs/validation.md. ``ValueError`` on bad options or lengths, ``MetricValueError`` under ``"error"``.

    >>> encode_samples(["a", "a"], ["p", "p"], {"acc": [1.0, None]}, missing="count_as_zero").values
    {'acc': array([1., 0.])}

    >>> r = encode_samples(["a", "b", "a"], ["p", "p", "p"], {"acc": [1, 0, 1], "pred": ["x", "y", "x"]})
    >>> r.sources, r.group.tolist(), r.values["pred"], r.pred.tolist(), r.pred_table
    (['a', 'b'], [0, 1, 0], None, [0, 1, 0], ['x', 'y'])
    >>> encode_samples(["a", "a"], ["p", "p"], {"acc": [1.0, float("nan")]}, nan_strategy="drop").group
    array([0], dtype=int32)
    """
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    n = len(data_sources)
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if tie not in TIES:
        raise ValueError(f"tie must be one of {TIES}, got {tie!r}")
    if missing not in MISSING:
        raise ValueError(f"missing must be one of {MISSING}, got {missing!r}")
    if len(sample_inputs) != n:
        raise ValueError(f"{len(sample_inputs)} sample_inputs for {n} data_sources")
    for var, col in infos_dict.items():
        if len(col) != n:
            raise ValueError(f"infos_dict[{var!r}] has {len(col)} values for {n} samples")
    options = {"digest_prompts": digest_prompts, "exact": exact, "style": style, "seed": seed,
               "expected_counts": expected_counts, "nan_strategy": nan_strategy, "tie": tie}  # fmt: skip
    if missing is not None:
        *parts, failed = _fill_missing(data_sources, sample_inputs, infos_dict, sample_turns, missing)
        record = encode_samples(*parts, **options)
        record.missing, record.failed = missing, failed
        return record
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
                tie=tie,
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
    record = SampleRecord(
        sources=list(sources),
        prompts=prompts,
        group_source=np.asarray(group_source, dtype=np.int32),
        group=np.asarray(codes, dtype=np.int32),
        values=values,
        numeric=numeric,
        none=none,
        turns=_turns_array(sample_turns),
        exact=bool(exact),
        style=style,
        seed=int(seed),
        tie=tie,
        expected=[
            (src, _digest(p) if digest_prompts else p, int(c))
            for (src, p), c in (expected_counts or {}).items()
        ],
    )
    if "pred" in infos_dict:
        col = infos_dict["pred"]
        table: dict[Any, int] = {}
        items = col.tolist() if isinstance(col, np.ndarray) else col
        record.pred = np.asarray([table.setdefault(v, len(table)) for v in items], dtype=np.int32)
        record.pred_table = list(table)
    return record


def merge_samples(records: Iterable[SampleRecord]) -> SampleRecord:
    """Concatenate records in the given (rank) order: equal to :func:`encode_samples` of the concatenated
    inputs. Records without samples are ignored; ValueError as :func:`check_mergeable`.

    >>> r0 = encode_samples(["a", "a"], ["p", "q"], {"acc": [1.0, 0.0]})
    >>> r1 = encode_samples(["a", "b"], ["q", "p"], {"acc": [1.0, 1.0]})
    >>> m = merge_samples([r0, r1])
    >>> m.sources, m.prompts, m.group.tolist(), m.values["acc"].tolist()
    (['a', 'b'], ['p', 'q', 'p'], [0, 1, 1, 2], [1.0, 0.0, 1.0, 1.0])
    """
    records = list(records)
    check_mergeable((), records)
    style, seed = (records[0].style, records[0].seed) if records else ("seed", 42)
    tie, missing = (records[0].tie, records[0].missing) if records else ("first", None)
    common = {
        "style": style,
        "seed": seed,
        "tie": tie,
        "missing": missing,
        "expected": [triple for r in records for triple in r.expected],
        "failed": [triple for r in records for triple in r.failed],
        "turns": _concat([r.turns for r in records], np.float64),
        "exact": any(r.exact for r in records),
    }
    full = [r for r in records if r.n_samples]
    if not full:
        return dataclasses.replace(records[0] if records else encode_samples([], [], {}), **common)
    variables = list(full[0].values)
    has_pred = full[0].pred is not None

    sources: dict[Any, int] = {}
    groups: dict[tuple[Any, Any], int] = {}
    preds: dict[Any, int] = {}
    prompts: list[Any] = []
    group_source: list[int] = []
    group_parts, pred_parts = [], []
    for r in full:
        src_map = [sources.setdefault(s, len(sources)) for s in r.sources]
        group_map = np.empty(len(r.prompts), dtype=np.int64)
        for g, (s, prompt) in enumerate(zip(r.group_source.tolist(), r.prompts)):
            key = (r.sources[s], prompt)
            code = groups.get(key)
            if code is None:
                code = groups[key] = len(groups)
                prompts.append(prompt)
                group_source.append(src_map[s])
            group_map[g] = code
        group_parts.append(group_map[r.group])
        if has_pred:
            pred_map = np.asarray([preds.setdefault(v, len(preds)) for v in r.pred_table], dtype=np.int64)
            pred_parts.append(pred_map[r.pred] if len(pred_map) else np.zeros(0, np.int64))

    values: dict[str, np.ndarray | None] = {}
    numeric: dict[str, np.ndarray] = {}
    none: dict[str, np.ndarray] = {}
    sizes = [r.n_samples for r in full]
    for var in variables:
        if any(var in r.none for r in full):
            none[var] = _concat([r.none.get(var, np.zeros(n, bool)) for r, n in zip(full, sizes)], bool)
        cols = [r.values[var] for r in full]
        if all(c is None for c in cols):
            values[var] = None
            continue
        values[var] = _concat(
            [np.full(n, np.nan) if c is None else c for c, n in zip(cols, sizes)], np.float64
        )
        if any(c is None or var in r.numeric for c, r in zip(cols, full)):
            masks = [
                np.zeros(n, bool) if c is None else r.numeric.get(var, np.ones(n, bool))
                for c, r, n in zip(cols, full, sizes)
            ]
            numeric[var] = _concat(masks, np.bool_)
    return SampleRecord(
        sources=list(sources),
        prompts=prompts,
        group_source=np.asarray(group_source, dtype=np.int32),
        group=_concat(group_parts, np.int32),
        values=values,
        numeric=numeric,
        none=none,
        pred=_concat(pred_parts, np.int32) if has_pred else None,
        pred_table=list(preds),
        **common,
    )


def check_mergeable(held: Sequence[SampleRecord], new: Iterable[Any]) -> None:
    """ValueError unless ``new`` merge with ``held``: this version, one style, seed, tie and missing
    rule, the same variables and all or none a pred, no ``acc_success_only`` beside verl's expected counts.

    >>> a = encode_samples(["s"], ["p"], {"acc": [1.0]})
    >>> check_mergeable([a], [encode_samples(["s"], ["p"], {"reward": [1.0]})])
    Traceback (most recent call last):
    ...
    ValueError: records have different variables: ['acc'] vs ['reward']
    """
    first = held[0] if held else None
    full = next((r for r in held if r.n_samples), None)
    expected = any(r.expected for r in held)
    for r in new:
        if not isinstance(r, SampleRecord) or r.version != RECORD_VERSION:
            version = r.version if isinstance(r, SampleRecord) else type(r).__name__
            raise ValueError(f"not a validation SampleRecord of version {RECORD_VERSION}: {version!r}")
        if first is None:
            first = r
        if (r.style, r.seed) != (first.style, first.seed):
            raise ValueError(
                f"records of different styles or seeds: {(first.style, first.seed)} vs {(r.style, r.seed)}"
            )
        if (r.tie, r.missing) != (first.tie, first.missing):
            rules = (first.tie, first.missing), (r.tie, r.missing)
            raise ValueError(f"records of different tie or missing rules: {rules[0]} vs {rules[1]}")
        if r.n_samples:
            if full is None:
                full = r
            if r.values.keys() != full.values.keys():
                raise ValueError(f"records have different variables: {list(full.values)} vs {list(r.values)}")
            if (r.pred is None) != (full.pred is None):
                raise ValueError("some records have a 'pred' variable and some do not")
        expected = expected or bool(r.expected)
    if first is not None and first.style == "verl" and expected and full is not None:
        if {"acc", "acc_success_only"} <= full.values.keys():
            raise ValueError(
                "'acc_success_only' is computed from 'acc' with expected counts; rename the variable"
            )


MAX_EXPECTED = 1 << 20
"""Most samples the expected counts of one record may ask for (verl's padding of ``acc``)."""


def check_record(record: Any) -> None:
    """ValueError unless the metrics can read every index, table and array of ``record`` (from another
    process), its expected counts asking for at most :data:`MAX_EXPECTED` samples.

    >>> r = encode_samples(["a", "a"], ["p", "q"], {"acc": [1.0, 0.0]})
    >>> check_record(r)
    >>> r.group[1] = 5
    >>> check_record(r)
    Traceback (most recent call last):
    ...
    ValueError: validation record: group index 5 outside [0, 2)
    """
    if not isinstance(record, SampleRecord) or record.version != RECORD_VERSION:
        version = record.version if isinstance(record, SampleRecord) else type(record).__name__
        raise ValueError(f"not a validation SampleRecord of version {RECORD_VERSION}: {version!r:.40}")
    r = record
    if r.style not in STYLES:
        raise ValueError(f"validation record: style {r.style!r:.40} is not one of {STYLES}")
    if r.tie not in TIES or r.missing not in MISSING:
        raise ValueError(f"validation record: tie {r.tie!r:.40} or missing {r.missing!r:.40} unknown")
    if not isinstance(r.exact, bool):
        raise ValueError(f"validation record: exact {r.exact!r:.40} is not a bool")
    if not (isinstance(r.seed, numbers.Integral) and 0 <= r.seed < 2**32):
        raise ValueError(f"validation record: seed {r.seed!r:.40} outside [0, 2**32)")
    for name in ("sources", "prompts", "pred_table", "expected", "failed"):
        table = getattr(r, name)
        if not isinstance(table, list):
            raise ValueError(f"validation record: {name} is a {type(table).__name__}, not a list")
        _hashable(table, name)
    n = _indices(r.group, len(r.prompts), "group")
    if _indices(r.group_source, len(r.sources), "data source") != len(r.prompts):
        raise ValueError(f"validation record: {len(r.group_source)} data sources for {len(r.prompts)} groups")
    if r.pred is not None and _indices(r.pred, len(r.pred_table), "pred") != n:
        raise ValueError(f"validation record: {len(r.pred)} preds for {n} samples")
    _column(r.turns, None, np.float64, "turns")
    if not (isinstance(r.values, dict) and isinstance(r.numeric, dict) and isinstance(r.none, dict)):
        raise ValueError("validation record: values, numeric and none must be dicts")
    numbers_of = {var for var, col in r.values.items() if col is not None}
    for var, col in r.values.items():
        if not isinstance(var, str):
            raise ValueError(f"validation record: variable {var!r:.40} is not a str")
        if col is not None:
            _column(col, n, np.float64, f"values of {var!r}")
    for flags, of in ((r.numeric, numbers_of), (r.none, r.values.keys())):
        for var, col in flags.items():
            if var not in of:
                raise ValueError(f"validation record: flags for variable {var!r:.40} without values")
            _column(col, n, np.bool_, f"flags of {var!r}")
    asked = 0
    for triple in r.expected:
        count = triple[2] if isinstance(triple, tuple) and len(triple) == 3 else None
        if not (isinstance(count, numbers.Integral) and 0 <= count <= MAX_EXPECTED):
            raise ValueError(
                f"validation record: expected {triple!r:.60}: not (source, prompt, count) "
                f"with a count in [0, {MAX_EXPECTED}]"
            )
        asked += int(count)
    for triple in r.failed:
        count = triple[2] if isinstance(triple, tuple) and len(triple) == 3 else None
        if not (isinstance(count, numbers.Integral) and count > 0 and isinstance(triple[1], str)):
            raise ValueError(f"validation record: failed {triple!r:.60}: not (source, var, count > 0)")
    if asked > MAX_EXPECTED:
        raise ValueError(
            f"validation record: expected counts ask for {asked} samples, more than {MAX_EXPECTED}"
        )
    check_mergeable((), [r])


def _hashable(table: list, name: str) -> None:
    for entry in table:
        try:
            hash(entry)
        except TypeError:
            raise ValueError(f"validation record: {name} entry {entry!r:.40} is not hashable") from None


def _indices(codes: Any, size: int, name: str) -> int:
    """How many ``codes`` there are; ValueError unless they are a 1-D integer array in ``[0, size)``."""
    if not (isinstance(codes, np.ndarray) and codes.ndim == 1 and codes.dtype.kind in "iu"):
        raise ValueError(f"validation record: {name} indices must be a 1-D integer array")
    if len(codes) and not (0 <= codes.min() and codes.max() < size):
        bad = codes[(codes < 0) | (codes >= size)][0]
        raise ValueError(f"validation record: {name} index {bad} outside [0, {size})")
    return len(codes)


def _column(col: Any, n: int | None, dtype: Any, name: str) -> None:
    """ValueError unless ``col`` is a 1-D array of ``dtype`` with ``n`` entries (None: any)."""
    if not (isinstance(col, np.ndarray) and col.ndim == 1 and col.dtype == dtype and n in (None, len(col))):
        raise ValueError(
            f"validation record: {name} must be a 1-D {np.dtype(dtype).name} array of {n} entries"
        )


def record_digest(record: SampleRecord) -> str:
    """A hash of a record's content, independent of when or where it was made (orders rankless clients).

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
        add(getattr(record, key))
    for var, vals in record.values.items():
        add(var)
        add(vals)
        add(record.numeric.get(var))
    return h.hexdigest()


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


def _fill_missing(
    data_sources: Sequence[Any],
    sample_inputs: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    sample_turns: Any,
    missing: str,
) -> tuple[list, list, dict[str, list], Any, list[tuple[Any, str, int]]]:
    """The inputs under the ``missing`` rule, and the failed samples' ``(data_source, var, count)``."""
    n = len(data_sources)
    bad = np.zeros(n, bool)
    failed: list[tuple[Any, str, int]] = []
    infos = {var: col.tolist() if isinstance(col, np.ndarray) else list(col)
             for var, col in infos_dict.items()}  # fmt: skip
    for var, col in infos.items():
        if var == "pred":  # every other variable, by value: a rank's part decides alike
            continue
        gone = [v is None or (is_number(v) and math.isnan(v)) for v in col]
        if missing == "error" and any(gone):
            i = gone.index(True)
            raise MetricValueError(
                f"validation variable {var!r}: sample {i} (data source {data_sources[i]!r}, prompt "
                f"{sample_inputs[i]!r:.80}) is {col[i]!r}, {sum(gone)} missing in all (missing='error')"
            )
        if missing == "count_as_zero":
            infos[var] = [0.0 if g else v for v, g in zip(col, gone)]
        bad |= np.asarray(gone, bool)
        counts: dict[Any, int] = {}
        for src, g in zip(data_sources, gone):
            if g:
                counts[src] = counts.get(src, 0) + 1
        failed.extend((src, var, c) for src, c in counts.items())
    if missing != "drop" or not bad.any():
        return list(data_sources), list(sample_inputs), infos, sample_turns, failed
    keep = ~bad
    turns = _turns_array(sample_turns)
    if len(turns) == n:
        sample_turns = turns[keep]
    pick = lambda col: [v for v, k in zip(col, keep) if k]  # noqa: E731
    kept = {var: pick(col) for var, col in infos.items()}
    return pick(data_sources), pick(sample_inputs), kept, sample_turns, failed


def is_number(v: Any) -> bool:
    return isinstance(v, (numbers.Real, np.bool_)) and not isinstance(v, str)


def _numeric_column(col: Any, var: str) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(float64 values, NaN for non-numbers; mask of numbers; mask of Nones), each None when trivial."""
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
    mask = np.fromiter((is_number(v) for v in items), dtype=bool, count=len(items))
    if not mask.any():
        return None, None, nones
    vals = np.full(len(items), np.nan)
    vals[mask] = [float(v) for v, ok in zip(items, mask) if ok]
    return vals, mask, nones


__all__ = [
    "MAX_EXPECTED", "MISSING", "RECORD_VERSION", "STYLES", "TIES", "SampleRecord", "check_mergeable",
    "check_record", "encode_samples", "is_number", "merge_samples", "record_digest",
]  # fmt: skip
