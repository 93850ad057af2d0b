"""What clients and the aggregator tell each other, built here and nowhere else: a client's
:class:`Message` of :data:`Submission` items, a step's :class:`StepResult` with its
:class:`StepMeta`, the :class:`Reply` to a client's message, the errors of a refused contribution,
the warnings a client gives its user (:class:`RLMetricsWarning`), and the name of the default step
axis (what the sinks need of the rest, so that they import only this and the core).

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
"""Largest step: exact as a float64, as trackers and JSON hold it (a step beyond is refused, naming it)."""

DEFAULT_AXIS = "train_step"
"""The axis of a client's own ``step`` (:mod:`rlmetrics.axes`), the one trackers plot against."""

Submission = tuple[int, Any, int, Any]
"""``(step, seq, world_size, packed)``: one contribution
(``packed``: :class:`~rlmetrics.packing.Packed`);
a node's forward keys it by ``(client_id, seq)`` pairs instead of ``seq``."""
Close = Any
"""A step closed by the sender, or ``(step, client ids)``: closed on behalf of those (a node)."""


class Message(NamedTuple):
    """One client's message to the server (:meth:`~rlmetrics.engine.server.Server.handle`): its
    submissions, the steps it closes, whether it resends what it kept after a restart
    (``resync``), and the client's ``session`` (its run; None: not tracked)."""

    client: str
    items: list[Submission]
    close: list[Close]
    resync: bool = False
    session: str | None = None


@dataclass(frozen=True)
class TorchFacts:
    """What a torch.distributed step says besides what every backend says (``meta.torch``):
    ``ranks`` in the group, ``relayout`` (the ranks agreed on new names), ``exchange`` (the form of
    the state exchange), ``result_on`` (the rank that has the values, None: every rank)."""

    ranks: int | None = None
    relayout: bool = False
    exchange: str | None = None
    result_on: int | None = None


_TORCH_KEYS = tuple(f.name for f in fields(TorchFacts))


