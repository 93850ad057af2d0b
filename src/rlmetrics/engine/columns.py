"""The names the engine knows: a column per name, reused across steps and schemas; a name whose result
key another has is refused alone; unused schemas are forgotten (docs/steps.md, "Reading a step").

>>> from rlmetrics.packing import pack
>>> index = ColumnIndex({"timing_s/": "perf/delta_time/"})
>>> index.of(pack({"a/mean": 1.0, "timing_s/gen": 2.0}).schema, step=0).cols.tolist()
[0, 1]
>>> known = index.of(pack({"perf/delta_time/gen": 1.0, "a/mean": 2.0}).schema, step=1)
>>> known.cols.tolist(), list(known.refused)  # the colliding name alone is refused
([0], ['perf/delta_time/gen'])
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rlmetrics.core.reduce import parse_reduction, rename
from rlmetrics.messages import SubmissionError
from rlmetrics.packing import Schema

logger = logging.getLogger(__name__)


@dataclass
class Known:
    """A schema the engine learned: the columns of the names it accepted, and those it refused."""

    schema: Schema
    cols: np.ndarray  # columns of the accepted names, in schema order
    at: np.ndarray  # column of every name of the schema, -1 where refused
    keep: np.ndarray | None  # positions of the accepted names; None: all of them
    refused: dict[str, str]

    def accepted(self) -> Schema:
        """The schema of the accepted names alone."""
        if self.keep is None:
            return self.schema
        names = [self.schema.names[i] for i in self.keep.tolist()]
        return Schema.of(tuple(names), tuple(self.schema.reductions[i] for i in self.keep.tolist()))


class ColumnIndex:
    """Names to columns, and schemas to their :class:`Known` columns. ``names`` (None: freed),
    ``out_names`` and ``reductions`` are by column; ``forgotten_names``: result names of freed columns."""

    def __init__(self, renames: Mapping[str, str]) -> None:
        self.renames = dict(renames)
        self.names: list[str | None] = []
        self.out_names: list[str] = []
        self.reductions: list[str] = []
        self.forgotten_names: list[str] = []
        self._refs: list[int] = []  # by column: how many kept schemas have it
        self._free: list[int] = []
        self._index: dict[str, int] = {}
        self._by_out: dict[str, str] = {}  # result name -> metric name
        self._schemas: dict[bytes, Known] = {}
        self._used: dict[bytes, int] = {}  # schema id -> newest step it was submitted for
        self._forgotten: list[bytes] = []  # schema ids dropped since the last drain_forgotten()

    def __len__(self) -> int:
        return len(self.names)

    def of(self, schema: Schema, step: int) -> Known:
        """The columns of ``schema``'s names, used at ``step`` (SubmissionError: malformed)."""
        self._used[schema.id] = max(step, self._used.get(schema.id, step))
        known = self._schemas.get(schema.id)
        if known is not None:
            return known
        if len(schema.names) != len(schema.reductions):
            del self._used[schema.id]
            raise SubmissionError(
                f"schema has {len(schema.names)} names but {len(schema.reductions)} reductions"
            )
        try:
            known = self._learn(schema)
        except (SubmissionError, ValueError):
            del self._used[schema.id]
            raise
        self._schemas[schema.id] = known
        for c in known.cols.tolist():
            self._refs[c] += 1
        return known

    def _learn(self, schema: Schema) -> Known:
        """Columns for a new schema's names; a name whose result key another has is refused alone."""
        if len(set(schema.names)) != len(schema.names):
            raise SubmissionError("schema repeats a metric name")
        for red in schema.reductions:
            parse_reduction(red)
        new: dict[str, str] = {}
        refused: dict[str, str] = {}
        for name in schema.names:
            if name not in self._index:
                out = rename(name, self.renames)
                other = self._by_out.get(out, new.get(out))
                if other is not None:
                    refused[name] = f"metric {name!r} and metric {other!r} would both be reported as {out!r}"
                else:
                    new[out] = name
        at = np.full(len(schema.names), -1, np.int64)
        for i, (name, red) in enumerate(zip(schema.names, schema.reductions)):
            if name in refused:
                continue
            col = self._index.get(name)
            if col is None:
                out = rename(name, self.renames)
                if self._free:
                    col = self._free.pop()
                    self.names[col], self.out_names[col], self.reductions[col] = name, out, red
                else:
                    col = len(self.names)
                    self.names.append(name)
                    self.out_names.append(out)
                    self.reductions.append(red)
                    self._refs.append(0)
                self._index[name] = col
                self._by_out[out] = name
            elif self.reductions[col] != red:
                logger.warning(
                    "metric %r: reduction %r requested, keeping %r, the reduction of its first "
                    "submission in this run: register_reduction before a name's first submit_metric, "
                    "in every rank's process",
                    name, red, self.reductions[col],
                )  # fmt: skip
            at[i] = col
        keep = np.nonzero(at >= 0)[0] if refused else None
        return Known(schema, at if keep is None else at[keep], at, keep, refused)

    def forget(self, horizon: int, busy: set[bytes]) -> bool:
        """Drop the schemas unused since ``horizon`` and not ``busy``, and their names; whether any went."""
        old = [sid for sid, used in self._used.items() if used < horizon and sid not in busy]
        if not old:
            return False
        for sid in old:
            del self._used[sid]
            for col in self._schemas.pop(sid).cols.tolist():
                self._refs[col] -= 1
                if not self._refs[col]:  # no kept schema has the name: free its column
                    name = self.names[col]
                    del self._index[name]
                    self._by_out.pop(self.out_names[col], None)
                    self.forgotten_names.append(self.out_names[col])
                    self.names[col] = None
                    self._free.append(col)
        self._forgotten.extend(old)
        return True

    def drain_forgotten(self) -> list[bytes]:
        """Schema ids dropped since the last call (a receiver drops their names from its table)."""
        out, self._forgotten = self._forgotten, []
        return out

    def column(self, name: str) -> int | None:
        """The column of ``name``, None when it has none."""
        return self._index.get(name)

    def accepted(self, sid: bytes) -> Schema:
        """The schema of the accepted names of a known schema id."""
        return self._schemas[sid].accepted()

    def counts(self) -> dict[str, int]:
        return {"names": len(self._index), "columns": len(self.names), "schemas": len(self._schemas)}
