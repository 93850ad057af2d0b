"""Wire format between clients and a remote aggregator: names once per schema, then numbers.

A message is ``(VERSION, items, close, schemas, resync)`` of ints, bytes and small tuples; an item is
``(step, seq, world_size, schema_id, stats, {column: (kind, array)}, contributions)``: ``seq`` a
client's number or a node's ``(client_id, seq)`` keys, ``stats`` raw little-endian float64 bytes (``M``
values or a ``(5, M)`` array), the dict its other states (:func:`~rlmetrics.core.states.encode_state`);
``schemas`` holds ``{schema_id: (names, reductions)}`` the receiver lacks (it reports unknown ids
back). :func:`decode` checks the form, :func:`check_contribution` the values.

>>> from rlmetrics.packing import pack
>>> p = pack({"a/mean": 1.0, "b/max": 2.0})
>>> msg = encode([(0, 0, 2, p)], [0], send_names=True)
>>> table = SchemaTable()
>>> items, close, unknown = decode(msg, table)
>>> items[0][3].stats.tolist(), close, unknown
([1.0, 2.0], [0], [])
>>> decode(encode([(1, 1, 2, p)], [], send_names=False), SchemaTable())[2] == [p.schema.id]
True
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlmetrics.core.reduce import parse_reduction
from rlmetrics.core.stat import invalid_column
from rlmetrics.core.states import State, column_kind, decode_state, encode_state, is_bound
from rlmetrics.messages import MAX_STEP, OnBehalf, Submission, SubmissionError
from rlmetrics.packing import Packed, Schema

VERSION = 4
# (step, seq or a merged item's (client_id, seq) keys, world_size, packed)


def encode(items: list[Submission], close: list, send_names: Any, resync: bool = False) -> tuple:
    """A message for ``items`` and closes; ``send_names``: a bool, or ``f(schema_id)``: whose names go."""
    wants = send_names if callable(send_names) else (lambda _sid: send_names)
    schemas: dict[bytes, tuple] = {}
    out = []
    for step, seq, world_size, packed in items:
        sid = packed.schema.id
        if sid not in schemas and wants(sid):
            schemas[sid] = (packed.schema.names, packed.schema.reductions)
        states = {col: encode_state(state) for col, state in packed.states.items()}
        out.append((step, seq, world_size, sid, _float_bytes(packed.stats), states, packed.contributions))
    return (VERSION, out, list(close), schemas, resync)


def _float_bytes(arr: np.ndarray) -> bytes:
    return arr.astype("<f8", copy=False).tobytes()


def _floats(data: Any, max_values: int) -> np.ndarray:
    """The float64s of ``data``; SubmissionError unless it is bytes of at most ``max_values`` of them."""
    if type(data) is not bytes or len(data) % 8 or len(data) > 8 * max_values:
        got = f"{len(data)} bytes" if type(data) is bytes else type(data).__name__  # no repr: it may be huge
        raise SubmissionError(f"stats must be the bytes of at most {max_values} float64s, got {got}")
    return np.frombuffer(data, dtype="<f8")


class SchemaTable:
    """The receiver's schemas by id; it learns them from messages."""

    def __init__(self) -> None:
        self.schemas: dict[bytes, Schema] = {}

    def learn(self, sid: Any, entry: Any) -> None:
        """Learn schema ``sid`` from its ``(names, reductions)``; SubmissionError for a malformed one."""
        if not isinstance(sid, bytes):
            raise SubmissionError(f"schema id {sid!r:.40} is not bytes")
        if sid in self.schemas:
            return
        if not (
            isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(e, (tuple, list)) for e in entry)
        ):
            raise SubmissionError(f"schema {sid.hex()}: not a (names, reductions) pair")
        names, reductions = tuple(entry[0]), tuple(entry[1])
        if len(names) != len(reductions):
            raise SubmissionError(f"schema has {len(names)} names but {len(reductions)} reductions")
        for name, reduction in zip(names, reductions):
            if not isinstance(name, str) or not name:
                raise SubmissionError(f"metric name must be a non-empty str, got {name!r:.80}")
            try:
                parse_reduction(reduction if isinstance(reduction, str) else None)
            except ValueError:
                raise SubmissionError(f"metric {name!r}: unknown reduction {reduction!r:.40}") from None
        schema = Schema.of(names, reductions)
        if schema.id != sid:
            raise SubmissionError("schema id does not match its names")
        self.schemas[sid] = schema


