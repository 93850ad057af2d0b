"""One step's pending state and its reduction to values, the engine's inner loop: :class:`Step`,
:class:`Group`, :func:`layout_of` (once per set of schemas) and :func:`reduce_step`.

>>> from rlmetrics.engine.columns import ColumnIndex
>>> from rlmetrics.packing import pack
>>> columns = ColumnIndex({})
>>> packed = pack({"reward/mean": [1.0, 2.0, 6.0]})
>>> known = columns.of(packed.schema, step=0)
>>> st = Step()
>>> st.groups[packed.schema.id, 1] = Group(known.cols, world_size=1)
>>> st.groups[packed.schema.id, 1].add(packed.stats)
>>> reduce_step(st, layout_of(st, columns), columns)
({'reward/mean': 3.0}, [], {})
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmetrics.core.histogram import Histogram
from rlmetrics.core.reduce import Reduction, parse_reduction
from rlmetrics.core.stat import Stat, empty_arrays, merge_arrays, reduce_parts, stats_of_rows
from rlmetrics.core.states import State
from rlmetrics.engine.columns import ColumnIndex
from rlmetrics.engine.derived import Derived, derive, is_aux

_BLOCK = 1 << 21  # floats stacked per schema and step before they are folded into one stat array


class Group:
    """Pending contributions of one schema and ``world_size`` (apart, so a root sees ranks disagree
    through a node) in one step, stacked in blocks and folded into one ``(5, M)`` stat array."""

    __slots__ = (
        "cols",
        "rows",
        "n_rows",
        "parts",
        "n_parts",
        "received",
        "world_size",
        "keys",
        "conflicting",
    )

    def __init__(self, cols: np.ndarray, world_size: int) -> None:
        self.cols = cols
        self.keys: list[tuple[str, int]] = []  # the (client_id, seq) of every contribution merged
        self.rows: np.ndarray | None = None
        self.n_rows = 0
        self.parts: np.ndarray | None = None
        self.n_parts = 0
        self.received = 0
        self.world_size = world_size
        self.conflicting: np.ndarray | None = None  # columns first given another world_size (Step.expect)

    def add(self, stats: np.ndarray, contributions: int = 1) -> None:
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
class Layout:
    """Columns, output names and reduction groups of a step (cached by its set of schemas)."""

    cols: np.ndarray  # the step's global columns
    positions: list[np.ndarray] | None  # per group: its columns' positions in cols (None: one group)
    out_names: list[str]
    plain: list[tuple[Reduction, np.ndarray]]  # reductions of the stat array, with their positions
    quantiles: list[int]  # positions whose reduction reads a sketch (NaN where the step has none)
    hists: list[str]  # output names whose reduction is a histogram (never among the values)
    derived: bool  # auxiliary names present: derived metrics are computed from the merged values


@dataclass
class Step:
    """One pending step: contributions by ``(schema id, world_size)``, states by column, who took part."""

    groups: dict[tuple[bytes, int], Group] = field(default_factory=dict)
    states: dict[int, State] = field(default_factory=dict)  # sketches, validation samples: by column
    seen: set = field(default_factory=set)
    contributors: set = field(default_factory=set)
    closed: set = field(default_factory=set)
    refused: dict = field(default_factory=dict)  # names refused in this step: their reason
    world_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # by column, 0: none
    givers: list = field(default_factory=list)  # who first gave a column its world_size (text)
    given_by: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # by column: in givers
    conflicts: dict = field(default_factory=dict)  # column -> why (its ranks disagree on world_size)

    def expect(self, cols: np.ndarray, world_size: int, giver: str, n: int) -> np.ndarray | None:
        """Note ``giver``'s ``world_size`` for ``cols`` (of ``n``); those given another before, or None."""
        if not self.givers:  # the step's first group
            self.world_sizes = np.zeros(n, np.int64)
            self.world_sizes[cols] = world_size
            self.given_by = np.zeros(n, np.int64)
            self.givers.append(giver)
            return None
        if len(self.world_sizes) < n:
            grow = n - len(self.world_sizes)
            self.world_sizes = np.concatenate([self.world_sizes, np.zeros(grow, np.int64)])
            self.given_by = np.concatenate([self.given_by, np.zeros(grow, np.int64)])
        given = self.world_sizes[cols]
        same = given == world_size
        if same.all():
            return None
        new = cols[given == 0]
        if len(new):
            self.world_sizes[new] = world_size
            self.given_by[new] = len(self.givers)
            self.givers.append(giver)
        conflicting = cols[~same & (given != 0)]
        return conflicting if len(conflicting) else None

    def counts(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Contributions received and expected per column (expected: the largest world_size given)."""
        received = np.zeros(n, np.int64)
        expected = np.zeros(n, np.int64)
        for g in self.groups.values():
            received[g.cols] += g.received
            expected[g.cols] = np.maximum(expected[g.cols], g.world_size)
        return received, expected


def layout_of(st: Step, columns: ColumnIndex) -> Layout:
    """The :class:`Layout` of a step's schemas (its groups, in order)."""
    groups = list(st.groups.values())
    if len(groups) == 1:
        cols, positions = groups[0].cols, None
    else:
        allc = np.concatenate([g.cols for g in groups])
        _, first = np.unique(allc, return_index=True)
        cols = allc[np.sort(first)]
        pos_of = np.empty(len(columns), np.int64)
        pos_of[cols] = np.arange(len(cols))
        positions = [pos_of[g.cols] for g in groups]
    by_red: dict[str, list[int]] = {}
    for i, c in enumerate(cols.tolist()):
        by_red.setdefault(columns.reductions[c], []).append(i)
    reductions = [(parse_reduction(r), np.asarray(idx)) for r, idx in by_red.items()]
    return Layout(
        cols=cols,
        positions=positions,
        out_names=[columns.out_names[c] for c in cols.tolist()],
        plain=[(r, idx) for r, idx in reductions if not r.needs_sketch],
        quantiles=[i for r, idx in reductions if r.needs_sketch for i in idx.tolist()],
        hists=[columns.out_names[cols[i]] for r, idx in reductions if r.histogram for i in idx.tolist()],
        derived=any(is_aux(columns.names[c]) for c in cols.tolist()),
    )


def reduce_step(
    st: Step, lay: Layout, columns: ColumnIndex, derived: Sequence[Derived] = ()
) -> tuple[dict[str, float], list[str], dict[str, Any]]:
    """``(values, empty, side)``: the values by output name (``derived`` computed), the names without
    data, and what is no float (histograms, and lists of names such as a stage's slowest ranks)."""
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
    out[lay.quantiles] = math.nan  # unless a sketch reduces them
    extra, side = _reduce_states(st, lay, total, out, columns)
    has_data = total[0] > 0
    if has_data.all():
        values, empty = dict(zip(lay.out_names, out.tolist())), []
    else:
        flags = has_data.tolist()
        values = {n: v for n, v, ok in zip(lay.out_names, out.tolist(), flags) if ok}
        empty = [n for n, ok in zip(lay.out_names, flags) if not ok]
    for name in lay.hists:
        values.pop(name, None)
    if lay.derived:
        values = derive(values, derived)
    values.update(extra)
    return values, empty, side


def _reduce_states(
    st: Step, lay: Layout, total: np.ndarray, out: np.ndarray, columns: ColumnIndex
) -> tuple[dict[str, float], dict[str, Any]]:
    """Each state's values: its own column's into ``out`` (or a histogram), the rest returned."""
    extra: dict[str, float] = {}
    histograms: dict[str, Any] = {}
    if not st.states:
        return extra, histograms
    position = {c: i for i, c in enumerate(lay.cols.tolist())}
    for col, state in st.states.items():
        i = position[col]
        name = lay.out_names[i]
        got = state.reduce(name, parse_reduction(columns.reductions[col]), Stat.from_array(total[:, i]))
        if name in got:
            value = got.pop(name)
            if isinstance(value, Histogram):
                histograms[name] = value
            elif value is not None:
                out[i] = value
        for key, value in got.items():
            if isinstance(value, (list, tuple)):
                histograms[key] = [str(v) for v in value]
            else:
                extra[key] = value
    return extra, histograms