@dataclass(frozen=True)
class StepMeta:
    """What a result says about its step besides the values, built whole by :meth:`of` and never
    changed after (frozen: a finalized step's meta is what every reader of it gets).

    - ``complete``: every registered rank closed the step and every name has ``world_size``
      contributions (else the step was finalized at a reader's deadline, or as ``stale``);
    - ``missing_ranks``: registered clients that did not close the step;
    - ``missing_metrics``: ``{name: [received, expected]}`` of the names short of contributions;
    - ``empty``: names without an observation (left out of the values);
    - ``approximate``: names whose quantiles (or histogram) came from the sketch's buckets, within
      0.5% relative error, not exact: more values in the step than the exact bound (1,000,000 per
      name by default, ``RLMETRICS_EXACT_QUANTILES``), or weighted values (docs/reductions.md);
    - ``contributors``: clients that submitted to the step;
    - ``refused``: ``{name: why}`` of names the aggregator refused in the step, and
      ``{"client_id/step/seq": why}`` of contributions it refused whole for a value no data gives
      (the key of the error in that client's reply; nothing of them was merged);
    - ``conflicts``: ``{name: why}`` of names whose ranks gave them different ``world_size`` in
      the step (merged; the step expects the largest ``world_size`` given);
    - ``lost``: ``{client: why}`` of the missing ranks whose process is gone (a dead Ray actor, a
      lost node): this is the step each did not close, later steps do not expect them;
    - ``contributions``: ``[received, expected]`` contributions summed over the step's names (each
      name counted up to its ``world_size``), when the step was finalized by a server;
    - ``late``: contributions that arrived for steps already final (and were dropped) since the
      previous step was finalized;
    - ``evicted``: the result is no longer kept (more than ``keep_results`` newer ones), its values
      are gone; ``stale``: finalized because more than ``max_pending`` newer steps were pending;
    - ``provisional``: the step is not final: a reader's deadline passed and the reader did not
      finalize it (``result(step, timeout)`` without ``finalize=True``); what arrived so far, and
      the step stays open for the rest;
    - ``ranks_at``: ``{rank: the newest step it closed}`` of the registered ranks, given with a read
      of a step nothing arrived for (a step base that differs between the reader and the ranks);
    - ``torch``: the facts of torch.distributed only (:class:`TorchFacts`, None elsewhere), also
      read as ``ranks``, ``relayout``, ``exchange`` and ``result_on``.
    """

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
        """The meta of a step from every fact known of it, in containers of its own (nothing the
        caller keeps changing is shared). ``complete`` unless given: no rank and no name is
        missing and the result is kept (not ``evicted``).

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
        """The fields that differ from a complete step's defaults, JSON-ready (JSONL, saved state);
        the facts of ``torch`` are keys of their own (``ranks``, ``relayout``, ...), as they were
        before they had a field of their own."""
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
    """``{name: value}`` of one step, with ``step``, ``meta`` (a :class:`StepMeta`) and
    ``histograms``: ``{name: Histogram}`` of the step's ``hist`` names (:mod:`rlmetrics.core.histogram`),
    and ``lists``: ``{name: [str, ...]}`` (the slowest ranks of ``perf/straggler/<stage>/slowest``,
    :mod:`rlmetrics.metrics.stragglers`), kept apart so that every value stays a float.

    Read-only once built: the aggregator keeps a finalized result and gives the same one to every
    reader of the step (and to its saved state), so none may change it for the others; ``dict(res)``
    is a copy to change.

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
    """The aggregator's answer to a client's message, in one of two kinds:

    - the message was merged (:attr:`merged`): ``errors`` say what of it was refused (by
      ``client/step/seq``; the rest was merged), ``late`` the steps whose data in it arrived when
      they were final already (dropped, counted in a next step's ``meta.late``; the client warns,
      :class:`LateDataWarning`);
    - nothing of it was merged: a Ray actor lacks the schema ids in ``unknown`` (it restarted, or
      forgot them), and the client sends the message again with names.

    Either way: the aggregator's ``incarnation`` (a new one: the client resends what it keeps),
    which steps are final, so the client stops keeping them (:meth:`is_final`: every step below
    ``done_below`` and those in ``finalized``), and ``missed``: the newest step a
    ``wait_final_res()`` read ended without this client's close (-1: none; its counter slipped).

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
    """How messages name a client: ``rank<N>`` for a rank's client (``rank=N`` or a ``rankN``
    label), else its id without the key hash that ends it.

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
    """Some names of a contribution were refused, or given another ``world_size`` than other ranks
    gave them in the step (the message says which and why); the rest of it was merged."""


class RLMetricsWarning(RuntimeWarning):
    """Every report rlmetrics makes to its user: one warning per event, in the process of the client
    it concerns (the aggregator logs at WARNING only what no client can be told). Silence a kind
    with ``warnings.filterwarnings("ignore", category=rlmetrics.PartialStepWarning)``, or all of
    them with ``category=rlmetrics.RLMetricsWarning``.

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
    """A submitted value is taken in a way that may not be what was meant (a number under a std
    name averaged over ranks, a Stat of non-finite values dropped, a custom metric's odd value)."""


class PartialStepWarning(RLMetricsWarning):
    """A read returned a step short of ranks or contributions (final at a deadline, or stale), or a
    step whose result is no longer kept (``meta`` says what is missing)."""


class ProvisionalWarning(RLMetricsWarning):
    """A reader's deadline passed and it did not finalize the step: what arrived so far (once per
    client: a dashboard reads provisional results all along)."""


class LateDataWarning(RLMetricsWarning):
    """This client's data reached the aggregator when its step was final already: it was dropped."""


class NonFiniteWarning(RLMetricsWarning):
    """A result's value is not finite (once per metric name and client)."""


class WorldSizeWarning(RLMetricsWarning):
    """Ranks gave one name different ``world_size`` in a step (``meta.conflicts``; once per name
    and client: the ranks that gave it are told by an error at every step)."""


class ApproximateWarning(RLMetricsWarning):
    """A quantile or histogram came from the sketch's buckets, not exact (``meta.approximate``; once
    per name and client)."""


class StepWarning(RLMetricsWarning):
    """A client's step counter and what it queued disagree (data queued for a step not closed)."""


class RayStartedWarning(RLMetricsWarning):
    """``connect("ray")`` / ``get_metric_worker`` found Ray not initialized and started a local
    instance (not a cluster)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside rlmetrics: a warning points at the user's call
    (a reply, for one, is handled at the user's next call, wherever that is)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
