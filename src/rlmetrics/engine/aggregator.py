"""The step-keyed merge engine: pure Python + numpy, no Ray, no torch; not thread-safe and never waits.

Over 400 lines on purpose: contributions, completion, finalization, eviction and the saved state are
one step-keyed state that every rule reads. A contribution is merged once per ``(client_id, step,
seq)``; when a step is complete: docs/steps.md, "Reading a step".

>>> from rlmetrics.packing import pack
>>> agg = Aggregator()
>>> for rank, values in enumerate([[1.0, 2.0], [3.0, 4.0, 5.0]]):
...     metrics = {"critic/score/mean": values, "critic/score/max": values}
...     _ = agg.submit(f"rank{rank}", 0, 0, 2, pack(metrics))
...     agg.close(f"rank{rank}", 0)
>>> agg.is_complete(0)
True
>>> dict(agg.finalize(0))
{'critic/score/mean': 3.0, 'critic/score/max': 5.0}
"""

from __future__ import annotations

import base64
import itertools
import logging
import math
import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlmetrics.core.histogram import Histogram
from rlmetrics.core.reduce import DEFAULT_RENAMES
from rlmetrics.core.sketch import Sketch
from rlmetrics.core.states import State
from rlmetrics.engine.columns import ColumnIndex
from rlmetrics.engine.derived import DERIVED, Derived
from rlmetrics.engine.steps import Group, Layout, Step, layout_of, reduce_step
from rlmetrics.messages import MAX_STEP, RefusedNamesError, StepMeta, StepResult, SubmissionError, rank_name
from rlmetrics.packing import MAX_WORLD_SIZE, Packed
from rlmetrics.wire import check_contribution

logger = logging.getLogger(__name__)


def _giver(keys: tuple[tuple[str, int], ...]) -> str:
    """Who sent a contribution, for a message: its rank, or the first of the ranks it merges."""
    first = rank_name(keys[0][0])
    return first if len(keys) == 1 else f"{first} (and {len(keys) - 1} other rank(s))"


@dataclass
class Lost:
    """A client whose process is gone; ``first``: the step it did not close (None: after ``after``)."""

    why: str
    after: int
    first: int | None
    names: dict[str, int]
    cols: Any = None  # (columns, world sizes) of ``names``, until the engine forgets names


