"""Group breakdowns of the data metrics: each metric of each group of a per-sample tag, exact under merging.

Every sequence's own summaries (per-sequence values: one observation; response tokens: their
count, sum, M2 around the sequence's mean, min and max, computed on the device with the other
summaries, :class:`~rlmetrics.metrics.data.tokens.TokenSummaries` with ``rows=True``) are merged on
the host over each group's sequences (:func:`~rlmetrics.stat.reduce_runs`, exact), and the metrics
of each group are assembled as the batch's are (the explained variance's ingredients included), under
``group/<tag>/<value>/<metric>`` (:mod:`rlmetrics.groups`). A group's Stats merge across ranks as any
Stat does, so its global values are those of its sequences of all ranks concatenated.

The labels come from the batch (a key: a tensor, a numpy array or a list, also in verl's
``non_tensor_batch``) or from a function of it; label tensors reach the host with the batch's other
tensors, in its one transfer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlmetrics.groups import GROUP_PREFIX, GroupBy, Labels, group_name, tag_sources
from rlmetrics.metrics.batch import BatchView, key_error
from rlmetrics.metrics.data.sequences import Part, part_rows, with_token_block
from rlmetrics.stat import reduce_runs
from rlmetrics.values import is_torch


class Breakdowns:
    """The ``group_by`` of one call: raw labels by tag (tensors are moved with the batch's others)."""

    def __init__(self, group_by: GroupBy, view: BatchView, data: Any) -> None:
        self.raw: dict[str, Any] = {}
        for tag, source in tag_sources(group_by).items():
            labels = source(data) if callable(source) else view.get(source)
            if labels is None:
                raise key_error(str(source), f"not in the batch (group_by tag {tag!r})")
            self.raw[tag] = labels

    def __bool__(self) -> bool:
        return bool(self.raw)

    @property
    def tensors(self) -> list[Any]:
        """The label tensors, for the batch's one transfer."""
        return [v for v in self.raw.values() if is_torch(v)]

    def labels(self, moved: list[np.ndarray]) -> list[Labels]:
        """The :class:`~rlmetrics.groups.Labels` of each tag, given the moved label tensors."""
        moved_iter = iter(moved)
        return [Labels.of(tag, next(moved_iter) if is_torch(raw) else raw) for tag, raw in self.raw.items()]


def grouped_arrays(
    labels: list[Labels],
    parts: list[Part],
    token_names: list[tuple[str, ...]],
    token_rows: np.ndarray | None,
    nan_strategy: str,
) -> tuple[list[str], np.ndarray]:
    """Names and ``(5, K)`` stat array of every group's metrics: ``parts`` (the per-sequence
    metrics), ``token_rows`` (``(5, K_tokens, B)``, each sequence's token summaries)."""
    n = len(labels[0].codes)
    for lab in labels:
        if len(lab.codes) != n:
            raise key_error(lab.tag, f"{len(lab.codes)} labels, group tag {labels[0].tag!r} has {n}")
    seq_groups = [names for names, _, _ in parts]
    rows = [part_rows(parts, n, nan_strategy).transpose(0, 2, 1)]  # (5, B, K): sequences as parts
    if token_rows is not None:
        if token_rows.shape[2] != n:
            raise key_error(labels[0].tag, f"{n} labels for {token_rows.shape[2]} sequences")
        rows.append(token_rows.transpose(0, 2, 1))
    per_seq = np.concatenate(rows, axis=2)
    k = len(seq_groups)
    names: list[str] = []
    arrays: list[np.ndarray] = []
    for lab in labels:
        if not lab.values:
            continue
        order, starts = lab.runs()
        merged = reduce_runs(per_seq[:, order], starts)  # (5, G, K): every group at once
        for g, value in enumerate(lab.values):
            group_names, group_arrays = with_token_block(
                seq_groups, merged[:, g, :k], token_names, merged[:, g, k:]
            )
            names += _prefixed(lab.tag, value, tuple(group_names))
            arrays.append(group_arrays)
    return names, np.concatenate(arrays, axis=1) if arrays else np.zeros((5, 0))


@functools.lru_cache(maxsize=1024)
def _prefixed(tag: str, value: str, names: tuple[str, ...]) -> list[str]:
    """The grouped names of ``names`` (the same every step)."""
    return [group_name(tag, value, name) for name in names]


def split_grouped(stats: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ungrouped, grouped)`` entries of a metrics dict."""
    grouped = {name: v for name, v in stats.items() if name.startswith(GROUP_PREFIX)}
    return {name: v for name, v in stats.items() if name not in grouped}, grouped


__all__ = ["Breakdowns", "grouped_arrays", "split_grouped"]
