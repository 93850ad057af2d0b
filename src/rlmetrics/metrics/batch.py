"""What the compute functions read: a mapping, a TensorDict, or an object shaped like verl's ``DataProto``.

:func:`as_batch` turns an accepted input into a :class:`BatchView`, one lookup over its parts.
Rules: docs/reductions.md, "Inputs".

>>> class Proto:  # the shape of verl's DataProto
...     def __init__(self, batch, non_tensor_batch, meta_info):
...         self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info
>>> view = as_batch(Proto({"responses": [[1, 2]]}, {"__num_turns__": [3]}, {"global_token_num": [5]}))
>>> view.get("__num_turns__"), view.get("global_token_num"), "responses" in view, view.get("values")
([3], [5], True, None)
>>> as_batch([1, 2], "compute_data_metric")
Traceback (most recent call last):
...
TypeError: compute_data_metric needs a mapping, a TensorDict, or an object with .batch (+ .non_tensor_batch, \
.meta_info) as verl's DataProto; got list
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from rlmetrics.core.stat import MetricValueError

ACCEPTED = (
    "a mapping, a TensorDict, or an object with .batch (+ .non_tensor_batch, .meta_info) as verl's DataProto"
)


class BatchView(Mapping):
    """Read-only lookup over a batch's parts in order; ``meta``: its meta info; ``origin``: what was read."""

    __slots__ = ("parts", "meta", "origin")

    def __init__(
        self, parts: tuple[Any, ...], meta: Mapping[str, Any] | None = None, origin: Any = None
    ) -> None:
        self.parts = parts
        self.meta = meta if meta is not None else {}
        self.origin = origin

    def get(self, key: str, default: Any = None) -> Any:
        for part in self.parts:
            try:
                if key in part:
                    return part[key]
            except (TypeError, KeyError):
                continue
        return default

    def __getitem__(self, key: str) -> Any:
        missing = object()
        value = self.get(key, missing)
        if value is missing:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return any(_has(part, key) for part in self.parts)

    def __iter__(self) -> Iterator[str]:
        seen: set = set()
        for part in self.parts:
            for key in part.keys():
                if key not in seen:
                    seen.add(key)
                    yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _has(part: Any, key: object) -> bool:
    try:
        return key in part
    except TypeError:
        return False


def as_batch(data: Any, what: str = "this function") -> BatchView:
    """``data`` as a :class:`BatchView`; ``what`` names the caller in errors. Raises ``TypeError``."""
    if isinstance(data, BatchView):
        return data
    if isinstance(data, Mapping):
        return BatchView((data,))
    if hasattr(data, "batch") and not isinstance(data, (str, bytes, type)):
        parts = []
        for attr in ("batch", "non_tensor_batch", "meta_info"):
            part = getattr(data, attr, None)
            if part is None:
                continue
            if not isinstance(part, Mapping):
                raise TypeError(
                    f"{what}: .{attr} must be a mapping or a TensorDict, got {type(part).__name__}"
                )
            parts.append(part)
        meta = getattr(data, "meta_info", None)
        return BatchView(tuple(parts), meta if isinstance(meta, Mapping) else None, data)
    raise TypeError(f"{what} needs {ACCEPTED}; got {type(data).__name__}")


def key_error(key: str, problem: str) -> MetricValueError:
    """The error for a recognised batch key that cannot be used as it is.

    >>> key_error("advantages", "shape (2, 4), the response mask's is (2, 3)")
    MetricValueError("batch key 'advantages': shape (2, 4), the response mask's is (2, 3)")
    """
    return MetricValueError(f"batch key {key!r}: {problem}")


__all__ = ["ACCEPTED", "BatchView", "as_batch", "key_error"]
