"""Group breakdowns of the data metrics: each metric of each group of a per-sample tag, exact under merging.

Each sequence's summaries are merged on the host per group, named ``group/<tag>/<value>/<metric>``.
Rules: docs/groups.md, "Data metrics by a tag".
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from rlmetrics.core.groups import MISSING, GroupBy, Labels, group_name, tag_sources
from rlmetrics.core.stat import empty_arrays, reduce_parts, reduce_runs
from rlmetrics.core.values import MetricValueError, is_torch
from rlmetrics.metrics.batch import BatchView, key_error
from rlmetrics.metrics.data.sequences import Part, part_rows, part_summaries, with_token_block
from rlmetrics.metrics.difficulty import TAG, prompt_record


class Breakdowns:
    """One call's ``group_by`` labels and difficulty prompt ids (``MetricValueError`` if not in the batch);
    ``errors``: a tag whose labels are refused is left out, its message under its tag (None: raised)."""

    def __init__(
        self,
        group_by: GroupBy,
        view: BatchView,
        data: Any,
        prompts: str | None = None,
        errors: dict[str, str] | None = None,
    ) -> None:
        self.errors = errors  # a tag whose labels are refused: its message, by tag (None: raised)
        self.raw: dict[str, Any] = {}
        if isinstance(data, BatchView) and data.origin is not None:
            data = data.origin
        for tag, source in tag_sources(group_by).items():
            labels = source(data) if callable(source) else view.get(source)
            if labels is None:
                raise key_error(str(source), f"not in the batch (group_by tag {tag!r})")
            self.raw[tag] = labels
        self.prompts_key = prompts
        self.prompts = None if prompts is None else view.get(prompts)
        if prompts is not None and self.prompts is None:
            raise key_error(prompts, "not in the batch (difficulty groups need each sample's prompt id)")

    def __bool__(self) -> bool:
        return bool(self.raw) or self.prompts is not None

    @property
    def tensors(self) -> list[Any]:
        """The label tensors, for the batch's one transfer."""
        return [v for v in [*self.raw.values(), self.prompts] if is_torch(v)]

    def assemble(
        self, moved: list[np.ndarray], parts: list[Part], tokens: Any, block: np.ndarray, nan_strategy: str
    ) -> tuple[list[str], np.ndarray, dict[str, Any] | None]:
        """Names and ``(5, K)`` array of the batch's then its groups' metrics, and the prompt record."""
        token_names = [] if tokens is None else tokens.names
        token_rows = None
        if tokens is not None and tokens.rows:
            token_rows = block.reshape(5, len(token_names), -1)
            has_rows = token_rows.shape[2] > 0
            block = (
                reduce_parts(token_rows.transpose(0, 2, 1)) if has_rows else empty_arrays(len(token_names))
            )
        names, arrays = with_token_block(*part_summaries(parts, nan_strategy), token_names, block)
        if not self:
            return names, arrays, None
        group_names, group_arrays, record = self.arrays(moved, parts, token_names, token_rows, nan_strategy)
        return names + group_names, np.concatenate([arrays, group_arrays], axis=1), record

    def arrays(
        self,
        moved: list[np.ndarray],
        parts: list[Part],
        token_names: list[tuple[str, ...]],
        token_rows: np.ndarray | None,
        nan_strategy: str,
    ) -> tuple[list[str], np.ndarray, dict[str, Any] | None]:
        """The groups' names and ``(5, K)`` array and the prompt record, from per-sequence summaries."""
        moved_iter = iter(moved)

        def on_host(raw: Any) -> Any:
            return next(moved_iter) if is_torch(raw) else raw

        labels = []
        for tag, raw in self.raw.items():
            host = on_host(raw)
            try:
                labels.append(Labels.of(tag, host))
            except MetricValueError as exc:  # that tag's groups only
                if self.errors is None:
                    raise
                self.errors[tag] = str(exc)
        prompts = None
        if self.prompts is not None:
            prompts = Labels.of("prompt", on_host(self.prompts), segments=False)
        if not labels and prompts is None:
            return [], np.zeros((5, 0)), None
        n = len((labels or [prompts])[0].codes)
        groups, per_seq = sequence_rows(n, parts, token_names, token_rows, nan_strategy)
        names, arrays = grouped_arrays(labels, groups, per_seq)
        if prompts is None:
            return names, arrays, None
        if len(prompts.codes) != n:
            raise key_error(str(self.prompts_key), f"{len(prompts.codes)} prompt ids for {n} sequences")
        blocks = group_blocks(prompts, per_seq)
        ids = [i for i in range(len(prompts.values)) if i != prompts.missing]
        if prompts.missing is not None:  # samples without a prompt id: a difficulty group of their own
            missing_names, missing_arrays = _group_arrays(TAG, MISSING, groups, blocks[:, prompts.missing])
            names, arrays = names + missing_names, np.concatenate([arrays, missing_arrays], axis=1)
        return names, arrays, prompt_record([prompts.values[i] for i in ids], groups, blocks[:, ids])


def sequence_rows(
    n: int,
    parts: list[Part],
    token_names: list[tuple[str, ...]],
    token_rows: np.ndarray | None,
    nan_strategy: str,
) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """Name groups and ``(5, n, K)`` summaries of each sequence, from ``parts`` and ``token_rows``."""
    rows = [part_rows(parts, n, nan_strategy).transpose(0, 2, 1)]  # (5, B, K): sequences as parts
    if token_rows is not None:
        if token_rows.shape[2] != n:
            raise MetricValueError(f"group breakdown: {n} labels for {token_rows.shape[2]} sequences")
        rows.append(token_rows.transpose(0, 2, 1))
    return [names for names, _, _ in parts] + list(token_names), np.concatenate(rows, axis=2)


def grouped_arrays(
    labels: list[Labels], groups: list[tuple[str, ...]], per_seq: np.ndarray
) -> tuple[list[str], np.ndarray]:
    """Names and ``(5, K)`` array of every group's metrics, from :func:`sequence_rows`' summaries."""
    names: list[str] = []
    arrays: list[np.ndarray] = []
    empty = np.zeros((5, 0))
    for lab in labels:
        if len(lab.codes) != per_seq.shape[1]:
            raise key_error(lab.tag, f"{len(lab.codes)} labels for {per_seq.shape[1]} sequences")
        merged = group_blocks(lab, per_seq)  # (5, G, K): every group at once
        for g, value in enumerate(lab.values):
            more_names, more = _group_arrays(lab.tag, value, groups, merged[:, g])
            names += more_names
            arrays.append(more)
    return names, np.concatenate(arrays, axis=1) if arrays else empty


def _group_arrays(
    tag: str, value: str, groups: list[tuple[str, ...]], block: np.ndarray
) -> tuple[list[str], np.ndarray]:
    """Names and ``(5, K)`` array of one group's metrics from its merged ``(5, K)`` ``block``."""
    names, arrays = with_token_block(groups, block, [], np.zeros((5, 0)))
    return _prefixed(tag, value, tuple(names)), arrays


def group_blocks(labels: Labels, per_seq: np.ndarray) -> np.ndarray:
    """``(5, G, K)``: the sequences' summaries ``(5, B, K)`` merged per group of ``labels``."""
    if not labels.values:
        return per_seq[:, :0]
    order, starts = labels.runs()
    return reduce_runs(per_seq[:, order], starts)


@functools.lru_cache(maxsize=1024)
def _prefixed(tag: str, value: str, names: tuple[str, ...]) -> list[str]:
    """The grouped names of ``names`` (the same every step)."""
    return [group_name(tag, value, name) for name in names]


__all__ = ["Breakdowns", "grouped_arrays"]
