"""The one state model: what travels with a contribution and merges at the aggregator.

Every state implements one small protocol, :class:`State`:

- ``merge(other)``: the state of both (associative and commutative; :class:`Samples` keep their
  rank keys and are ordered by them when reduced);
- ``to_array()`` / ``from_array(arr)``: how it travels (a numpy array: the wire and the torch backend
  move states only this way, by their ``kind``);
- ``reduce(name, reduction, stat)``: the values it reports at the end of its step, given its
  column's name, reduction and merged :class:`~rlmetrics.stat.Stat`;
- ``validate()``: ValueError unless data can give it (the aggregator validates every contribution's
  states before merging them: a state from another process may hold any value).

:class:`~rlmetrics.stat.Stat` (count, sum, M2, min, max) is every column's state and the fast path:
a contribution carries all of them as one ``(5, M)`` float64 array, merged as matrices. The other
states ride on a column of a contribution (``Packed.states``): a :class:`~rlmetrics.sketch.Sketch`
on a name whose reduction reads quantiles, :class:`Samples` on :data:`VALIDATION_SAMPLES`,
:class:`PromptStats` on :data:`PROMPT_STATS`.

>>> from rlmetrics.reduce import resolve
>>> a, b = Sketch.of([1.0, 2.0]), Sketch.of([3.0, 4.0, 5.0])
>>> travelled = decode_state(*encode_state(a))
>>> travelled.merge(b).reduce("lat/p50", resolve("lat/p50"), Stat.of([1.0, 2.0, 3.0, 4.0, 5.0]))
{'lat/p50': 3.0}
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from rlmetrics.metrics import AUX_PREFIX, validation_metrics
from rlmetrics.metrics.difficulty import CORRECT, REWARDS, difficulty_metrics
from rlmetrics.metrics.difficulty import check_record as check_prompt_record
from rlmetrics.metrics.validation.records import SampleRecord, check_mergeable, check_record
from rlmetrics.reduce import Reduction, parse_reduction
from rlmetrics.sketch import Sketch
from rlmetrics.stat import Stat, invalid_column

VALIDATION_SAMPLES = AUX_PREFIX + "validation/samples/total"
"""The column validation samples ride on (its value: how many samples a contribution holds)."""
PROMPT_STATS = AUX_PREFIX + "difficulty/prompts/total"
"""The column prompt records ride on (its value: how many prompts a contribution holds)."""


@runtime_checkable
class State(Protocol):
    """What travels with a column of a contribution and merges (see the module docstring)."""

    kind: ClassVar[str]

    def merge(self, other: Any) -> Any: ...

    def to_array(self) -> np.ndarray: ...

    @classmethod
    def from_array(cls, arr: np.ndarray) -> Any: ...

    def reduce(self, name: str, reduction: Reduction, stat: Stat) -> dict[str, float]: ...

    def validate(self) -> None: ...


class Samples:
    """Validation samples of one or more ranks: ``(rank key, sample record)`` pairs
    (:func:`~rlmetrics.metrics.validation.encode_samples` makes a record). Merging concatenates;
    reducing orders them by rank key and computes the validation metrics once over all of them, so
    a prompt whose samples sit on several ranks gets the single-process values.

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
        """ValueError unless the records of both merge (one style and seed, the same variables:
        :func:`~rlmetrics.metrics.validation.records.check_mergeable`)."""
        check_mergeable([r for _, r in self.records], (r for _, r in other.records))

    def validate(self) -> None:
        """ValueError unless each record is one a client makes (every index in range:
        :func:`~rlmetrics.metrics.validation.records.check_record`), under a rank key
        ``(int, int, int, str)``, and they merge together."""
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
        """Inverse of :meth:`to_array`; ValueError unless every element is a ``(key, record)`` pair
        whose record passes :meth:`check`."""
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
        return validation_metrics(self.records)


class PromptStats(Samples):
    """Per-prompt summaries of one or more ranks' data metrics: ``(client id, prompt record)`` pairs
    (:func:`~rlmetrics.metrics.difficulty.prompt_record`), travelling and merging as
    :class:`Samples`; reducing merges each prompt's records of all ranks and gives the difficulty
    groups (:func:`~rlmetrics.metrics.difficulty.difficulty_metrics`)."""

    kind: ClassVar[str] = "prompts"

    @staticmethod
    def check(record: Any) -> None:
        """ValueError unless ``record`` is a prompt record."""
        check_prompt_record(record)

    def check_merge(self, other: Samples) -> None:
        """Prompt records of any ranks merge (a group a rank lacks has no observation)."""

    def validate(self) -> None:
        """ValueError unless each record is a prompt record with the rewards and the correct lengths
        among its groups, and summaries data can give (:func:`~rlmetrics.stat.invalid_column`)."""
        for _, record in self.records:
            check_prompt_record(record)
            names = {name for group in record["groups"] for name in group}
            if REWARDS not in names or CORRECT not in names:
                raise ValueError(f"prompt record: groups without {REWARDS!r} and {CORRECT!r}")
            stats = record["stats"]
            bad = invalid_column(stats.reshape(5, -1))
            if bad is not None:
                uid, group = divmod(bad[0], stats.shape[2])
                raise ValueError(
                    f"prompt record: prompt {record['uids'][uid]!r:.60}, {record['groups'][group]}: {bad[1]}"
                )

    def reduce(self, name: str, reduction: Reduction | None, stat: Stat) -> dict[str, float]:
        return difficulty_metrics([record for _, record in self.records])


KINDS: dict[str, Any] = {Sketch.kind: Sketch, Samples.kind: Samples, PromptStats.kind: PromptStats}
"""Every state kind by its wire name."""
BUILT_IN = frozenset(KINDS)
"""The kinds of the library, each on the columns of :func:`column_kind`."""


def column_kind(name: str, reduction: str) -> str | None:
    """The built-in state kind a column carries, where clients put it: validation samples on
    :data:`VALIDATION_SAMPLES`, prompt records on :data:`PROMPT_STATS`, a sketch on a name whose
    reduction reads quantiles; None: none of them.

    >>> column_kind("lat/p95", "p95"), column_kind("lat/mean", "mean")
    ('sketch', None)
    """
    if name == VALIDATION_SAMPLES:
        return Samples.kind
    if name == PROMPT_STATS:
        return PromptStats.kind
    return Sketch.kind if parse_reduction(reduction).needs_sketch else None


def encode_state(state: State) -> tuple[str, np.ndarray]:
    """``(kind, array)``: a state as it travels."""
    return state.kind, state.to_array()


def decode_state(kind: Any, arr: Any) -> State:
    """The state of :func:`encode_state`'s output; ValueError for an unknown kind or a bad array."""
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown state kind {kind!r:.40}")
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"a {kind} state travels as a numpy array, got {type(arr).__name__}")
    return cls.from_array(arr)
