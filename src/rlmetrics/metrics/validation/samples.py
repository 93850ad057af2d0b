"""Validation samples as an engine state (:class:`Samples`), reduced once over all ranks' samples.

Rules: docs/reductions.md, "Validation order".
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np

from rlmetrics.core.reduce import Reduction
from rlmetrics.core.stat import Stat
from rlmetrics.metrics import VALIDATION_SAMPLES
from rlmetrics.metrics.validation import merge_samples, process_samples
from rlmetrics.metrics.validation.records import SampleRecord, check_mergeable, check_record


class Samples:
    """``(rank key, record)`` pairs; merging concatenates, reducing computes the metrics in rank-key order.

    >>> from rlmetrics.metrics.validation import encode_samples
    >>> r0 = Samples([((0, 0), encode_samples(["gsm8k"] * 2, ["p", "p"], {"acc": [1.0, 0.0]}))])
    >>> r1 = Samples([((0, 1), encode_samples(["gsm8k"], ["p"], {"acc": [1.0]}))])
    >>> both = Samples.from_array(r1.merge(r0).to_array())
    >>> round(both.reduce(VALIDATION_SAMPLES, None, Stat())["val-core/gsm8k/acc/mean@3"], 4)
    0.6667
    """

    kind: ClassVar[str] = "samples"

    def __init__(self, records: Iterable[tuple[Any, SampleRecord]] = ()) -> None:
        self.records = list(records)

    def merge(self, other: Samples) -> Samples:
        """Both sides' records; ValueError when they cannot be reduced together (:meth:`check_merge`)."""
        self.check_merge(other)
        return type(self)(self.records + other.records)

    def check_merge(self, other: Samples) -> None:
        """ValueError unless the records of both merge (``records.check_mergeable``)."""
        check_mergeable([r for _, r in self.records], (r for _, r in other.records))

    def validate(self) -> None:
        """ValueError unless each record is checked, keyed ``(int, int, int, str)``, and all merge."""
        for key, record in self.records:
            if not (
                isinstance(key, tuple)
                and len(key) == 4
                and all(isinstance(k, numbers.Integral) for k in key[:3])
                and isinstance(key[3], str)
            ):
                raise ValueError(f"validation samples: rank key {key!r:.60} is not (int, int, int, str)")
            check_record(record)
        check_mergeable((), [r for _, r in self.records])

    def to_array(self) -> np.ndarray:
        arr = np.empty(len(self.records), dtype=object)
        for i, pair in enumerate(self.records):
            arr[i] = pair
        return arr

    @classmethod
    def from_array(cls, arr: np.ndarray) -> Samples:
        """Inverse of :meth:`to_array`; ValueError unless each element is a checked ``(key, record)``."""
        if not isinstance(arr, np.ndarray) or arr.dtype != object or arr.ndim != 1:
            raise ValueError(f"{cls.kind} travel as a 1-D object array")
        pairs = arr.tolist()
        if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise ValueError(f"{cls.kind} must be (key, record) pairs")
        for _, record in pairs:
            cls.check(record)
        return cls(pairs)

    @staticmethod
    def check(record: Any) -> None:
        """ValueError unless ``record`` is a :class:`~rlmetrics.metrics.validation.SampleRecord`."""
        if not isinstance(record, SampleRecord):
            raise ValueError(f"samples must be (rank key, SampleRecord) pairs, got {type(record).__name__}")

    def reduce(self, name: str, reduction: Reduction | None, stat: Stat) -> dict[str, float]:
        """The metrics of the records merged in rank-key order (``exact=True`` keys if any rank asked)."""
        merged = merge_samples([record for _, record in sorted(self.records, key=lambda pair: pair[0])])
        return process_samples(merged, exact=merged.exact)


__all__ = ["VALIDATION_SAMPLES", "Samples"]
