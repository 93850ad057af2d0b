"""Wire format between clients and a remote aggregator: names once per schema, then numbers.

A message is a plain tuple of ints, bytes and small tuples (cheap for pickle and Ray)::

    (VERSION, items, close, schemas, resync)
    items   = [(step, seq, world_size, schema_id, stats, {column: (kind, array)}, contributions), ...]
    schemas = {schema_id: (names, reductions)}   # only for schemas the receiver does not know yet

The ``{column: (kind, array)}`` are the contribution's other states (:mod:`rlmetrics.states`:
quantile sketches, validation samples), each as :func:`~rlmetrics.states.encode_state` gives it.
``seq`` is a client's sequence number, or, in an item that pre-merges several clients' submissions
(Ray's per-process sender), the tuple of their ``(client_id, seq)`` keys.

``stats`` holds float64s, ``M`` values (one observation per metric) or a ``(5, M)`` stat array, as
``(0, raw_bytes)`` or, losslessly packed by byte plane, ``(1, k, zlib_bytes, rest_bytes)``: the top
``k`` bytes of every value plane by plane (all top bytes, then all second bytes, ...) compressed,
then the other ``8 - k`` bytes of each value raw. ``k`` is 8 when most values are exact in float32
(what ``tensor.item()`` gives: their low bytes are zero), else 2 (sign and exponent, which metrics
share: random doubles still shrink by ~1/7); packing is used when it saves at least 1/16.

The receiver keeps a :class:`SchemaTable`; an item whose schema it lacks (say, after a restart) is
reported back by id, and the sender repeats it with the names.

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

import zlib
from typing import Any

import numpy as np

from rlmetrics.messages import SubmissionError
from rlmetrics.packing import Packed, Schema
from rlmetrics.states import decode_state, encode_state

VERSION = 3
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
        states = {col: encode_state(state) for col, state in packed.states.items()}
        out.append((step, seq, world_size, sid, _float_bytes(packed.stats), states, packed.contributions))
    return (VERSION, out, list(close), schemas, resync)


def _float_bytes(arr: np.ndarray) -> tuple:
    raw = arr.astype("<f8", copy=False).tobytes()
    n = len(raw) // 8
    if n < 64:
        return (0, raw)
    low_bits = np.frombuffer(raw, "<u8") & 0x1FFFFFFF  # the mantissa bits float32 lacks
    k = 8 if np.count_nonzero(low_bits == 0) * 2 >= n else 2  # most values float32-exact
    planes = np.frombuffer(raw, np.uint8).reshape(n, 8)
    packed = zlib.compress(planes[:, 8 - k :].T.tobytes(), 1)
    rest = planes[:, : 8 - k].tobytes()
    if len(packed) + len(rest) <= len(raw) - len(raw) // 16:
        return (1, k, packed, rest)
    return (0, raw)


def _floats(data: tuple, max_values: int) -> np.ndarray:
    codec = data[0]
    if codec == 0 and len(data) == 2:
        return np.frombuffer(data[1], dtype="<f8")
    if codec != 1 or len(data) != 4 or data[1] not in (2, 8):
        raise SubmissionError(f"unknown codec {data[:2]!r:.40}")
    _, k, packed, rest = data
    top = zlib.decompressobj().decompress(packed, k * max_values + 1)  # bounded: no decompression bomb
    n = len(top) // k
    if len(top) % k or n > max_values or len(rest) != (8 - k) * n:
        raise SubmissionError("compressed stats of the wrong size")
    planes = np.empty((n, 8), np.uint8)
    planes[:, 8 - k :] = np.frombuffer(top, np.uint8).reshape(k, n).T
    planes[:, : 8 - k] = np.frombuffer(rest, np.uint8).reshape(n, 8 - k)
    return planes.view("<f8").ravel()


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
        for step, seq, world_size, sid, data, states, contributions in raw_items:
            schema = table.schemas.get(sid)
            if schema is None:
                if sid not in unknown:
                    unknown.append(sid)
                continue
            m = len(schema.names)
            stats = _floats(data, 5 * m)
            if stats.size == 5 * m and m:
                stats = stats.reshape(5, m)
            decoded = {int(c): decode_state(kind, arr) for c, (kind, arr) in states.items()}
            items.append((step, seq, world_size, Packed(schema, stats, decoded, contributions)))
    except (TypeError, ValueError, AttributeError, zlib.error) as exc:
        if isinstance(exc, SubmissionError):
            raise
        raise SubmissionError(f"malformed item: {exc}") from None
    return items, list(close), unknown