class Aggregator:
    """Step-keyed merge engine. ``renames``: result-name prefix renames (default ``timing_s/`` →
    ``perf/delta_time/``); ``derived``: default :data:`~rlmetrics.engine.derived.DERIVED`; the rest:
    docs/steps.md, "Reading a step"."""

    def __init__(
        self,
        *,
        renames: Mapping[str, str] | None = None,
        derived: Sequence[Derived] | None = None,
        keep_results: int = 64,
        forget_after: int = 128,
        max_pending: int = 128,
    ) -> None:
        self.renames = dict(DEFAULT_RENAMES if renames is None else renames)
        self.derived = tuple(DERIVED if derived is None else derived)
        self.keep_results = keep_results
        self.forget_after = forget_after
        self.max_pending = max_pending
        self.clients: set[str] = set()
        self.late = 0  # contributions that arrived after their step was finalized (dropped)
        self.newest_closed: int | None = None  # the newest step any client closed
        self.closed_up_to: dict[str, int] = {}  # the newest step each client closed
        self._newest_final = -1  # the newest finalized step
        self.columns = ColumnIndex(self.renames)
        self._steps: dict[int, Step] = {}
        self._results: OrderedDict[int, StepResult] = OrderedDict()
        self._finalized: set[int] = set()  # finalized steps >= _done_below
        self._done_below = 0  # every step below it is finalized
        self._lowest: int | None = None  # the lowest step a client used (this incarnation)
        self._unused: tuple[int, int] | None = None  # steps counted finalized though no client used them
        self._reused: set[int] = set()  # of those, the ones a client used since (_use)
        self._reopened: set[int] = set()  # of those, the ones not finalized yet
        self._nan_warned: set[str] = set()
        self._layouts: dict[tuple[bytes, ...], Layout] = {}
        self._sent: dict[str, dict[bytes, int]] = {}  # client -> the world_size it gave each schema
        self.lost: dict[str, Lost] = {}  # clients whose process is gone

    # -------------------------------------------------------------------------------- intake
    def _forget(self, step: int) -> None:
        """Drop the schemas and names unused since ``step - forget_after`` (:meth:`ColumnIndex.forget`)."""
        busy = {sid for st in self._steps.values() for sid, _ in st.groups}
        if self.columns.forget(step - self.forget_after, busy):
            self._layouts.clear()
            for lost in self.lost.values():
                lost.cols = None
            self._nan_warned.difference_update(self.columns.forgotten_names)
            self.columns.forgotten_names.clear()

    def drain_forgotten(self) -> list[bytes]:
        """Schema ids dropped since the last call (a receiver drops their names from its table)."""
        return self.columns.drain_forgotten()

    def memory(self) -> dict[str, int]:
        """What the engine holds now, by kind (for monitoring and the soak tests)."""
        return {
            **self.columns.counts(),
            "layouts": len(self._layouts),
            "pending": len(self._steps),
            "results": len(self._results),
            "finalized": len(self._finalized),
        }

    def submit(
        self,
        client_id: str,
        step: int,
        seq: int,
        world_size: int,
        packed: Packed,
        *,
        register: bool = True,
        count_late: bool = True,
    ) -> bool:
        """Merge one contribution (:class:`SubmissionError`: malformed); False when merged before or late.
        ``register=False``: its closes are not awaited; ``count_late=False``: a resend, never late."""
        return self.submit_merged(
            ((client_id, seq),), step, world_size, packed, register=register, count_late=count_late
        )

    def submit_merged(
        self,
        keys: tuple[tuple[str, int], ...],
        step: int,
        world_size: int,
        packed: Packed,
        *,
        register: bool = True,
        count_late: bool = True,
    ) -> bool:
        """:meth:`submit` of a contribution merging the submissions ``keys`` (``(client_id, seq)``
        pairs), as a node forwards: all new, or all merged before (False); a mix is refused.

        >>> from rlmetrics.packing import pack
        >>> engine = Aggregator()
        >>> from rlmetrics.core.stat import stats_of_rows
        >>> rows = stats_of_rows(np.array([[1.0], [3.0]]))  # two clients' values, merged by a node
        >>> both = Packed(pack({"r/mean": 1.0}).schema, rows, contributions=2)
        >>> engine.submit_merged((("a", 0), ("b", 0)), 0, 2, both), engine.submit("a", 0, 0, 2, both)
        (True, False)
        >>> engine.finalize(0)["r/mean"]
        2.0
        """
        if not (type(step) is int or isinstance(step, numbers.Integral)) or not 0 <= step <= MAX_STEP:
            raise SubmissionError(f"step must be an int in [0, {MAX_STEP}], got {step!r:.40}")
        if (
            not (type(world_size) is int or isinstance(world_size, numbers.Integral))
            or not 1 <= world_size <= MAX_WORLD_SIZE
        ):
            raise SubmissionError(
                f"world_size must be an int in [1, {MAX_WORLD_SIZE}], got {world_size!r:.80}"
            )
        step = int(step)
        stats = packed.stats
        m = len(packed.schema.names)
        if (
            not isinstance(stats, np.ndarray)
            or stats.dtype != np.float64
            or stats.shape not in ((5, m), (m,))
        ):
            raise SubmissionError(
                f"stats must be float64 of shape (5, {m}) or ({m},) for {m} metrics, "
                f"got {getattr(stats, 'shape', type(stats).__name__)}"
            )
        for col, state in packed.states.items():
            if not 0 <= col < m:
                raise SubmissionError(f"state for column {col} of {m} metrics")
            if not isinstance(state, State):
                raise SubmissionError(f"column {col}: {type(state).__name__} is not a state")
        if type(packed.contributions) is not int or not 1 <= packed.contributions <= MAX_WORLD_SIZE:
            raise SubmissionError(f"contributions must be a positive int, got {packed.contributions!r}")
        self._use(step)
        if self.is_finalized(step):
            if count_late:
                self.late += 1
                logger.info("step %d is finalized; dropped a late contribution of %s", step, keys[0][0])
            else:
                logger.info("step %d is finalized; dropped a resent contribution of %s", step, keys[0][0])
            return False
        known = self.columns.of(packed.schema, step)
        st = self._step(step)
        seen = [key in st.seen for key in keys]
        if all(seen):
            return False
        if any(seen):
            raise SubmissionError(f"merged contribution of {len(keys)} submissions was partly merged before")
        try:
            states = check_contribution(packed, known.at, st.states)
        except SubmissionError as exc:
            why = (
                f"{exc} (refused whole: this contribution's {m} metric(s) were not merged, the rest of "
                "the message was)"
            )
            st.refused.update((f"{client_id}/{step}/{seq}", why) for client_id, seq in keys)
            raise SubmissionError(why) from None
        st.seen.update(keys)
        clients = {client_id for client_id, _ in keys}
        if register:
            self.clients.update(clients.difference(self.lost) if self.lost else clients)
        st.contributors.update(clients)
        conflicting = None
        if len(known.cols):
            world_size = int(world_size)
            group = st.groups.get((packed.schema.id, world_size))
            if group is None:
                group = st.groups[packed.schema.id, world_size] = Group(known.cols, world_size)
                group.conflicting = st.expect(known.cols, world_size, _giver(keys), len(self.columns))
            group.add(stats if known.keep is None else stats[..., known.keep], packed.contributions)
            group.keys.extend(keys)
            for client_id in clients if register else ():
                sent = self._sent.setdefault(client_id, {})
                if len(sent) > 512:  # names that change over a run
                    sent.clear()
                sent[packed.schema.id] = world_size
            conflicting = group.conflicting
        st.states.update(states)
        problems = []
        if known.refused:
            st.refused.update(known.refused)
            problems.append(
                "; ".join(known.refused.values())
                + f" (refused; the submission's other {len(known.cols)} metric(s) were merged)"
            )
        if conflicting is not None:
            problems.append(self._conflict(st, conflicting, world_size, _giver(keys)))
        if problems:
            raise RefusedNamesError("; ".join(problems))
        return True

    def _conflict(self, st: Step, cols: np.ndarray, world_size: int, giver: str) -> str:
        """Record that ``giver`` gave ``cols`` another ``world_size`` than their first; the message."""
        by_first: dict[tuple[int, int], list[str]] = {}
        for col, first, who in zip(cols.tolist(), st.world_sizes[cols].tolist(), st.given_by[cols].tolist()):
            by_first.setdefault((first, who), []).append(col)
        texts = []
        for (first, who), group in by_first.items():
            names = [self.columns.names[c] for c in group]
            shown = ", ".join(repr(n) for n in names[:5]) + (
                f" and {len(names) - 5} more" if len(names) > 5 else ""
            )
            text = (
                f"metric(s) {shown}: world_size {world_size} from {giver}, but {first} from {st.givers[who]}"
            )
            for c in group:
                st.conflicts.setdefault(c, text)
            texts.append(text)
        logger.info("%s", "; ".join(texts))  # the rank is told (its reply), the reader warns
        return (
            "; ".join(texts) + " (merged; the step expects the largest, else ends partial at its deadline;"
            " give a name one world_size on all ranks: the contributions expected, e.g. the data-parallel"
            " size)"
        )

    def close(self, client_id: str, step: int) -> None:
        """``client_id`` will send nothing more for ``step`` (a client's ``wait_submit``)."""
        self.note_closed(step, client_id)
        self._use(step)
        if self.is_finalized(step):
            return
        self._step(step).closed.add(client_id)

    def discard(self, clients: set[str]) -> list[int]:
        """Forget ``clients`` (an ended run's): their steps start afresh unless shared; the steps changed."""
        self.clients.difference_update(clients)
        for client in clients:
            self.closed_up_to.pop(client, None)
            self._sent.pop(client, None)
            self.lost.pop(client, None)
        changed = []
        for step, st in list(self._steps.items()):
            if not (st.contributors & clients or st.closed & clients):
                continue
            changed.append(step)
            if st.contributors <= clients:  # nothing of another client: afresh, or gone if none closed it
                if st.closed - clients:
                    self._steps[step] = Step(closed=st.closed - clients)
                else:
                    del self._steps[step]
                continue
            st.closed.difference_update(clients)
            mixed = sorted(st.contributors & clients)
            if mixed:
                st.refused["ended run"] = (
                    f"holds data of {len(mixed)} client(s) of a run that ended ({mixed[0]}, ...), merged "
                    "before the run was known to be over"
                )
                logger.warning("step %d holds data of ended clients %s: it is kept whole", step, mixed[:5])
        return changed

    def note_closed(self, step: int, client_id: str | None = None) -> None:
        """``client_id`` (or some client) closed ``step`` (here or below a node sub-aggregator)."""
        if self.newest_closed is None or step > self.newest_closed:
            self.newest_closed = step
        if client_id is not None and step > self.closed_up_to.get(client_id, -1):
            self.closed_up_to[client_id] = step

    def ranks_closed_up_to(self) -> dict[str, int]:
        """The newest step each registered client closed (those that closed one)."""
        up_to = self.closed_up_to
        return {c: up_to[c] for c in sorted(self.clients) if c in up_to}

    def passed(self, step: int) -> bool:
        """No client used ``step`` and every registered client closed a later one."""
        up_to = self.closed_up_to
        ahead = all(up_to.get(c, -1) > step for c in self.clients)
        return bool(self.clients) and ahead and not self.knows(step)

    def knows(self, step: int) -> bool:
        """Some client submitted to or closed ``step`` (it is pending or finalized)."""
        return step in self._steps or self.is_finalized(step)

    def _step(self, step: int) -> Step:
        """The pending state of ``step``, new if needed (beyond ``max_pending`` the oldest is finalized)."""
        st = self._steps.get(step)
        if st is None:
            st = self._steps[step] = Step()
            if self._lowest is None or step < self._lowest:
                self._lowest = step
            for lost in self.lost.values():  # the first step after a lost client's last one names it
                if lost.first is None and step > lost.after:
                    lost.first = step
            while len(self._steps) > self.max_pending:
                oldest = min(s for s in self._steps if s != step)
                logger.info("step %d finalized partial: %d newer steps pending", oldest, self.max_pending)
                self.finalize(oldest, stale=True)
        return st

    def register(self, client_id: str) -> None:
        """Wait for ``client_id`` to close every step from now on, before its first submission."""
        self.clients.add(client_id)

    def depart(self, client_id: str) -> None:
        """Stop waiting for ``client_id`` in steps that are not closed by it (a client's ``stop``)."""
        self.clients.discard(client_id)
        self._sent.pop(client_id, None)

    def lose(self, client_id: str, why: str) -> None:
        """``client_id``'s process is gone (``why``): the step it did not close ends partial naming it, and
        later steps expect one contribution fewer of each name it sent (docs/steps.md, "Failures")."""
        if client_id in self.lost:
            return
        self.clients.discard(client_id)
        closed = [s for s, st in self._steps.items() if client_id in st.closed]
        missed = [s for s, st in self._steps.items() if client_id not in st.closed and (st.closed or st.seen)]
        names: dict[str, int] = {}
        for sid, world_size in self._sent.pop(client_id, {}).items():
            try:
                schema = self.columns.accepted(sid)
            except KeyError:  # forgotten: no step has used it for forget_after steps
                continue
            for name in schema.names:
                names[name] = max(world_size, names.get(name, 0))
        after = max(closed, default=self._newest_final)
        self.lost[client_id] = Lost(why, after, min(missed, default=None), names)

    # ------------------------------------------------------------------------------- status
    def pending_steps(self) -> list[int]:
        return sorted(self._steps)

    def is_finalized(self, step: int) -> bool:
        return (step < self._done_below and step not in self._reopened) or step in self._finalized

    def is_closed(self, step: int) -> bool:
        """Every registered client closed ``step``, which something reached."""
        st = self._steps.get(step)
        return st is not None and self.clients <= st.closed and bool(st.closed or st.groups or st.states)

    def has_closed_data(self, step: int) -> bool:
        """``step`` is pending, holds data and some client closed it."""
        st = self._steps.get(step)
        return st is not None and bool(st.closed) and bool(st.groups or st.states)

    def is_complete(self, step: int) -> bool:
        """All names have their expected contributions and every registered client closed the step."""
        if not self.is_closed(step):
            return False
        received, expected, named = self._counts(step, self._steps[step])
        return not named and not np.any(received < expected)

    def is_settled(self, step: int) -> bool:
        """Complete, or would be but for the lost clients it names (:meth:`lose`): it can end now."""
        if not self.is_closed(step):
            return False
        received, expected, _ = self._counts(step, self._steps[step], settle=True)
        return not np.any(received < expected)

    def _counts(self, step: int, st: Step, settle: bool = False) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """``st.counts`` less what lost clients will not send, and the lost clients ``step`` names."""
        received, expected = st.counts(len(self.columns))
        if not self.lost:
            return received, expected, []
        named, gone = [], []
        for client_id, lost in self.lost.items():
            first = step if lost.first is None and step > lost.after else lost.first
            if first == step and client_id not in st.closed:
                named.append(client_id)
                if settle:
                    gone.append(lost)
            elif first is not None and step > first and client_id not in st.contributors:
                gone.append(lost)
        for lost in gone:
            if lost.cols is None:
                at = [(self.columns.column(n), ws) for n, ws in lost.names.items()]
                lost.cols = tuple(np.array([x[i] for x in at if x[0] is not None], np.int64) for i in (0, 1))
            cols, sizes = lost.cols
            keep = cols < len(expected)
            cols, sizes = cols[keep], sizes[keep]
            expected[cols] -= expected[cols] == sizes  # its ranks still count the lost one
        return received, expected, sorted(named)

    def missing(self, step: int) -> tuple[list[str], dict[str, list[int]]]:
        """Registered clients that have not closed ``step``, and ``{name: [received, expected]}``."""
        st = self._steps.get(step)
        if st is None:
            return sorted(self.clients), {}
        received, expected, named = self._counts(step, st)
        short = np.nonzero(received < expected)[0]
        return (
            sorted((self.clients - st.closed).union(named)),
            {self.columns.names[c]: [int(received[c]), int(expected[c])] for c in short},
        )

    def contributions(self, step: int) -> tuple[int, int]:
        """Contributions received (up to expected) and expected in pending ``step``, over its names."""
        st = self._steps.get(step)
        if st is None:
            return 0, 0
        received, expected, _ = self._counts(step, st)
        return int(np.minimum(received, expected).sum()), int(expected.sum())

    # -------------------------------------------------------------------------------- output
    def finalize(self, step: int, **facts: Any) -> StepResult:
        """The step's result, freeing its state (``facts``: :meth:`StepMeta.of` keywords); a step
        finalized before gives its kept result, or an empty one with ``meta.evicted``."""
        if self.is_finalized(step):
            kept = self._results.get(step)
            if kept is not None:
                return kept
            return StepResult({}, step, StepMeta.of(evicted=True))
        result = self._result_of(step, **facts)
        seen = self._steps.pop(step, None) is not None
        meta = result.meta
        if not meta.complete:
            # A rank missing at a deadline is not waited for again until it submits again; a step
            # nothing reached (a read ahead of every rank) says nothing of the ranks.
            if seen:
                self.clients.difference_update(meta.missing_ranks)
            logger.info(
                "step %d is partial: missing ranks %s, %d incomplete metric(s) %s",
                step,
                meta.missing_ranks,
                len(meta.missing_metrics),
                list(meta.missing_metrics)[:5],
            )
        self._mark_finalized(step)
        self._results[step] = result
        while len(self._results) > self.keep_results:
            self._results.popitem(last=False)
        if step > self._newest_final:
            self._newest_final = step
            self._forget(step)
        return result

    def peek(self, step: int, **facts: Any) -> StepResult:
        """``step`` as it stands, left pending (``meta.provisional``); a final step as :meth:`finalize`.

        >>> from rlmetrics.packing import pack
        >>> engine = Aggregator()
        >>> engine.register("b")
        >>> _ = engine.submit("a", 0, 0, 2, pack({"x/mean": 1.0}))
        >>> res = engine.peek(0)
        >>> res["x/mean"], res.meta.provisional, res.meta.missing_metrics, engine.pending_steps()
        (1.0, True, {'x/mean': [1, 2]}, [0])
        """
        if self.is_finalized(step):
            return self.finalize(step)
        return self._result_of(step, provisional=True, **facts)

    def _result_of(self, step: int, **facts: Any) -> StepResult:
        """The result of pending (or unknown) ``step`` as it stands, with the caller's ``facts``."""
        missing_ranks, missing_metrics = self.missing(step)
        st = self._steps.get(step)
        values, empty, side = self._values(st) if st is not None and st.groups else ({}, [], {})
        conflicts = {self.columns.names[c]: why for c, why in st.conflicts.items()} if st is not None else {}
        lost = {c: self.lost[c].why for c in missing_ranks if c in self.lost}
        known = {
            "complete": st is not None and not missing_ranks and not missing_metrics,
            "missing_ranks": missing_ranks,
            "missing_metrics": missing_metrics,
            "empty": empty,
            "approximate": self._approximate(st),
            "contributors": sorted(st.contributors) if st is not None else [],
            "refused": st.refused if st is not None else {},
            "conflicts": conflicts,
            "lost": lost,
        }
        meta = StepMeta.of(**{**known, **facts})  # a fact of the caller wins (torch: its contributors)
        histograms = {k: v for k, v in side.items() if isinstance(v, Histogram)}
        lists = {k: v for k, v in side.items() if not isinstance(v, Histogram)}
        return StepResult(values, step, meta, histograms, lists)

    def _approximate(self, st: Step | None) -> list[str]:
        """The names of ``st`` whose sketch holds buckets, not the values (``meta.approximate``)."""
        if st is None or not st.states:
            return []
        names = self.columns.out_names
        return sorted(
            names[col]
            for col, state in st.states.items()
            if isinstance(state, Sketch) and not state.is_exact and state.count > 0
        )

    def closed_by_contributors(self, step: int) -> bool:
        """Some client closed ``step`` and every client that contributed to it did."""
        st = self._steps.get(step)
        return st is not None and bool(st.closed) and st.contributors <= st.closed

    def contributors(self, step: int) -> set[str]:
        """The clients that submitted to pending ``step``."""
        st = self._steps.get(step)
        return set(st.contributors) if st is not None else set()

    def closers(self, step: int) -> set[str]:
        """The clients that closed pending ``step``."""
        st = self._steps.get(step)
        return set(st.closed) if st is not None else set()

    def take(self, step: int) -> list[tuple[Packed, int, tuple[tuple[str, int], ...]]]:
        """The step's merged contributions, ``(packed, world_size, keys)`` per schema; it starts afresh."""
        st = self._steps.pop(step, None)
        self._forget(step)
        if st is None:
            return []
        out = []
        for (sid, _), group in st.groups.items():  # arrival order: the first world_size stays first upstream
            states = {}
            for i, col in enumerate(group.cols.tolist() if st.states else ()):
                if col in st.states:  # a name in several schemas: its merged state goes once
                    states[i] = st.states.pop(col)
            packed = Packed(self.columns.accepted(sid), group.fold().copy(), states, group.received)
            out.append((packed, group.world_size, tuple(group.keys)))
        return out

    def _values(self, st: Step) -> tuple[dict[str, float], list[str], dict[str, Any]]:
        """:func:`~rlmetrics.engine.steps.reduce_step`, the layout cached by the step's schemas."""
        key = tuple(st.groups)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= 1024:
                self._layouts.clear()
            lay = self._layouts[key] = layout_of(st, self.columns)
        values, empty, side = reduce_step(st, lay, self.columns, self.derived)
        if not math.isfinite(sum(values.values())):  # a sum of finite values is finite, but for overflow
            bad = [n for n, v in values.items() if not math.isfinite(v) and n not in self._nan_warned]
            if bad:
                self._nan_warned.update(bad)
                logger.debug("non-finite value in metric(s) %s", bad[:10])
        return values, empty, side

    _FINALIZED_CAP = 4096

    def _mark_finalized(self, step: int) -> None:
        """Note ``step`` finalized, advancing ``done_below`` (unused steps count as finalized, capped)."""
        if step in self._reopened:
            self._reopened.discard(step)
            return
        self._finalized.add(step)
        if self._lowest is not None and self._done_below < self._lowest <= step:
            # no client used a step below the first one it used (a trainer's step from 1, or from N
            # after a resume): those count as finalized, so that no reply lists every step since;
            # a client that uses one of them soon after reopens it (:meth:`_use`)
            self._unused, self._reused = (self._done_below, self._lowest), set(self._reopened)
            self._done_below = self._lowest
            self._finalized = {s for s in self._finalized if s >= self._lowest}
        while self._done_below in self._finalized:
            self._finalized.discard(self._done_below)
            self._done_below += 1
        if len(self._finalized) > self._FINALIZED_CAP:
            floor = min(self._steps) if self._steps else max(self._finalized) + 1
            self._finalized = {s for s in self._finalized if s >= floor}
            self._done_below = max(self._done_below, floor)

    def _use(self, step: int) -> None:
        """A client uses ``step``: reopen it if it counted finalized only for being unused (and is near)."""
        if self._unused is None or not self._unused[0] <= step < self._unused[1] or step in self._reused:
            return
        high = self._unused[1]
        if high - step > self.max_pending or self._done_below - high > self.max_pending:
            return  # far behind (a client counting from 0 joins a trainer's step 1000): late, as ever
        if len(self._reused) < self.max_pending:
            self._reused.add(step)  # that step alone, once: the others nobody used stay final
            self._reopened.add(step)

    @property
    def newest_final(self) -> int:
        """The newest finalized step (-1: none)."""
        return self._newest_final

    def finalized_state(self) -> tuple[int, list[int]]:
        """``(done_below, finalized)``: every step below ``done_below`` and those listed are finalized."""
        if not self._reopened:
            return self._done_below, sorted(self._finalized)
        low = min(self._reopened)  # at most 2 * max_pending steps listed
        return low, sorted(set(range(low, self._done_below)) - self._reopened | self._finalized)

    def export_state(self, results: int = 2) -> dict:
        """What a restarted aggregator resumes from (JSON-ready): clients, finalized steps, newest results.

        >>> from rlmetrics.packing import pack
        >>> engine = Aggregator()
        >>> engine.submit("a", 0, 0, 1, pack({"x": 2.0}))  # merged: True
        True
        >>> _ = engine.finalize(0)
        >>> again = Aggregator()
        >>> again.restore_state(engine.export_state())
        >>> again.result(0)["x"], again.is_finalized(0)
        (2.0, True)
        """
        newest = self.newest_results(results)
        return {
            "clients": sorted(self.clients),
            "done_below": self._done_below,
            "finalized": sorted(self._finalized),
            "unused": self._unused,
            "reused": sorted(self._reused),
            "reopened": sorted(self._reopened),
            "newest_closed": self.newest_closed,
            "newest_final": self._newest_final,
            "results": [saved_result(step, res) for step, res in newest],
        }

    def restore_state(self, state: Mapping) -> None:
        """Resume from :meth:`export_state` (of an earlier incarnation)."""
        self.clients = set(state["clients"])
        self._done_below = int(state["done_below"])
        self._finalized = set(state["finalized"])
        self._unused = tuple(state["unused"]) if state.get("unused") else None
        self._reused = set(state.get("reused", ()))
        self._reopened = set(state.get("reopened", ()))
        self.newest_closed = state.get("newest_closed")
        self._newest_final = int(state.get("newest_final", self._done_below - 1))
        for entry in state.get("results", ()):
            res = restored_result(entry)
            self._results[res.step] = res

    def result(self, step: int) -> StepResult | None:
        """A kept finalized result, or None."""
        return self._results.get(step)

    def newest_results(self, n: int) -> list[tuple[int, StepResult]]:
        """The ``n`` results finalized last (of those kept) as ``(step, result)``, oldest first."""
        return list(itertools.islice(reversed(self._results.items()), max(n, 0)))[::-1]

    def direct_step(self) -> int:
        """The step of a submission without client or step: the newest pending step, else a new round."""
        return max(self._steps) if self._steps else self._newest_final + 1


