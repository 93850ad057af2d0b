"""What clients and the aggregator tell each other: messages, results, errors and warnings (sinks
import only this and the core; docs/steps.md, "`meta`" and "Warnings").

>>> res = StepResult({"loss": 0.5}, 3, StepMeta.of(missing_ranks=["rank2@host:1"]))
>>> res["loss"], res.step, res.meta.complete, res.meta.missing_ranks
(0.5, 3, False, ['rank2@host:1'])
>>> res.meta.to_dict()  # only what differs from a complete step
{'complete': False, 'missing_ranks': ['rank2@host:1']}
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import FrameType
from typing import Any, NamedTuple

MAX_STEP = 1 << 53
"""Largest step: exact as a float64, as trackers and JSON hold it."""

DEFAULT_AXIS = "train_step"
"""The axis of a client's own ``step`` (:mod:`rlmetrics.axes`), the one trackers plot against."""


class Submission(NamedTuple):
    """One contribution to ``step``: ``packed`` (:class:`~rlmetrics.packing.Packed`), each name
    expecting ``world_size`` contributions; ``seq``: the client's sequence number (in a node's
    forward, the ``(client_id, seq)`` keys of the submissions it merges)."""

    step: int
    seq: Any
    world_size: int
    packed: Any


class OnBehalf(NamedTuple):
    """A close of ``step`` for ``clients`` (a node sub-aggregator's, for its ranks)."""

    step: int
    clients: tuple[str, ...]


Close = int | OnBehalf
"""A step closed by its sender, or for others."""


class Message(NamedTuple):
    """One client's message to the server: its submissions, the steps it closes, whether it resends
    after a restart (``resync``), and its ``session`` (its run; None: not tracked)."""

    client: str
    items: list[Submission]
    close: list[Close]
    resync: bool = False
    session: str | None = None


@dataclass(frozen=True)
class TorchFacts:
    """``meta.torch`` of a torch.distributed step: ``ranks`` in the group, ``relayout`` (new names
    agreed), ``exchange`` (the state exchange's form), ``result_on`` (the rank with the values, None: all)."""

    ranks: int | None = None
    relayout: bool = False
    exchange: str | None = None
    result_on: int | None = None


_TORCH_KEYS = tuple(f.name for f in fields(TorchFacts))


