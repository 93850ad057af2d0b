"""The one state model: the :class:`State` protocol, the :data:`KINDS` table, encoding and decoding.

States ride on columns beside a Stat (refusals: docs/reliability.md, "Contributions from other processes").

>>> from rlmetrics.core.reduce import resolve
>>> a, b = Sketch.of([1.0, 2.0]), Sketch.of([3.0, 4.0, 5.0])
>>> travelled = decode_state(*encode_state(a))
>>> travelled.merge(b).reduce("lat/p50", resolve("lat/p50"), Stat.of([1.0, 2.0, 3.0, 4.0, 5.0]))
{'lat/p50': 3.0}
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from rlmetrics.core.reduce import Reduction, parse_reduction
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import Stat


@runtime_checkable
class State(Protocol):
    """``merge`` (associative, commutative), ``to_array`` / ``from_array`` (how it travels), ``reduce``
    (``{name: value}`` given its column's merged Stat), ``validate`` (ValueError unless data can give it)."""

    kind: ClassVar[str]

    def merge(self, other: Any) -> Any: ...

    def to_array(self) -> np.ndarray: ...

    @classmethod
    def from_array(cls, arr: np.ndarray) -> Any: ...

    def reduce(self, name: str, reduction: Reduction, stat: Stat) -> dict[str, float]: ...

    def validate(self) -> None: ...


class _Kinds(dict):
    """Kind name -> state class; a kind registered by its import path is imported at first lookup."""

    def __missing__(self, kind: str) -> Any:
        where = _LAZY.get(kind) if isinstance(kind, str) else None
        if where is None:
            raise KeyError(kind)
        module, _, attr = where.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if cls.kind != kind:
            raise TypeError(f"state kind {kind!r}: {where} has kind {cls.kind!r}")
        self[kind] = cls
        return cls


KINDS: dict[str, Any] = _Kinds({Sketch.kind: Sketch})
"""Every state kind by its wire name (:func:`register_state` adds one)."""
_LAZY: dict[str, str] = {}  # kind -> "module:Class", imported at its first lookup in KINDS
_COLUMNS: dict[str, str] = {}  # column name -> the kind that rides on it (and on no other column)


def register_state(kind: str, cls: type | str, *, column: str | None = None) -> None:
    """Make state ``kind`` travel: ``cls`` or its ``"module:Class"`` path (imported at first decode);
    ``column``: the one column that may carry it.
    >>> KINDS["prompts"].__name__  # registered by rlmetrics.metrics by path, imported here
    'PromptStats'
    >>> column_kind("_aux/difficulty/prompts/total", "total")
    'prompts'
    """
    if isinstance(cls, str):
        _LAZY[kind] = cls
        KINDS.pop(kind, None)
    else:
        KINDS[kind] = cls
    if column is not None:
        _COLUMNS[column] = kind


def column_kind(name: str, reduction: str) -> str | None:
    """The state kind a column carries: its registered kind, a sketch for a quantile reduction, or None.
    >>> column_kind("lat/p95", "p95"), column_kind("lat/mean", "mean")
    ('sketch', None)
    """
    kind = _COLUMNS.get(name)
    if kind is not None:
        return kind
    return Sketch.kind if parse_reduction(reduction).needs_sketch else None


def is_bound(kind: str) -> bool:
    """Whether states of ``kind`` ride only on the columns :func:`column_kind` gives them."""
    return kind == Sketch.kind or kind in _COLUMNS.values()


def encode_state(state: State) -> tuple[str, np.ndarray]:
    """``(kind, array)``: a state as it travels."""
    return state.kind, state.to_array()


def decode_state(kind: Any, arr: Any) -> State:
    """The state of :func:`encode_state`'s output; ValueError for an unknown kind or a bad array."""
    try:
        cls = KINDS[kind] if isinstance(kind, str) else None
    except KeyError:
        cls = None
    if cls is None:
        raise ValueError(f"unknown state kind {kind!r:.40}")
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"a {kind} state travels as a numpy array, got {type(arr).__name__}")
    return cls.from_array(arr)
