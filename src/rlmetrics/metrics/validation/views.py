"""How the metrics group a record's samples: the seed's style (:func:`seed_view`) or verl's.

Rules: docs/validation.md, "Semantics, and how it is computed".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlmetrics.metrics.validation.records import SampleRecord


@dataclass
class View:
    """Samples as the metrics group them: one slot per value, in input order within a group (verl's
    style: one view per distinct None pattern)."""

    group: np.ndarray  # (slots,) group of each slot
    values: dict[str, np.ndarray]  # float64 per slot
    numeric: dict[str, np.ndarray]  # which slots hold numbers, for variables mixing non-numbers
    pred: np.ndarray | None = None  # pred code per slot: maj@k is computed when given
    vote: np.ndarray | None = None  # per group: whether its prompts vote (None: all of them)


def seed_view(record: SampleRecord) -> View:
    pred = record.pred
    return View(
        group=np.asarray(record.group, dtype=np.intp),
        values={v: vals for v, vals in record.values.items() if vals is not None},
        numeric=record.numeric,
        pred=None if pred is None else np.asarray(pred, dtype=np.intp),
    )


def verl_views(record: SampleRecord) -> tuple[list[View], np.ndarray, list[str]]:
    """verl's grouping: views, groups' sources (empty prompts appended), variables; may raise ValueError."""
    group = np.asarray(record.group, dtype=np.intp)
    group_source = np.asarray(record.group_source, dtype=np.intp)
    values, numeric, none = record.values, record.numeric, record.none
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
    pred = record.pred
    vote_ok = None
    if pred is not None:
        none_codes = [i for i, p in enumerate(record.pred_table) if p is None]
        bad = np.isin(pred, none_codes)
        vote_ok = (np.bincount(group, weights=bad, minlength=len(group_source)) == 0) & (raw > 0)

    def view(slot_sample: np.ndarray, slot_group: np.ndarray, names: list[tuple[str, str]]) -> View:
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
        out = View(slot_group, vals, nums)
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

    views: list[View] = []
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


def _expected_counts(record: SampleRecord, group: np.ndarray, group_source: np.ndarray) -> dict:
    """``{group: expected count}`` (the largest where ranks name a prompt twice); under None the
    ``(prompt, source index)`` of prompts without samples."""
    triples = record.expected
    if not triples or "acc" not in record.values:
        return {}
    sources = record.sources
    not_none = ~record.none.get("acc", np.zeros(len(group), bool))
    acc_sources = {sources[s] for s in np.unique(group_source[group[not_none]]).tolist()}
    index = {(sources[s], p): g for g, (s, p) in enumerate(zip(group_source.tolist(), record.prompts))}
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


__all__ = ["View", "seed_view", "verl_views"]
