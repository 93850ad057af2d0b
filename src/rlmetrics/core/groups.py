"""Group breakdowns: ``group/<tag>/<value>/<metric>`` names and the per-sample labels that key them.

The rules: docs/groups.md, "Naming convention" and "Names of labels".

>>> group_name("data_source", "gsm8k", "critic/score/mean")
'group/data_source/gsm8k/critic/score/mean'
>>> split_group_name("group/turn/3/reward/max"), split_group_name("critic/score/mean")
(('group/turn/3/', 'reward/max'), None)
>>> segment("gsm8k"), segment(3.0), segment(None), segment(float("nan")), segment("")
('gsm8k', '3', '--missing', '--missing', '--empty')
>>> segment("openai/gsm8k"), segment("a b"), segment("a_b")
('openai_gsm8k--444783eb', 'a_b--7faae47c', 'a_b')
>>> labels = Labels.of("data_source", ["b", None, "a", "b"])
>>> labels.values, labels.codes.tolist()
(['--missing', 'a', 'b'], [2, 0, 1, 2])
"""

from __future__ import annotations

import hashlib
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlmetrics.core.values import MetricValueError, is_torch

GROUP_PREFIX = "group/"
"""Grouped metric names start with this (reserved for them)."""

MISSING = "--missing"
"""The group of missing labels (``None``, NaN)."""
EMPTY = "--empty"
"""The group of the empty string."""

_RESERVED = "--"  # in a group's name only by the rules of segment()
_NOT_SEGMENT = re.compile(r"[^\w.\-]")
_EDGE_DOTS = re.compile(r"^\.|\.$")


def _label_text(label: Any) -> str | None:
    """The text a label is named by (None: missing); bytes decode as UTF-8, an integral number drops ``.0``.
    >>> _label_text(np.int64(2)), _label_text(2.0), _label_text(0.5), _label_text(True), _label_text(b"x")
    ('2', '2', '0.5', 'True', 'x')
    >>> _label_text(None), _label_text(np.float32("nan"))
    (None, None)
    """
    if isinstance(label, str):
        return label
    if label is None:
        return None
    if isinstance(label, bytes):
        return label.decode("utf-8", "surrogateescape")
    if isinstance(label, (bool, np.bool_)):
        return str(bool(label))
    if isinstance(label, numbers.Integral):
        return str(int(label))
    if isinstance(label, (float, np.floating)):
        if label != label:
            return None
        return str(int(label)) if float(label).is_integer() else str(label)
    return str(label)


def segment(label: Any) -> str:
    """The name of ``label``'s group: one path segment, the same on every rank, one per label.
    >>> segment("math-v2"), segment(np.int64(2)), segment(True), segment(0.5), segment(".hidden")
    ('math-v2', '2', 'True', '0.5', '_hidden--40f24634')
    """
    text = _label_text(label)
    if text is None:
        return MISSING
    if not text:
        return EMPTY
    readable = _readable(text)
    if readable == text and _RESERVED not in text:
        return text
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{readable}{_RESERVED}{digest}"