def decode(msg: tuple, table: SchemaTable) -> tuple[list[Submission], list, list[bytes]]:
    """Known-schema items, closes and unknown schema ids; raises only :class:`SubmissionError` (malformed)."""
    try:
        version, raw_items, close, schemas, _resync = msg
    except (TypeError, ValueError):
        raise SubmissionError("malformed message") from None
    if type(version) is not int or version != VERSION:
        raise SubmissionError(f"wire version {version!r:.40}, expected {VERSION}")
    if not isinstance(schemas, dict):
        raise SubmissionError(f"schemas must be a dict, got {type(schemas).__name__}")
    if not isinstance(close, list):
        raise SubmissionError(f"closed steps must be a list, got {type(close).__name__}")
    close = [close_entry(entry) for entry in close]
    for sid, entry in schemas.items():
        table.learn(sid, entry)
    items: list[Submission] = []
    unknown: list[bytes] = []
    try:
        for step, seq, world_size, sid, data, states, contributions in raw_items:
            if not (isinstance(step, numbers.Integral) and step >= 0):  # the server sorts them
                raise SubmissionError(f"step must be a non-negative int, got {step!r:.40}")
            if not (type(seq) is int or (type(seq) is tuple and seq)):
                raise SubmissionError(f"seq must be an int or a node's (client_id, seq) keys: {seq!r:.40}")
            hash(seq)
            schema = table.schemas.get(sid)
            if schema is None:
                if sid not in unknown:
                    unknown.append(sid)
                continue
            m = len(schema.names)
            stats = _floats(data, 5 * m)
            if stats.size == 5 * m and m:
                stats = stats.reshape(5, m)
            if not all(type(c) is int for c in states):
                raise SubmissionError(f"state columns must be ints, got {list(states)!r:.80}")
            decoded = {c: decode_state(kind, arr) for c, (kind, arr) in states.items()}
            items.append(Submission(step, seq, world_size, Packed(schema, stats, decoded, contributions)))
    except SubmissionError:
        raise
    except Exception as exc:  # whatever a hostile item makes fail, it is a malformed one
        raise SubmissionError(f"malformed item: {type(exc).__name__}: {exc}") from None
    return items, close, unknown


def close_entry(entry: Any) -> int | OnBehalf:
    """A message's close: a step the sender closes, or an :class:`OnBehalf` of ``(step, client
    ids)`` closed on their behalf (a node sub-aggregator's forward); SubmissionError for anything else.

    >>> close_entry(3), close_entry((3, ("rank0", "rank1")))
    (3, OnBehalf(step=3, clients=('rank0', 'rank1')))
    """
    if type(entry) is int and 0 <= entry <= MAX_STEP:  # the common case
        return entry
    closers = None
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], tuple):
        entry, closers = entry
        if not all(isinstance(c, str) for c in closers):
            raise SubmissionError(f"a close on behalf of clients names them by str ids, got {closers!r:.80}")
    if not isinstance(entry, numbers.Integral) or isinstance(entry, bool) or not 0 <= entry <= MAX_STEP:
        raise SubmissionError(f"a closed step must be an int in [0, {MAX_STEP}], got {entry!r:.40}")
    return int(entry) if closers is None else OnBehalf(int(entry), closers)


def check_contribution(packed: Packed, at: np.ndarray, held: Mapping[int, State]) -> dict[int, State]:
    """The states of ``packed`` merged with the step's ``held`` ones (by step column; ``at``: each of
    ``packed``'s, -1 if left out), once every value passed its check (``held`` is unchanged). Raises
    :class:`SubmissionError` naming the metric for a value no data gives or a state that does not
    merge with the step's (docs/reliability.md, "Contributions from other processes").

    >>> from rlmetrics.packing import pack
    >>> p = pack({"x/mean": [1.0, 2.0]})
    >>> stats = p.stats.copy()
    >>> stats[0, 0] = -1e9
    >>> check_contribution(Packed(p.schema, stats), np.array([0]), {})
    Traceback (most recent call last):
    ...
    rlmetrics.messages.SubmissionError: metric 'x/mean': count -1000000000.0 < 0
    """
    names = packed.schema.names
    if not packed.checked and packed.stats.ndim == 2:  # one observation per metric (1-D): any float
        bad = invalid_column(packed.stats)
        if bad is not None:
            raise SubmissionError(f"metric {names[bad[0]]!r}: {bad[1]}")
    merged: dict[int, State] = {}
    for i, state in packed.states.items():
        try:
            kind = column_kind(names[i], packed.schema.reductions[i])
            if state.kind != kind and is_bound(state.kind):
                raise ValueError(f"a {state.kind} state on a column that carries {kind or 'none'}")
            if not packed.checked:
                state.validate()
            col = int(at[i])
            have = held.get(col) if col >= 0 else None
            if have is not None and type(have) is not type(state):
                raise ValueError(f"a {state.kind} state does not merge with the step's {have.kind}")
            if col >= 0:
                merged[col] = state if have is None else have.merge(state)
        except Exception as exc:  # a state from another process may make anything fail
            why = exc if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            raise SubmissionError(f"metric {names[i]!r}: {why}") from None
    return merged