@dataclass(frozen=True)
class StepMeta:
    """What a result says about its step besides the values (each field: docs/steps.md, "`meta`");
    built whole by :meth:`of`, frozen. The facts of ``torch`` (:class:`TorchFacts`, None off
    torch.distributed) also read as ``ranks``, ``relayout``, ``exchange``, ``result_on``."""

    complete: bool = True
    missing_ranks: list[str] = field(default_factory=list)
    missing_metrics: dict[str, list[int]] = field(default_factory=dict)
    empty: list[str] = field(default_factory=list)
    approximate: list[str] = field(default_factory=list)
    contributors: list[Any] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    conflicts: dict[str, str] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)
    contributions: list[int] | None = None
    late: int = 0
    evicted: bool = False
    stale: bool = False
    provisional: bool = False
    ranks_at: dict[str, int] = field(default_factory=dict)
    torch: TorchFacts | None = None

    @classmethod
    def of(
        cls,
        *,
        complete: bool | None = None,
        missing_ranks: Iterable[str] = (),
        missing_metrics: Mapping[str, Sequence[int]] | None = None,
        empty: Iterable[str] = (),
        approximate: Iterable[str] = (),
        contributors: Iterable[Any] = (),
        refused: Mapping[str, str] | None = None,
        conflicts: Mapping[str, str] | None = None,
        lost: Mapping[str, str] | None = None,
        contributions: Sequence[int] | None = None,
        late: int = 0,
        evicted: bool = False,
        stale: bool = False,
        provisional: bool = False,
        ranks_at: Mapping[str, int] | None = None,
        torch: TorchFacts | None = None,
    ) -> StepMeta:
        """The meta of a step, in containers of its own (none of the caller's is shared);
        ``complete`` unless given: no rank or name missing and not ``evicted``.

        >>> meta = StepMeta.of(missing_ranks=("rank1",), contributions=(3, 4), late=1)
        >>> meta.complete, meta.missing_ranks, meta.contributions
        (False, ['rank1'], [3, 4])
        >>> meta.to_dict()
        {'complete': False, 'missing_ranks': ['rank1'], 'contributions': [3, 4], 'late': 1}
        >>> meta.late = 0
        Traceback (most recent call last):
        dataclasses.FrozenInstanceError: cannot assign to field 'late'
        """
        missing_ranks = list(missing_ranks)
        missing = {name: list(counts) for name, counts in (missing_metrics or {}).items()}
        if complete is None:
            complete = not missing_ranks and not missing and not evicted
        return cls(
            complete=complete,
            missing_ranks=missing_ranks,
            missing_metrics=missing,
            empty=list(empty),
            approximate=list(approximate),
            contributors=list(contributors),
            refused=dict(refused or {}),
            conflicts=dict(conflicts or {}),
            lost=dict(lost or {}),
            contributions=None if contributions is None else list(contributions),
            late=late,
            evicted=evicted,
            stale=stale,
            provisional=provisional,
            ranks_at=dict(ranks_at or {}),
            torch=torch,
        )

    @property
    def ranks(self) -> int | None:
        """torch.distributed: the ranks in the group (:class:`TorchFacts`)."""
        return None if self.torch is None else self.torch.ranks

    @property
    def relayout(self) -> bool:
        """torch.distributed: the ranks agreed on new names in the step (:class:`TorchFacts`)."""
        return self.torch is not None and self.torch.relayout

    @property
    def exchange(self) -> str | None:
        """torch.distributed: the form of the step's state exchange (:class:`TorchFacts`)."""
        return None if self.torch is None else self.torch.exchange

    @property
    def result_on(self) -> int | None:
        """torch.distributed: the rank that has the values, None: every rank (:class:`TorchFacts`)."""
        return None if self.torch is None else self.torch.result_on

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from a complete step's defaults, JSON-ready; the facts of
        ``torch`` as keys of their own (``ranks``, ``relayout``, ...)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "torch" and v != _DEFAULT_META[f.name]:
                out[f.name] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
        for f in fields(TorchFacts) if self.torch is not None else ():
            v = getattr(self.torch, f.name)
            if v != f.default:
                out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepMeta:
        """Inverse of :meth:`to_dict` (unknown keys are ignored).

        >>> meta = StepMeta.of(contributors=[0, 1], torch=TorchFacts(ranks=2, exchange="gather"))
        >>> meta.to_dict()
        {'contributors': [0, 1], 'ranks': 2, 'exchange': 'gather'}
        >>> StepMeta.from_dict(meta.to_dict()) == meta, meta.exchange
        (True, 'gather')
        """
        known = {f.name for f in fields(cls)} - {"torch"}
        facts = {"complete": True, **{k: v for k, v in d.items() if k in known}}
        torch = {k: d[k] for k in _TORCH_KEYS if k in d}
        return cls.of(**facts, torch=TorchFacts(**torch) if torch else None)


_DEFAULT_META = {f.name: getattr(StepMeta(), f.name) for f in fields(StepMeta)}


class StepResult(dict):
    """``{name: value}`` of one step, read-only (``dict(res)`` is a copy), with ``step``, ``meta``,
    ``histograms`` (``{name: Histogram}``) and ``lists`` (``{name: [str, ...]}``, e.g. stragglers).

    >>> res = StepResult({"loss": 0.5}, 3)
    >>> res["loss"] = 1.0
    Traceback (most recent call last):
    TypeError: a StepResult is read-only (dict(res) is a copy to change)
    >>> {**res, "extra": 1.0}
    {'loss': 0.5, 'extra': 1.0}
    """

    step: int
    meta: StepMeta
    histograms: dict[str, Any]
    lists: dict[str, list[str]]

    def __init__(
        self,
        values: Mapping[str, float],
        step: int,
        meta: StepMeta | None = None,
        histograms: Mapping[str, Any] | None = None,
        lists: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(values)
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "meta", StepMeta() if meta is None else meta)
        object.__setattr__(self, "histograms", dict(histograms or {}))
        object.__setattr__(self, "lists", {k: list(v) for k, v in (lists or {}).items()})

    def __reduce__(self) -> tuple[Any, ...]:  # keep step, meta, histograms and lists across pickling (Ray)
        return (StepResult, (dict(self), self.step, self.meta, self.histograms, self.lists))

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a StepResult is read-only (dict(res) is a copy to change)")

    __setitem__ = __delitem__ = __ior__ = _read_only
    update = pop = popitem = setdefault = clear = _read_only

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a StepResult is read-only: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a StepResult is read-only: cannot delete {name!r}")