def _readable(text: str) -> str:
    """``text`` with the characters outside a segment's, and a leading or trailing ``.``, as ``_``."""
    return _EDGE_DOTS.sub("_", _NOT_SEGMENT.sub("_", text))


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
    """One tag's labels: ``values`` (group names, sorted), ``codes`` (each sample's index into
    ``values``), ``missing`` (the index of the missing labels' group, or None)."""

    __slots__ = ("tag", "values", "codes", "missing")

    def __init__(self, tag: str, values: list[str], codes: np.ndarray, missing: int | None = None) -> None:
        self.tag, self.values, self.codes, self.missing = tag, values, codes, missing

    @classmethod
    def of(cls, tag: str, labels: Any, *, segments: bool = True) -> Labels:
        """The labels of ``tag``, one per sample (1-D); ``segments=False`` keeps their texts as ``values``.
        Raises for a tag that is not a segment, labels not 1-D, and two labels whose names coincide.
        >>> labels = Labels.of("turn", [2, None, 2.0, "2", float("nan"), "a b"])
        >>> labels.values, labels.codes.tolist(), labels.missing
        (['--missing', '2', 'a_b--7faae47c'], [1, 0, 1, 1, 0, 2], 0)
        """
        check_tag(tag)
        if is_torch(labels):
            labels = np.asarray(labels.tolist())
        arr = np.asarray(labels, dtype=object) if isinstance(labels, (list, tuple)) else np.asarray(labels)
        if arr.ndim != 1:
            raise MetricValueError(f"group tag {tag!r}: labels must be 1-D (one per sample), got {arr.shape}")
        texts, codes = _unique_texts(arr)
        values = [segment(t) for t in texts] if segments else texts
        if len(set(values)) < len(values):
            seen: dict[str, str] = {}
            for text, name in zip(texts, values):
                if name in seen:
                    raise MetricValueError(
                        f"group tag {tag!r}: labels {seen[name]!r} and {text!r} both name group {name!r} "
                        "(their hashes collide): rename one of them"
                    )
                seen[name] = text
        missing = None
        if (codes < 0).any():
            missing = len(values)
            codes[codes < 0] = missing
            values = [*values, MISSING]
        order = sorted(range(len(values)), key=values.__getitem__)
        if order != list(range(len(order))):
            rank = np.empty(len(order), np.int64)
            rank[order] = np.arange(len(order))
            codes, values = rank[codes], [values[i] for i in order]
            missing = None if missing is None else int(rank[missing])
        return cls(tag, values, codes, missing)

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(order, starts)``: the samples sorted by group, and where each group starts in that order."""
        order = np.argsort(self.codes, kind="stable")
        return order, np.searchsorted(self.codes[order], np.arange(len(self.values)))

    def members(self) -> list[np.ndarray]:
        """The sample indices of each group, in the order of ``values``."""
        order, starts = self.runs()
        return np.split(order, starts[1:])


def _unique_texts(arr: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The distinct texts of 1-D labels and each label's index among them (-1: missing)."""
    if arr.dtype.kind not in "biufUS":  # objects (verl's non_tensor_batch), of any types: by text
        index: dict[Any, int] = {None: -1}
        texts = (v if type(v) is str else _label_text(v) for v in arr.tolist())
        codes = np.array([index.setdefault(t, len(index) - 1) for t in texts], np.int64)
        del index[None]
        return list(index), codes
    present = ~np.isnan(arr) if arr.dtype.kind == "f" else np.ones(arr.shape, bool)
    codes = np.full(arr.shape, -1, np.int64)
    if not present.any():
        return [], codes
    uniq, codes[present] = np.unique(arr[present], return_inverse=True)
    return [str(_label_text(v)) for v in uniq], codes


GroupBy = Any  # a batch key, a function of the batch, or several of them: see tag_sources


def tag_sources(group_by: GroupBy) -> dict[str, str | Callable[[Any], Any]]:
    """``{tag: batch key or function}`` of a ``group_by`` argument (a function's tag is its ``__name__``).
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
    """Refuse a tag that is not a segment (letters, digits, ``_ - .``, not starting or ending with ``.``)."""
    if not isinstance(tag, str) or not tag or _readable(tag) != tag:
        suggestion = _readable(str(tag)) or "tag"
        raise ValueError(f"group tag {tag!r}: use letters, digits, '_', '-', '.' (e.g. {suggestion!r})")


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
    """``{grouped name: values}`` of the per-sample values; a wrong length goes to ``errors`` (or raises).
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
    "EMPTY", "GROUP_PREFIX", "GroupBy", "Labels", "MISSING", "check_tag", "group_name", "grouped_values",
    "segment", "split_group_name", "split_grouped", "tag_sources",
]  # fmt: skip
