"""The step-keyed merge engine: pure Python + numpy, no Ray, no torch.

Workers hand the engine *contributions*: ``(client_id, step, seq, world_size, packed)`` where
``packed`` holds a schema (metric names and their reductions) and one ``(5, M)`` float64 stat array
(:data:`rlmetrics.stat.FIELDS`), plus quantile sketches for the names that need them. The engine
merges them per ``(step, name)``:

- a name is complete when ``world_size`` contributions arrived for it in that step;
- a step is complete when every name is complete and every registered client (one that has
  submitted at least once and not departed) has closed the step;
- :meth:`Aggregator.finalize` turns a step into a :class:`StepResult` — complete or partial, with
  ``meta`` naming the missing clients and metrics — and frees its state.

Contributions with the same schema are stacked and merged as matrices (names are resolved once per
schema, never per value). ``(client_id, step, seq)`` is merged once, so retries are harmless. The
engine is not thread-safe and never waits; backends add locking and waiting around it.

>>> agg = Aggregator()
>>> for rank, values in enumerate([[1.0, 2.0], [3.0, 4.0, 5.0]]):
...     metrics = {"critic/score/mean": values, "critic/score/max": values}
...     _ = agg.submit(f"rank{rank}", 0, 0, 2, pack(metrics))
...     agg.close(f"rank{rank}", 0)
>>> agg.is_complete(0)
True
>>> dict(agg.finalize(0))
{'critic/score/mean': 3.0, 'critic/score/max': 5.0}
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.metrics import AUX_PREFIX, derive_metrics, validation_metrics
from rlmetrics.reduce import DEFAULT_RENAMES, MEAN, STD, Reduction, parse_reduction, rename, resolve
from rlmetrics.sketch import Sketch
from rlmetrics.stat import (
    MetricValueError,
    Stat,
    empty_arrays,
    merge_arrays,
    reduce_parts,
    scalar_value,
    stats_of_rows,
)

logger = logging.getLogger(__name__)

_BLOCK = 1 << 21  # floats stacked per schema and step before they are folded into one stat array
MAX_WORLD_SIZE = 1 << 32
"""Largest ``world_size`` (and node contribution count): the engine counts contributions in int64."""


class SubmissionError(ValueError):
    """A contribution the engine refuses; the message says which and why. Nothing of it was merged."""


class PartlyMergedError(SubmissionError):
    """A pre-merged contribution some of whose submissions were merged before (a client resent them
    on its own): the senders must resend theirs one by one, each merged once."""


# ----------------------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class Schema:
    """Metric names of a contribution and the reduction spec of each; ``id`` is a content hash."""

    names: tuple[str, ...]
    reductions: tuple[str, ...]
    id: bytes = field(default=b"", compare=False)
    needs_sketch: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, names: tuple[str, ...], reductions: tuple[str, ...]) -> Schema:
        h = hashlib.blake2b(digest_size=16)
        for n, r in zip(names, reductions):
            b = n.encode("utf-8", "surrogatepass")  # length-prefixed: a name may contain NUL bytes
            h.update(len(b).to_bytes(8, "little") + b + b"\0" + r.encode() + b"\0")
        return cls(names, reductions, h.digest(), any(parse_reduction(r).needs_sketch for r in reductions))


@dataclass
class Packed:
    """One contribution's numbers, in schema order: ``stats`` is a ``(5, M)`` stat array, or a
    1-D array of ``M`` values when every metric is a single observation (the common case of
    scalar metrics: one float per metric on the wire); sketches by column."""

    schema: Schema
    stats: np.ndarray
    sketches: dict[int, Sketch] = field(default_factory=dict)
    contributions: int = 1  # > 1: several ranks' contributions merged beforehand (a node aggregator)
    records: list = field(default_factory=list)  # (rank key, validation sample record) pairs


def _to_stat(name: str, value: Any, needs_sketch: bool, nan_strategy: str) -> Stat:
    if isinstance(value, Stat):
        if needs_sketch and value.sketch is None:
            raise MetricValueError(
                f"metric {name!r}: its reduction reads quantiles; "
                "build the Stat with Stat.of(..., sketch=True)"
            )
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
) -> Packed:
    """Summarize a ``{name: value}`` dict into a :class:`Packed` contribution.

    Values: numbers, lists, numpy arrays, torch tensors, :class:`Stat` or ``(value, weight)``.
    A bad value is left out; its message goes to ``errors`` (by name) when given, else the first
    one is raised as :class:`MetricValueError`. ``schemas`` caches schemas across calls.

    >>> p = pack({"a/mean": 2.0, "b/max": [1.0, 7.0]})
    >>> p.schema.names, p.schema.reductions, p.stats[4].tolist()
    (('a/mean', 'b/max'), ('mean', 'max'), [2.0, 7.0])
    """
    if schemas is not None:
        fast = _pack_scalars(metrics, nan_strategy, schemas)
        if fast is not None:
            return fast
    names: list[str] = []
    reductions: list[str] = []
    columns: list[np.ndarray | float] = []  # a float: one observation
    sketches: dict[int, Sketch] = {}
    failed: dict[str, str] = {}
    std_numbers: list[str] = []
    dropped: list[str] = []
    for name, value in metrics.items():
        try:
            if not isinstance(name, str) or not name:
                raise MetricValueError(f"metric name must be a non-empty str, got {name!r:.80}")
            reduction = resolve(name)
            v = None if reduction.needs_sketch else scalar_value(value, name)
            if v is not None and reduction is STD:  # a rank's own std, not an observation: average, as siiRL
                reduction = MEAN
                std_numbers.append(name)
            if v is not None and (nan_strategy == "propagate" or math.isfinite(v)):
                columns.append(v)
            else:
                stat = _to_stat(name, value if v is None else v, reduction.needs_sketch, nan_strategy)
                if isinstance(value, Stat) and stat is not value:
                    dropped.append(name)
                if stat.sketch is not None and reduction.needs_sketch:
                    sketches[len(names)] = stat.sketch
                columns.append(stat.to_array())
        except Exception as exc:  # whatever a value raises, it refuses that name only
            key = name if isinstance(name, str) else repr(name)
            failed[key] = str(exc)
            if not isinstance(exc, MetricValueError):
                failed[key] = (
                    f"metric {key!r}: cannot summarize {type(value).__name__} ({type(exc).__name__}: {exc})"
                )
            continue
        names.append(name)
        reductions.append(reduction.name)
    if dropped:
        warnings.warn(
            f"{len(dropped)} metric(s) {dropped[:3]}: a Stat summarizing non-finite values is dropped "
            "whole under nan_strategy='drop'; build it with Stat.of(..., nan_strategy='drop') to keep its "
            "finite values",
            stacklevel=2,
        )
    if std_numbers:
        warnings.warn(
            f"{len(std_numbers)} metric(s) {std_numbers[:3]}: a number under a std name is taken as one "
            "rank's std and averaged over ranks (siiRL's result); submit the data or a Stat for the exact "
            "pooled std",
            stacklevel=2,
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
        schemas[key[0]] = schema  # names alone: the key of the all-numbers fast path
    return Packed(schema, stats, sketches)


_FAST_TYPES = frozenset({float, int, np.float64, np.float32, np.int64, np.int32})


def _pack_scalars(metrics: Mapping[str, Any], nan_strategy: str, schemas: dict) -> Packed | None:
    """The steady-state path: names seen before with plain numbers become one vector (or None)."""
    schema = schemas.get(tuple(metrics))
    if schema is None or schema.needs_sketch:
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
    return Packed(schema, stats)


# ------------------------------------------------------------------------------------------ results
class StepResult(dict):
    """``{name: value}`` of one step, with ``step`` and ``meta``.

    ``meta``: ``complete`` (bool), ``missing_ranks`` (registered clients that did not close the
    step), ``missing_metrics`` (``{name: [received, expected]}``), ``empty`` (names with no
    observation, left out of the values), ``contributors`` (clients that submitted).
    """

    def __init__(self, values: Mapping[str, float], step: int, meta: dict) -> None:
        super().__init__(values)
        self.step = step
        self.meta = meta

    def __reduce__(self):  # keep step and meta across pickling (Ray)
        return (StepResult, (dict(self), self.step, self.meta))


class _Group:
    """Pending contributions of one schema in one step.

    Single-observation contributions (1-D) are stacked as plain values and summarized in one pass
    (:func:`~rlmetrics.stat.stats_of_rows`); others are stacked field-major for
    :func:`~rlmetrics.stat.reduce_parts`. Blocks are sized to hold about 2M floats.
    """

    __slots__ = ("cols", "rows", "n_rows", "parts", "n_parts", "received", "world_size")

    def __init__(self, cols: np.ndarray) -> None:
        self.cols = cols
        self.rows: np.ndarray | None = None
        self.n_rows = 0
        self.parts: np.ndarray | None = None
        self.n_parts = 0
        self.received = 0
        self.world_size = 0

    def add(self, stats: np.ndarray, world_size: int, contributions: int = 1) -> None:
        if stats.ndim == 1:
            if self.rows is None:
                self.rows = np.empty((max(4, min(256, _BLOCK // len(self.cols))), len(self.cols)))
            elif self.n_rows == len(self.rows):
                self._add_part(stats_of_rows(self.rows))
                self.n_rows = 0
            self.rows[self.n_rows] = stats
            self.n_rows += 1
        else:
            self._add_part(stats)
        self.received += contributions
        self.world_size = max(self.world_size, world_size)

    def _add_part(self, stats: np.ndarray) -> None:
        if self.parts is None:
            self.parts = np.empty((5, max(2, min(64, _BLOCK // (5 * len(self.cols)))), len(self.cols)))
        elif self.n_parts == self.parts.shape[1]:
            self.parts[:, 0] = reduce_parts(self.parts)
            self.n_parts = 1
        self.parts[:, self.n_parts] = stats
        self.n_parts += 1

    def fold(self) -> np.ndarray:
        """Everything received, as one ``(5, M)`` stat array."""
        if self.n_rows:
            self._add_part(stats_of_rows(self.rows[: self.n_rows]))
            self.n_rows = 0
        if self.n_parts > 1:
            self.parts[:, 0] = reduce_parts(self.parts[:, : self.n_parts])
            self.n_parts = 1
        return self.parts[:, 0]


@dataclass
class _Layout:
    cols: np.ndarray  # the step's global columns
    positions: list[np.ndarray] | None  # per group: its columns' positions in cols (None: one group)
    out_names: list[str]
    plain: list[tuple[Reduction, np.ndarray]]  # reductions of the stat array, with their positions
    quantiles: list[tuple[Reduction, int, int]]  # (reduction, position, column) read from sketches
    derived: bool  # auxiliary names present: derived metrics are computed from the merged values


@dataclass
class _Step:
    groups: dict[bytes, _Group] = field(default_factory=dict)
    sketches: dict[int, Sketch] = field(default_factory=dict)
    seen: set = field(default_factory=set)
    contributors: set = field(default_factory=set)
    closed: set = field(default_factory=set)
    records: list = field(default_factory=list)  # validation samples: (rank key, record)

    def counts(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Contributions received and expected per column (expected: the largest world_size given)."""
        received = np.zeros(n, np.int64)
        expected = np.zeros(n, np.int64)
        for g in self.groups.values():
            received[g.cols] += g.received
            expected[g.cols] = np.maximum(expected[g.cols], g.world_size)
        return received, expected


