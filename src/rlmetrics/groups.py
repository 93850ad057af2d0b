"""Group breakdowns: the names of grouped metrics and the per-sample labels that key them.

A metric broken down by a per-sample tag (``data_source``, an environment, a turn index, ...) is
reported once per value of the tag, under

    ``group/<tag>/<value>/<metric>``

e.g. ``group/data_source/gsm8k/critic/score/mean``. The name keeps the metric's own name whole at its
end, so its reduction is the metric's (:func:`rlmetrics.reduce.resolve` resolves a grouped name by
its metric, registry included) and derived metrics are derived per group
(:func:`rlmetrics.metrics.derive_metrics`). Names starting with ``group/`` are reserved for them.

The tag and the value are *segments*: only letters, digits, ``_``, ``-`` and ``.``, not starting or
ending with ``.`` (:func:`segment` turns anything else into ``_``), so a grouped name reaches every
tracker unchanged when its metric does (MLflow accepts only letters, digits, ``_ - . space : /``;
TensorBoard, W&B and SwanLab change only empty or dotted path segments, see
:mod:`rlmetrics.sinks.names`). Two labels of one tag that give the same segment (``"a b"`` and
``"a_b"``) are refused in a call, as they would share a series.

>>> group_name("data_source", "gsm8k", "critic/score/mean")
'group/data_source/gsm8k/critic/score/mean'
>>> split_group_name("group/turn/3/reward/max"), split_group_name("critic/score/mean")
(('group/turn/3/', 'reward/max'), None)
>>> segment("openai/gsm8k"), segment(".hidden"), segment(3.0), segment("")
('openai_gsm8k', '_hidden', '3', '_')
>>> labels = Labels.of("data_source", ["b", "a", "b"])
>>> labels.values, labels.codes.tolist()
(['a', 'b'], [1, 0, 1])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlmetrics.values import MetricValueError, is_torch

GROUP_PREFIX = "group/"
"""Grouped metric names start with this (reserved for them)."""

_NOT_SEGMENT = re.compile(r"[^\w.\-]")
_EDGE_DOTS = re.compile(r"^\.|\.$")


def segment(label: Any) -> str:
    """A label as one path segment every tracker keeps (see the module docstring): an integral
    number without ``.0``, characters other than letters, digits, ``_ - .`` as ``_``, a leading or
    trailing ``.`` as ``_``, the empty string as ``_``.

    >>> segment("a b/c"), segment(np.int64(2)), segment(True), segment(0.5), segment(b"x")
    ('a_b_c', '2', 'True', '0.5', 'x')
    """
    if isinstance(label, bytes):
        label = label.decode("utf-8", "replace")
    if isinstance(label, (float, np.floating)) and float(label).is_integer():
        label = int(label)
    text = _EDGE_DOTS.sub("_", _NOT_SEGMENT.sub("_", str(label)))
    return text or "_"


def group_name(tag: str, value: str, name: str) -> str:
    """The grouped name of metric ``name`` for the group ``value`` of ``tag`` (both segments)."""
    return f"{GROUP_PREFIX}{tag}/{value}/{name}"


def split_group_name(name: str) -> tuple[str, str] | None:
    """``(group prefix, metric name)`` of a grouped name, None for any other name."""
    if not name.startswith(GROUP_PREFIX):
        return None
    parts = name.split("/", 3)
    if len(parts) < 4 or not parts[1] or not parts[2] or not parts[3]:
        return None
    return name[: len(name) - len(parts[3])], parts[3]


def split_grouped(metrics: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """``(ungrouped, grouped)`` entries of a metrics dict (grouped: names starting with ``group/``).

    >>> split_grouped({"a": 1, "group/env/x/a": 2})
    ({'a': 1}, {'group/env/x/a': 2})
    """
    grouped = {n: v for n, v in metrics.items() if isinstance(n, str) and n.startswith(GROUP_PREFIX)}
    if not grouped:
        return metrics, grouped
    return {n: v for n, v in metrics.items() if n not in grouped}, grouped


class Labels:
    """One tag's labels of a batch's samples: ``values`` (the groups' segments, sorted) and
    ``codes`` (each sample's group: an index into ``values``), made by :meth:`of`."""

    __slots__ = ("tag", "values", "codes")

    def __init__(self, tag: str, values: list[str], codes: np.ndarray) -> None:
        self.tag, self.values, self.codes = tag, values, codes

    @classmethod
    def of(cls, tag: str, labels: Any, *, segments: bool = True) -> Labels:
        """The labels of one tag: a 1-D sequence (list, numpy array, host tensor) of strings or
        numbers, one per sample. Refuses a tag or labels that do not make distinct segments
        (``segments=False``: the values are the labels as strings, e.g. prompt ids)."""
        check_tag(tag)
        arr = np.asarray(labels.tolist() if is_torch(labels) else labels)
        if arr.ndim != 1:
            raise MetricValueError(f"group tag {tag!r}: labels must be 1-D (one per sample), got {arr.shape}")
        uniq, codes = np.unique(arr, return_inverse=True) if arr.size else (arr, np.zeros(0, np.int64))
        if not segments:
            return cls(tag, [str(v) for v in uniq.tolist()], codes.reshape(-1))
        values = [segment(v) for v in uniq.tolist()]
        if len(set(values)) < len(values):
            seen: dict[str, Any] = {}
            for raw, seg in zip(uniq.tolist(), values):
                if seg in seen:
                    raise MetricValueError(
                        f"group tag {tag!r}: labels {seen[seg]!r} and {raw!r} both name group {seg!r}"
                    )
                seen[seg] = raw
        return cls(tag, values, codes.reshape(-1))

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(order, starts)``: the samples sorted by group, and where each group starts in that order."""
        order = np.argsort(self.codes, kind="stable")
        return order, np.searchsorted(self.codes[order], np.arange(len(self.values)))

    def members(self) -> list[np.ndarray]:
        """The sample indices of each group, in the order of ``values``."""
        order, starts = self.runs()
        return np.split(order, starts[1:])


GroupBy = Any  # a batch key, a function of the batch, or several of them: see tag_sources


def tag_sources(group_by: GroupBy) -> dict[str, str | Callable[[Any], Any]]:
    """``{tag: batch key or function}`` of a ``group_by`` argument: a batch key (the tag is the
    key), a named function of the batch (the tag is its ``__name__``), a mapping ``{tag: key or
    function}``, or a list of keys and functions.

    >>> def turn(batch): ...
    >>> list(tag_sources(["data_source", turn])), tag_sources({"env": "environment"})
    (['data_source', 'turn'], {'env': 'environment'})
    """
    if group_by is None:
        return {}
    if isinstance(group_by, Mapping):
        items = list(group_by.items())
    else:
        many = isinstance(group_by, Sequence) and not isinstance(group_by, str)
        items = [(_tag_of(g), g) for g in (group_by if many else [group_by])]
    out: dict[str, str | Callable[[Any], Any]] = {}
    for tag, source in items:
        if not isinstance(source, str) and not callable(source):
            raise TypeError(
                f"group_by {tag!r}: a batch key or a function of the batch, not {type(source).__name__}"
            )
        check_tag(tag)
        out[tag] = source
    return out


def check_tag(tag: Any) -> None:
    """Refuse a tag that is not a segment (:func:`segment`)."""
    if not isinstance(tag, str) or segment(tag) != tag:
        raise ValueError(f"group tag {tag!r}: use letters, digits, '_', '-', '.' (e.g. {segment(tag)!r})")


def _tag_of(source: Any) -> str:
    if isinstance(source, str):
        return source
    name = getattr(source, "__name__", "")
    if not callable(source) or not name or name == "<lambda>":
        raise TypeError(f"group_by: pass {{tag: function}} for {source!r:.60} (a tag names its groups)")
    return name


def grouped_values(
    metrics: Mapping[str, Any], labels: Sequence[Labels], errors: dict[str, str] | None = None
) -> dict[str, Any]:
    """The per-sample values of ``metrics`` broken down by each of ``labels``: ``{grouped name:
    that group's values}``. A value is per-sample when it is a 1-D list, numpy array or tensor with
    one value per sample, or a ``(values, weights)`` pair of them; others (numbers, Stats) have no
    breakdown. A 1-D value of another length is left out, with a message naming it in ``errors``
    (without ``errors``: raised).

    >>> labels = Labels.of("source", ["a", "b", "a"])
    >>> grouped_values({"reward": [1.0, 2.0, 3.0], "loss": 0.5}, [labels])
    {'group/source/a/reward': [1.0, 3.0], 'group/source/b/reward': [2.0]}
    """
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        per_sample = _per_sample(value)
        if per_sample is None:
            continue
        short = [lab for lab in labels if len(per_sample[0]) != len(lab.codes)]
        if short:
            message = (
                f"metric {name!r}: {len(per_sample[0])} values, group tag {short[0].tag!r} has "
                f"{len(short[0].codes)} labels"
            )
            if errors is None:
                raise MetricValueError(message)
            errors[name] = message
            continue
        for lab in labels:
            for value_seg, idx in zip(lab.values, lab.members()):
                parts = [_take(x, idx) for x in per_sample]
                out[group_name(lab.tag, value_seg, name)] = parts[0] if len(parts) == 1 else tuple(parts)
    return out


def _per_sample(value: Any) -> tuple[Any, ...] | None:
    """``(values,)`` or ``(values, weights)`` of a per-sample value, else None."""
    if isinstance(value, tuple) and len(value) == 2:
        parts = tuple(_per_sample(v) for v in value)
        if all(p is not None for p in parts) and len(parts[0][0]) == len(parts[1][0]):
            return (parts[0][0], parts[1][0])
        return None
    if isinstance(value, list) or (hasattr(value, "ndim") and hasattr(value, "shape") and value.ndim == 1):
        return (value,)
    return None


def _take(x: Any, idx: np.ndarray) -> Any:
    if isinstance(x, list):
        return [x[i] for i in idx.tolist()]
    if isinstance(x, np.ndarray):
        return x[idx]
    import torch  # a tensor: its rows, where it is

    return x[torch.as_tensor(idx, device=x.device)]


__all__ = [
    "GROUP_PREFIX", "GroupBy", "Labels", "check_tag", "group_name", "grouped_values", "segment",
    "split_group_name", "split_grouped", "tag_sources",
]  # fmt: skip
