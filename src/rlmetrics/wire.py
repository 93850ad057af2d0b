"""Wire format between clients and a remote aggregator: names once per schema, then numbers.

A message is a plain tuple of ints, bytes and small tuples (cheap for pickle and Ray)::

    (VERSION, items, close, schemas, resync)
    items   = [(step, seq, world_size, schema_id, (codec, stats_bytes), {column: sketch_bytes},
                contributions, validation_records), ...]
    schemas = {schema_id: (names, reductions)}   # only for schemas the receiver does not know yet

``stats_bytes`` holds float64s: ``M`` values (one observation per metric) or a ``(5, M)`` stat
array; codec 0 is the raw buffer, codec 1 the same bytes byte-shuffled (all first bytes, then all
second bytes, ...) and zlib-compressed, used when every value is exact in float32 and that saves at
least 1/16 — lossless; it shrinks the counts and small fractions that metrics often are several
times, while other doubles go raw. The receiver keeps a
:class:`SchemaTable`; an item whose schema it lacks (say, after a restart) is reported back by id,
and the sender repeats it with the names.

>>> from rlmetrics.aggregator import pack
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

import zlib
from typing import Any

import numpy as np

from rlmetrics.aggregator import Packed, Schema, SubmissionError
from rlmetrics.sketch import Sketch

VERSION = 1
Item = tuple[int, int, int, Packed]  # (step, seq, world_size, packed)


def encode(items: list[Item], close: list[int], send_names: Any, resync: bool = False) -> tuple:
    """A message for ``items`` and step closings.

    ``send_names``: True / False, or a predicate ``f(schema_id) -> bool`` saying which schemas'
    names to include.
    """
    wants = send_names if callable(send_names) else (lambda _sid: send_names)
    schemas: dict[bytes, tuple] = {}
    out = []
    for step, seq, world_size, packed in items:
        sid = packed.schema.id
        if sid not in schemas and wants(sid):
            schemas[sid] = (packed.schema.names, packed.schema.reductions)
        sketches = {col: sk.to_array().tobytes() for col, sk in packed.sketches.items()}
        data = _float_bytes(packed.stats)
        out.append((step, seq, world_size, sid, data, sketches, packed.contributions, packed.records))
    return (VERSION, out, list(close), schemas, resync)


def _float_bytes(arr: np.ndarray) -> tuple[int, bytes]:
    raw = arr.tobytes()
    # Values that float32 holds exactly (counts, small fractions) end in zero bytes and compress many
    # times; other doubles barely compress, and trying costs more than packing them. The first
    # values decide cheaply for most arrays (random doubles: the first one already fails).
    head = arr.ravel()[:8]
    if (
        arr.size >= 64
        and np.array_equal(head, head.astype(np.float32), equal_nan=True)
        and np.array_equal(arr, arr.astype(np.float32), equal_nan=True)
    ):
        packed = zlib.compress(np.frombuffer(raw, np.uint8).reshape(-1, 8).T.tobytes(), 1)
        if len(packed) <= len(raw) - len(raw) // 16:
            return (1, packed)
    return (0, raw)


def _floats(codec: int, data: bytes, max_values: int) -> np.ndarray:
    if codec == 0:
        return np.frombuffer(data, dtype=np.float64)
    if codec != 1:
        raise SubmissionError(f"unknown codec {codec!r}")
    raw = zlib.decompressobj().decompress(data, 8 * max_values + 1)  # bounded: no decompression bomb
    if len(raw) % 8 or len(raw) > 8 * max_values:
        raise SubmissionError("compressed stats of the wrong size")
    return np.frombuffer(np.frombuffer(raw, np.uint8).reshape(8, -1).T.tobytes(), dtype=np.float64)


class SchemaTable:
    """The receiver's schemas by id; it learns them from messages."""

    def __init__(self) -> None:
        self.schemas: dict[bytes, Schema] = {}

    def learn(self, sid: bytes, names: tuple, reductions: tuple) -> None:
        if sid not in self.schemas:
            schema = Schema.of(tuple(names), tuple(reductions))
            if schema.id != sid:
                raise SubmissionError("schema id does not match its names")
            self.schemas[sid] = schema


def decode(msg: tuple, table: SchemaTable) -> tuple[list[Item], list[int], list[bytes]]:
    """Items whose schema is known, the closed steps, and the ids of unknown schemas.

    Raises :class:`~rlmetrics.aggregator.SubmissionError` for a malformed message.
    """
    try:
        version, raw_items, close, schemas, _resync = msg
    except (TypeError, ValueError):
        raise SubmissionError("malformed message") from None
    if version != VERSION:
        raise SubmissionError(f"wire version {version!r}, expected {VERSION}")
    for sid, (names, reductions) in schemas.items():
        table.learn(sid, names, reductions)
    items: list[Item] = []
    unknown: list[bytes] = []
    try:
        for step, seq, world_size, sid, data, sketches, contributions, records in raw_items:
            schema = table.schemas.get(sid)
            if schema is None:
                if sid not in unknown:
                    unknown.append(sid)
                continue
            m = len(schema.names)
            stats = _floats(*data, 5 * m)
            if stats.size == 5 * m and m:
                stats = stats.reshape(5, m)
            sk = {int(c): Sketch.from_array(np.frombuffer(b, dtype=np.float64)) for c, b in sketches.items()}
            items.append((step, seq, world_size, Packed(schema, stats, sk, contributions, list(records))))
    except (TypeError, ValueError, AttributeError, zlib.error) as exc:
        if isinstance(exc, SubmissionError):
            raise
        raise SubmissionError(f"malformed item: {exc}") from None
    return items, list(close), unknown