@dataclass(frozen=True)
class Reply:
    """The aggregator's answer to a client's message: ``errors`` (what was refused, by
    ``client/step/seq``), ``late`` (steps already final: their data dropped), ``unknown`` (schema ids
    a Ray actor lacks: nothing merged, resend with names), ``incarnation``, the final steps
    (:meth:`is_final`) and ``missed`` (the newest step a read ended without this client's close).

    >>> reply = Reply({}, "incarnation-1", done_below=3, finalized=[5])
    >>> reply.merged, [s for s in range(7) if reply.is_final(s)]
    (True, [0, 1, 2, 5])
    """

    errors: dict[str, str]
    incarnation: str
    done_below: int = 0
    finalized: list[int] = field(default_factory=list)
    unknown: list[bytes] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    missed: int = -1

    @property
    def merged(self) -> bool:
        """The message was merged (else it is to be sent again with names: ``unknown``)."""
        return not self.unknown

    def is_final(self, step: int) -> bool:
        """``step`` is final at the aggregator: its client may stop keeping it."""
        return step < self.done_below or step in self.finalized


def rank_name(client_id: Any) -> str:
    """How messages name a client: ``rank<N>`` for a rank's, else its id without the key hash.

    >>> rank_name("rank2@vm:19551:cae1b2c3d4e5f601"), rank_name("client@vm:19551:cae1b2c3d4e5f601")
    ('rank2', 'client@vm:19551')
    """
    text = str(client_id)
    label, at, where = text.partition("@")
    if at and label.startswith("rank") and label[4:].isdigit():
        return label
    head, colon, tail = text.rpartition(":")
    return head if at and colon and len(tail) == 16 else text


class SubmissionError(ValueError):
    """A contribution the engine refuses; the message says which and why. Nothing of it was merged."""


class RefusedNamesError(SubmissionError):
    """Some names of a contribution were refused, or conflict in ``world_size`` with other ranks';
    the rest was merged."""


class RLMetricsWarning(RuntimeWarning):
    """Base of every report rlmetrics makes to its user, once per event, in the process of the client
    it concerns; filter it, or a kind, as any warning (docs/steps.md, "Warnings").

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.filterwarnings("ignore", category=LateDataWarning)
    ...     warnings.warn("dropped", LateDataWarning)
    ...     warnings.warn("partial", PartialStepWarning)
    >>> [type(w.message).__name__ for w in caught]
    ['PartialStepWarning']
    """


class ValueWarning(RLMetricsWarning):
    """A submitted value is taken in a way that may not be what was meant."""


class PartialStepWarning(RLMetricsWarning):
    """A read returned a step short of ranks or contributions, or no longer kept (see ``meta``)."""


class ProvisionalWarning(RLMetricsWarning):
    """A reader's deadline passed and it did not finalize the step (once per client)."""


class LateDataWarning(RLMetricsWarning):
    """This client's data reached the aggregator when its step was final already: it was dropped."""


class NonFiniteWarning(RLMetricsWarning):
    """A result's value is not finite (once per metric name and client)."""


class WorldSizeWarning(RLMetricsWarning):
    """Ranks gave one name different ``world_size`` in a step (``meta.conflicts``; once per name)."""


class ApproximateWarning(RLMetricsWarning):
    """A quantile or histogram is approximate (``meta.approximate``; once per name and client)."""


class StepWarning(RLMetricsWarning):
    """A client's step counter and what it queued disagree (data queued for a step not closed)."""


class RayStartedWarning(RLMetricsWarning):
    """``connect("ray")`` / ``get_metric_worker`` started a local Ray instance (not a cluster)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside rlmetrics: a warning points at the user's call."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
