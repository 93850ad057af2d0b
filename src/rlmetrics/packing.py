"""A client's submission as the engine takes it: a :class:`Schema` and a :class:`Packed` contribution,
made by :func:`pack` from a ``{name: value}`` dict (values: docs/reductions.md, "The value policy").

>>> p = pack({"a/mean": 2.0, "b/max": [1.0, 7.0]})
>>> p.schema.names, p.schema.reductions, p.stats[4].tolist()
(('a/mean', 'b/max'), ('mean', 'max'), [2.0, 7.0])
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.core.groups import GROUP_PREFIX
from rlmetrics.core.reduce import MEAN, STD, Reduction, parse_reduction, resolve
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.stat import NAN_STRATEGIES, MetricValueError, Stat, invalid_column, scalar_value
from rlmetrics.core.states import State
from rlmetrics.messages import ValueWarning, caller_level

MAX_WORLD_SIZE = 1 << 32
"""Largest ``world_size`` (and node contribution count): the engine counts contributions in int64."""


@dataclass(frozen=True)
class Schema:
    """Metric names of a contribution and the reduction spec of each; ``id`` is a content hash."""

    names: tuple[str, ...]
    reductions: tuple[str, ...]
    id: bytes = field(default=b"", compare=False)
    needs_sketch: bool = field(default=False, compare=False)
    grouped: bool = field(default=False, compare=False)  # a name starts with ``group/``

    @classmethod
    def of(cls, names: tuple[str, ...], reductions: tuple[str, ...]) -> Schema:
        h = hashlib.blake2b(digest_size=16)
        for n, r in zip(names, reductions):
            b = n.encode("utf-8", "surrogatepass")  # length-prefixed: a name may contain NUL bytes
            h.update(len(b).to_bytes(8, "little") + b + b"\0" + r.encode() + b"\0")
        sketch = any(parse_reduction(r).needs_sketch for r in reductions)
        return cls(names, reductions, h.digest(), sketch, any(n.startswith(GROUP_PREFIX) for n in names))


@dataclass
class Packed:
    """One contribution's numbers, in schema order: ``stats`` is a ``(5, M)`` stat array, or ``M``
    values when every metric is a single observation; ``states``: sketches, samples, ... by column."""

    schema: Schema
    stats: np.ndarray
    states: dict[int, State] = field(default_factory=dict)
    contributions: int = 1  # > 1: several ranks' contributions merged beforehand (a node aggregator)
    checked: bool = False  # made by pack from data: the engine checks the values of the others only


def _to_stat(name: str, value: Any, needs_sketch: bool, nan_strategy: str) -> Stat:
    if isinstance(value, Stat):
        sketch = value.sketch
        if needs_sketch and sketch is None:
            raise MetricValueError(
                f"metric {name!r}: its reduction reads quantiles; "
                "build the Stat with Stat.of(..., sketch=True)"
            )
        bad = invalid_column(value.to_array()[:, None])  # a Stat built by hand may hold anything
        if bad is not None:
            raise MetricValueError(f"metric {name!r}: the Stat has {bad[1]}")
        if needs_sketch and sketch is not None:
            try:
                sketch.validate()
            except ValueError as exc:
                raise MetricValueError(f"metric {name!r}: {exc}") from None
        if nan_strategy == "propagate" or value.finite:
            return value
        if nan_strategy == "error":
            raise MetricValueError(
                f"metric {name!r}: the Stat summarizes non-finite values (nan_strategy='error')"
            )
        return Stat(sketch=None if value.sketch is None else Sketch())  # "drop": its values are not separable
    if isinstance(value, tuple):
        if len(value) != 2:
            raise MetricValueError(
                f"metric {name!r}: a tuple must be (value, weight); use a list for many observations"
            )
        return Stat.of(value[0], weight=value[1], sketch=needs_sketch, nan_strategy=nan_strategy, name=name)
    if isinstance(value, (dict, set, str, bytes)) or value is None:
        raise MetricValueError(
            f"metric {name!r}: expected a number, list, array, tensor or Stat, got {value!r:.80}"
        )
    return Stat.of(value, sketch=needs_sketch, nan_strategy=nan_strategy, name=name)


def pack(
    metrics: Mapping[str, Any],
    nan_strategy: str = "propagate",
    schemas: dict | None = None,
    errors: dict[str, str] | None = None,
    overrides: Mapping[str, Reduction] | None = None,
) -> Packed:
    """Summarize ``{name: value}`` into one contribution (values: docs/reductions.md, "The value policy").

    Args:
        metrics: name → a number, list, array, tensor, :class:`Stat` or ``(value, weight)``.
        nan_strategy: ``"propagate"``, ``"drop"`` or ``"error"`` for non-finite values.
        schemas: a cache of schemas across calls (None: none).
        errors: a dict that gets each refused name's message; the others are packed (None: raise).
        overrides: reductions other than the names' own, by name (a naming profile).

    Returns:
        A :class:`Packed` of the names kept, in ``metrics``' order.

    Raises:
        MetricValueError: a value that cannot be summarized (a bad name too), when ``errors`` is None.
        ValueError: ``nan_strategy`` not one of the three.

    Example:
    >>> from rlmetrics.packing import pack
    >>> p = pack({"a/mean": 2.0, "b/max": [1.0, 7.0]})
    >>> p.schema.names, p.schema.reductions, p.stats[4].tolist()
    (('a/mean', 'b/max'), ('mean', 'max'), [2.0, 7.0])
    >>> errors = {}
    >>> pack({"a/mean": 2.0, "c": None}, errors=errors).schema.names, list(errors)
    (('a/mean',), ['c'])
    """
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    if schemas is not None:
        fast = pack_known(metrics, nan_strategy, schemas, grouped=True)
        if fast is not None:
            return fast
    names: list[str] = []
    reductions: list[str] = []
    columns: list[np.ndarray | float] = []  # a float: one observation
    states: dict[int, State] = {}
    failed: dict[str, str] = {}
    std_numbers: list[str] = []
    dropped: list[str] = []

    def reduction_of(name: str) -> Reduction:
        return overrides[name] if overrides and name in overrides else resolve(name)

    tensors = Stat.of_tensors(metrics, lambda n: reduction_of(n).needs_sketch, nan_strategy)  # one host copy
    for name, value in metrics.items():
        try:
            if not isinstance(name, str) or not name:
                raise MetricValueError(f"metric name must be a non-empty str, got {name!r:.80}")
            reduction = reduction_of(name)
            stat = tensors.get(name)  # a tensor, already summarized
            v = None if reduction.needs_sketch or stat is not None else scalar_value(value, name)
            one = v is not None or (stat is not None and not isinstance(value, tuple) and value.dim() == 0)
            if one and reduction is STD:  # a rank's own std, not an observation: average, as siiRL
                reduction = MEAN
                std_numbers.append(name)
            if v is not None and (nan_strategy == "propagate" or math.isfinite(v)):
                columns.append(v)
            else:
                if stat is None:
                    stat = _to_stat(name, value if v is None else v, reduction.needs_sketch, nan_strategy)
                    if isinstance(value, Stat) and stat is not value:
                        dropped.append(name)
                if isinstance(stat, MetricValueError):
                    raise stat
                if stat.sketch is not None and reduction.needs_sketch:
                    states[len(names)] = stat.sketch
                columns.append(stat.to_array())
        except Exception as exc:  # whatever a value raises, it refuses that name only
            shown = name if isinstance(name, str) else repr(name)
            failed[shown] = str(exc)
            if not isinstance(exc, MetricValueError):
                failed[shown] = (
                    f"metric {shown!r}: cannot summarize {type(value).__name__} ({type(exc).__name__}: {exc})"
                )
            continue
        names.append(name)
        reductions.append(reduction.name)
    if dropped:
        warnings.warn(
            f"{len(dropped)} metric(s) {dropped[:3]}: a Stat summarizing non-finite values is dropped "
            "whole under nan_strategy='drop'; build it with Stat.of(..., nan_strategy='drop') to keep its "
            "finite values",
            ValueWarning,
            stacklevel=caller_level(),
        )
    if std_numbers:
        warnings.warn(
            f"{len(std_numbers)} metric(s) {std_numbers[:3]}: a number under a std name is taken as one "
            "rank's std and averaged over ranks (siiRL's result); submit the data or a Stat for the exact "
            "pooled std",
            ValueWarning,
            stacklevel=caller_level(),
        )
    if failed and errors is None:
        raise MetricValueError(next(iter(failed.values())))
    if errors is not None:
        errors.update(failed)
    if all(isinstance(c, float) for c in columns):
        stats = np.array(columns, dtype=np.float64)
    else:
        stats = np.empty((5, len(names)))
        for i, col in enumerate(columns):
            stats[:, i] = (1.0, col, 0.0, col, col) if isinstance(col, float) else col
    key = (tuple(names), tuple(reductions))
    schema = schemas.get(key) if schemas is not None else None
    if schema is None:
        schema = Schema.of(*key)
        if schemas is not None:
            schemas[key] = schema
    if schemas is not None and stats.ndim == 1:
        schemas[_KNOWN, key[0]] = schema  # names alone: the key of the all-numbers fast path
    return Packed(schema, stats, states, checked=True)


_KNOWN = "names"  # tags the fast path's keys: a dict with tuple keys never meets (names, reductions)
_FAST_TYPES = frozenset({float, int, np.float64, np.float32, np.int64, np.int32})


def pack_known(
    metrics: Mapping[str, Any], nan_strategy: str, schemas: dict, grouped: bool = False
) -> Packed | None:
    """The steady-state path: names :func:`pack` saw before (in ``schemas``) with plain numbers
    become one vector; else None (also for grouped names unless ``grouped``).

    >>> schemas = {}
    >>> pack_known({"a/mean": 1.0}, "propagate", schemas) is None
    True
    >>> _ = pack({"a/mean": 1.0}, schemas=schemas)
    >>> pack_known({"a/mean": 2.0}, "propagate", schemas).stats.tolist()
    [2.0]
    """
    schema = schemas.get((_KNOWN, tuple(metrics)))
    if schema is None or not schema.names or schema.needs_sketch or (schema.grouped and not grouped):
        return None
    values = metrics.values()
    if not set(map(type, values)) <= _FAST_TYPES:
        return None
    try:
        stats = np.fromiter(values, np.float64, len(metrics))
    except OverflowError:  # an int beyond float64: pack refuses that name alone
        return None
    if nan_strategy != "propagate" and not np.isfinite(stats).all():
        return None
    return Packed(schema, stats, checked=True)