def saved_result(step: int, res: StepResult) -> list:
    """``res`` as JSON-ready ``[step, names, values, meta(, side)]``, values: base64 of their float64 bytes.

    >>> entry = saved_result(3, StepResult({"x": 0.1, "y": float("nan")}, 3, lists={"s": ["rank1"]}))
    >>> entry[:2], restored_result(entry)["x"], restored_result(entry).step, restored_result(entry).lists
    ([3, ['x', 'y']], 0.1, 3, {'s': ['rank1']})
    """
    values = np.array(list(res.values()), "<f8")  # a value that is no number raises
    entry = [step, list(res), base64.b64encode(values.tobytes()).decode(), res.meta.to_dict()]
    if res.histograms or res.lists:
        histograms = {k: h.to_dict() for k, h in res.histograms.items()}
        entry.append({"histograms": histograms, "lists": res.lists})
    return entry


def restored_result(entry: Sequence) -> StepResult:
    """The :class:`StepResult` of a :func:`saved_result` entry."""
    step, names, values, meta, *side = entry
    floats = np.frombuffer(base64.b64decode(values), "<f8").tolist()
    extra = side[0] if side else {}
    histograms = {k: Histogram.from_dict(d) for k, d in extra.get("histograms", {}).items()}
    meta = StepMeta.from_dict(meta)
    return StepResult(dict(zip(names, floats)), int(step), meta, histograms, extra.get("lists"))