class Aggregator:
    """Step-keyed merge engine (see the module docstring).

    ``renames``: result-name prefix renames (default ``timing_s/`` → ``perf/delta_time/``).
    ``keep_results``: how many finalized results stay readable with :meth:`result`.
    """

    def __init__(self, *, renames: Mapping[str, str] | None = None, keep_results: int = 64) -> None:
        self.renames = dict(DEFAULT_RENAMES if renames is None else renames)
        self.keep_results = keep_results
        self.clients: set[str] = set()
        self.late = 0  # contributions that arrived after their step was finalized (dropped)
        self._names: list[str] = []
        self._out_names: list[str] = []
        self._reductions: list[str] = []
        self._index: dict[str, int] = {}
        self._by_out: dict[str, str] = {}  # result name -> metric name
        self._schemas: dict[bytes, tuple[Schema, np.ndarray]] = {}
        self._steps: dict[int, _Step] = {}
        self._results: OrderedDict[int, StepResult] = OrderedDict()
        self._finalized: set[int] = set()  # finalized steps >= _done_below
        self._done_below = 0  # every step below it counts as finalized
        self._nan_warned: set[str] = set()
        self._layouts: dict[tuple[bytes, ...], _Layout] = {}

    # -------------------------------------------------------------------------------- intake
    def _columns(self, schema: Schema) -> np.ndarray:
        known = self._schemas.get(schema.id)
        if known is not None:
            return known[1]
        if len(schema.names) != len(schema.reductions):
            raise SubmissionError(
                f"schema has {len(schema.names)} names but {len(schema.reductions)} reductions"
            )
        if len(set(schema.names)) != len(schema.names):
            raise SubmissionError("schema repeats a metric name")
        for red in schema.reductions:
            parse_reduction(red)
        new: dict[str, str] = {}
        for name in schema.names:
            if name not in self._index:
                out = rename(name, self.renames)
                other = self._by_out.get(out, new.get(out))
                if other is not None:  # two names, one result key: one value would silently vanish
                    raise SubmissionError(
                        f"metric {name!r} and metric {other!r} would both be reported as {out!r}"
                    )
                new[out] = name
        cols = np.empty(len(schema.names), np.int64)
        for i, (name, red) in enumerate(zip(schema.names, schema.reductions)):
            col = self._index.get(name)
            if col is None:
                col = self._index[name] = len(self._names)
                self._names.append(name)
                self._out_names.append(rename(name, self.renames))
                self._by_out[self._out_names[-1]] = name
                self._reductions.append(red)
            elif self._reductions[col] != red:
                logger.warning(
                    "metric %r: reduction %r requested, keeping %r", name, red, self._reductions[col]
                )
            cols[i] = col
        self._schemas[schema.id] = (schema, cols)
        return cols

    def submit(
        self,
        client_id: str,
        step: int,
        seq: int,
        world_size: int,
        packed: Packed,
        *,
        register: bool = True,
    ) -> bool:
        """Merge one contribution; False when ``(client_id, step, seq)`` was merged before or the
        step is already finalized (late). Raises :class:`SubmissionError` for a malformed one.

        ``register=False`` leaves the sender out of the clients whose step closing is awaited.
        """
        return self.submit_merged(((client_id, seq),), step, world_size, packed, register=register)

    def submit_merged(
        self,
        keys: tuple[tuple[str, int], ...],
        step: int,
        world_size: int,
        packed: Packed,
        *,
        register: bool = True,
    ) -> bool:
        """Merge a contribution that already merges the submissions ``keys`` (``(client_id, seq)``
        pairs) of one step, as a process pre-merges its clients'. All of them are new, or all were
        merged before (False); a mix is refused.

        >>> engine = Aggregator()
        >>> rows = stats_of_rows(np.array([[1.0], [3.0]]))  # two clients' values, pre-merged
        >>> both = Packed(pack({"r/mean": 1.0}).schema, rows, contributions=2)
        >>> engine.submit_merged((("a", 0), ("b", 0)), 0, 2, both), engine.submit("a", 0, 0, 2, both)
        (True, False)
        >>> engine.finalize(0)["r/mean"]
        2.0
        """
        if not (type(step) is int or isinstance(step, numbers.Integral)) or step < 0:
            raise SubmissionError(f"step must be a non-negative int, got {step!r}")
        if (
            not (type(world_size) is int or isinstance(world_size, numbers.Integral))
            or not 1 <= world_size <= MAX_WORLD_SIZE
        ):
            raise SubmissionError(
                f"world_size must be an int in [1, {MAX_WORLD_SIZE}], got {world_size!r:.80}"
            )
        step = int(step)
        stats = packed.stats
        m = len(packed.schema.names)
        if (
            not isinstance(stats, np.ndarray)
            or stats.dtype != np.float64
            or stats.shape not in ((5, m), (m,))
        ):
            raise SubmissionError(
                f"stats must be float64 of shape (5, {m}) or ({m},) for {m} metrics, "
                f"got {getattr(stats, 'shape', type(stats).__name__)}"
            )
        for col in packed.sketches:
            if not 0 <= col < m:
                raise SubmissionError(f"sketch for column {col} of {m} metrics")
        if type(packed.contributions) is not int or not 1 <= packed.contributions <= MAX_WORLD_SIZE:
            raise SubmissionError(f"contributions must be a positive int, got {packed.contributions!r}")
        if self.is_finalized(step):
            self.late += 1
            logger.warning("step %d is finalized; dropped a late contribution of %s", step, keys[0][0])
            return False
        cols = self._columns(packed.schema)
        st = self._steps.get(step)
        if st is None:
            st = self._steps[step] = _Step()
        seen = [key in st.seen for key in keys]
        if all(seen):
            return False
        if any(seen):
            raise PartlyMergedError(
                f"merged contribution of {len(keys)} submissions was partly merged before"
            )
        st.seen.update(keys)
        clients = {client_id for client_id, _ in keys}
        if register:
            self.clients.update(clients)
        st.contributors.update(clients)
        group = st.groups.get(packed.schema.id)
        if group is None:
            group = st.groups[packed.schema.id] = _Group(cols)
        group.add(stats, int(world_size), packed.contributions)
        st.records.extend(packed.records)
        for i, sk in packed.sketches.items():
            col = int(cols[i])
            st.sketches[col] = sk if col not in st.sketches else st.sketches[col].merge(sk)
        return True

    def close(self, client_id: str, step: int) -> None:
        """``client_id`` will send nothing more for ``step`` (a client's ``wait_submit``)."""
        if self.is_finalized(step):
            return
        st = self._steps.get(step)
        if st is None:
            st = self._steps[step] = _Step()
        st.closed.add(client_id)

    def register(self, client_id: str) -> None:
        """Wait for ``client_id`` to close every step from now on, before its first submission."""
        self.clients.add(client_id)

    def depart(self, client_id: str) -> None:
        """Stop waiting for ``client_id`` in steps that are not closed by it (a client's ``stop``)."""
        self.clients.discard(client_id)

    # ------------------------------------------------------------------------------- status
    def pending_steps(self) -> list[int]:
        return sorted(self._steps)

    def is_finalized(self, step: int) -> bool:
        return step < self._done_below or step in self._finalized

    def is_closed(self, step: int) -> bool:
        """Every registered client closed ``step`` (what a node aggregator waits for)."""
        st = self._steps.get(step)
        return st is not None and self.clients <= st.closed

    def is_complete(self, step: int) -> bool:
        """All names have their expected contributions and every registered client closed the step."""
        if not self.is_closed(step):
            return False
        received, expected = self._steps[step].counts(len(self._names))
        return not np.any(received < expected)

    def missing(self, step: int) -> tuple[list[str], dict[str, list[int]]]:
        """Registered clients that have not closed ``step``, and ``{name: [received, expected]}``."""
        st = self._steps.get(step)
        if st is None:
            return sorted(self.clients), {}
        received, expected = st.counts(len(self._names))
        short = np.nonzero(received < expected)[0]
        return (
            sorted(self.clients - st.closed),
            {self._names[c]: [int(received[c]), int(expected[c])] for c in short},
        )

    # -------------------------------------------------------------------------------- output
    def finalize(self, step: int) -> StepResult:
        """The step's result (partial when incomplete, with a warning); frees the step's state.

        A step finalized before returns its kept result (or an empty one when no longer kept).
        """
        if self.is_finalized(step):
            kept = self._results.get(step)
            return kept if kept is not None else StepResult({}, step, {"complete": False, "evicted": True})
        missing_ranks, missing_metrics = self.missing(step)
        st = self._steps.pop(step, None)
        complete = st is not None and not missing_ranks and not missing_metrics
        values, empty = self._values(st) if st is not None and st.groups else ({}, [])  # closed, no data
        meta = {
            "complete": complete,
            "missing_ranks": missing_ranks,
            "missing_metrics": missing_metrics,
            "empty": empty,
            "contributors": sorted(st.contributors) if st is not None else [],
        }
        if not complete:
            # A rank missing at a deadline is not waited for again until it submits again.
            self.clients.difference_update(missing_ranks)
            logger.warning(
                "step %d is partial: missing ranks %s, %d incomplete metric(s) %s",
                step,
                missing_ranks,
                len(missing_metrics),
                list(missing_metrics)[:5],
            )
        result = StepResult(values, step, meta)
        self._mark_finalized(step)
        self._results[step] = result
        while len(self._results) > self.keep_results:
            self._results.popitem(last=False)
        return result

    def closed_by_contributors(self, step: int) -> bool:
        """Every client that contributed to ``step`` closed it."""
        st = self._steps.get(step)
        return st is not None and bool(st.contributors) and st.contributors <= st.closed

    def take(self, step: int) -> list[tuple[Packed, int]]:
        """The step's merged contributions so far, one :class:`Packed` per schema with its
        contribution count, and the largest world_size given; the step starts afresh (a node
        forwards them upstream, and forwards what arrives later the same way)."""
        st = self._steps.pop(step, None)
        if st is None:
            return []
        out = []
        for sid, group in sorted(st.groups.items()):
            sketches = {}
            for i, col in enumerate(group.cols.tolist()):
                if col in st.sketches:  # a name in several schemas: its merged sketch goes once
                    sketches[i] = st.sketches.pop(col)
            packed = Packed(self._schemas[sid][0], group.fold().copy(), sketches, group.received)
            out.append((packed, group.world_size))
        if out:
            out[0][0].records.extend(st.records)
        return out

    def _layout(self, st: _Step) -> _Layout:
        """Columns, output names and reduction groups of a step, cached by its set of schemas."""
        key = tuple(st.groups)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        groups = list(st.groups.values())
        if len(groups) == 1:
            cols, positions = groups[0].cols, None
        else:
            allc = np.concatenate([g.cols for g in groups])
            _, first = np.unique(allc, return_index=True)
            cols = allc[np.sort(first)]
            pos_of = np.empty(len(self._names), np.int64)
            pos_of[cols] = np.arange(len(cols))
            positions = [pos_of[g.cols] for g in groups]
        by_red: dict[str, list[int]] = {}
        for i, c in enumerate(cols.tolist()):
            by_red.setdefault(self._reductions[c], []).append(i)
        reductions = [(parse_reduction(r), np.asarray(idx)) for r, idx in by_red.items()]
        lay = _Layout(
            cols=cols,
            positions=positions,
            out_names=[self._out_names[c] for c in cols.tolist()],
            plain=[(r, idx) for r, idx in reductions if not r.needs_sketch],
            quantiles=[(r, i, int(cols[i])) for r, idx in reductions if r.needs_sketch for i in idx.tolist()],
            derived=any(self._names[c].startswith(AUX_PREFIX) for c in cols.tolist()),
        )
        if len(self._layouts) >= 1024:
            self._layouts.clear()
        self._layouts[key] = lay
        return lay

    def _mark_finalized(self, step: int) -> None:
        self._finalized.add(step)
        # Steps below every pending step count as finalized: the set of finalized steps stays small.
        floor = min(self._steps) if self._steps else max(self._finalized) + 1
        if floor > self._done_below:
            self._done_below = floor
            self._finalized = {s for s in self._finalized if s >= floor}

    def _values(self, st: _Step) -> tuple[dict[str, float], list[str]]:
        lay = self._layout(st)
        groups = list(st.groups.values())
        if lay.positions is None:
            total = groups[0].fold()
        else:
            total = empty_arrays(len(lay.cols))
            for group, pos in zip(groups, lay.positions):
                total[:, pos] = merge_arrays(total[:, pos], group.fold())
        out = np.empty(len(lay.cols))
        for red, idx in lay.plain:
            out[idx] = red.apply_arrays(total[:, idx])
        for red, i, col in lay.quantiles:
            sk = st.sketches.get(col)
            out[i] = red.apply(Stat.from_array(total[:, i], sketch=sk)) if sk is not None else math.nan
        has_data = total[0] > 0
        if has_data.all():
            values, empty = dict(zip(lay.out_names, out.tolist())), []
        else:
            flags = has_data.tolist()
            values = {n: v for n, v, ok in zip(lay.out_names, out.tolist(), flags) if ok}
            empty = [n for n, ok in zip(lay.out_names, flags) if not ok]
        if lay.derived:
            values = derive_metrics(values)
        if st.records:  # computed once over every rank's samples, in rank order
            values.update(validation_metrics(st.records))
        if not np.isfinite(out[has_data]).all():
            bad = [n for n, v in values.items() if not math.isfinite(v) and n not in self._nan_warned]
            if bad:
                self._nan_warned.update(bad)
                logger.warning("non-finite value in metric(s) %s", bad[:10])
        return values, empty

    def finalized_state(self) -> tuple[int, list[int]]:
        """``(done_below, finalized)``: every step below ``done_below`` and those listed are finalized."""
        return self._done_below, sorted(self._finalized)

    def export_state(self, results: int = 2) -> dict:
        """What a restarted aggregator needs to resume (JSON-serializable): registered clients,
        finalized steps, and the newest ``results`` results — a restart between finalizing a step
        and the reply reaching its reader leaves the step finalized, and the retried read finds it.

        >>> engine = Aggregator()
        >>> engine.submit("a", 0, 0, 1, pack({"x": 2.0}))  # merged: True
        True
        >>> _ = engine.finalize(0)
        >>> again = Aggregator()
        >>> again.restore_state(engine.export_state())
        >>> again.result(0)["x"], again.is_finalized(0)
        (2.0, True)
        """
        newest = list(self._results.items())[-results:] if results > 0 else []
        return {
            "clients": sorted(self.clients),
            "done_below": self._done_below,
            "finalized": sorted(self._finalized),
            "results": [[step, dict(res), res.meta] for step, res in newest],
        }

    def restore_state(self, state: Mapping) -> None:
        """Resume from :meth:`export_state` (of an earlier incarnation)."""
        self.clients = set(state["clients"])
        self._done_below = int(state["done_below"])
        self._finalized = set(state["finalized"])
        for step, values, meta in state.get("results", ()):
            self._results[int(step)] = StepResult(values, int(step), meta)

    def result(self, step: int) -> StepResult | None:
        """A kept finalized result, or None."""
        return self._results.get(step)

    def finalize_pending(self, up_to: int | None = None) -> StepResult:
        """Finalize every pending step (``<= up_to`` when given), oldest first; return the newest.

        This is the seed's ``wait_final_res``: everything that arrived is aggregated now. With nothing
        pending, the newest kept result (empty when there is none).
        """
        steps = [s for s in self.pending_steps() if up_to is None or s <= up_to]
        results = [self.finalize(s) for s in steps]
        if results:
            return results[-1]
        if self._results:
            return self._results[max(self._results)]
        return StepResult({}, -1, {"complete": True, "missing_ranks": [], "missing_metrics": {}, "empty": []})
