"""The aggregator side shared by the in-process and Ray backends: what each call does to the engine,
and when a read may return (backends add only locking and waiting). Over 400 lines on purpose: the
call protocol is one set of rules (sessions, relays, recovery, deadlines and persistence each change
what the others decide), read and tested in one place. docs/architecture.md, "The aggregator's rules".

>>> from rlmetrics.messages import MAX_STEP
>>> from rlmetrics.packing import pack
>>> from rlmetrics.engine.store import MemoryStore
>>> server = Server(store=MemoryStore())
>>> for rank in ("rank0", "rank1"):
...     items = [(0, 0, 2, pack({"loss": 1.0 if rank == "rank0" else 3.0}))]
...     [reply] = server.handle([Message(rank, items, close=[0])])
>>> reply.done_below, dict(server.read().end())  # the seed's wait_final_res: complete, saved
(1, {'loss': 2.0})
>>> again = Server(store=server.store)  # a next incarnation resumes from the saved state
>>> again.restored, dict(again.read(0).end()), again.recovering()  # waits for the clients' resends
(True, {'loss': 2.0}, True)
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from rlmetrics.engine.aggregator import Aggregator
from rlmetrics.engine.store import RefusedState, Store
from rlmetrics.messages import (
    MAX_STEP,
    Close,
    Message,
    Reply,
    StepMeta,
    StepResult,
    Submission,
    SubmissionError,
    rank_name,
)
from rlmetrics.packing import pack
from rlmetrics.wire import close_entry

logger = logging.getLogger(__name__)

FINAL_TIMEOUT = 60.0
"""Seconds ``wait_final_res()`` waits for its step to complete before it returns it partial."""
SAVED_RESULTS = 2
"""Newest results a saved state keeps: a read retried across a restart finds its step."""


class Notice(NamedTuple):
    """What a read tells ``client``: it missed ``step`` (``ahead`` closed it), or is ahead of ``behind``."""

    client: str
    step: int
    ahead: tuple[str, ...] = ()
    behind: tuple[str, ...] = ()


class Server:
    """The engine and the rules of every call on it. ``store``: where the state is saved and resumed
    from; ``upstream``: a node's client to the root (it finalizes nothing); ``session_ended(session)``:
    whether a run is over (None: no sessions); the rest goes to the Aggregator (docs/steps.md)."""

    def __init__(
        self,
        *,
        final_timeout: float = FINAL_TIMEOUT,
        step_timeout: float | None = None,
        incarnation: str | None = None,
        store: Store | None = None,
        recovery_timeout: float = 30.0,
        upstream: Any = None,
        session_ended: Callable[[str], bool] | None = None,
        **engine_options: Any,
    ) -> None:
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(
                f"step_timeout must be a positive number of seconds or None, got {step_timeout!r}"
            )
        self._engine_options = engine_options
        self.final_timeout = final_timeout
        self.step_timeout = step_timeout
        self.incarnation = incarnation or uuid.uuid4().hex
        self.store = store
        self.upstream = upstream
        self.session_ended = session_ended
        self.refused_state: str | None = None  # why a stored state was not resumed from
        self._start_empty()
        saved = self._load()
        self.restored = saved is not None and self._resume(saved, recovery_timeout)
        self._saved: tuple | None = self._marker()  # what the state saved last records (None: resave)
        self._durable = self.engine.finalized_state()  # its finalized steps (replies let clients forget them)

    def _start_empty(self) -> None:
        self.engine = Aggregator(**self._engine_options)
        self.awaiting: set[str] = set()  # registered clients a restarted incarnation waits for
        self.recovery_deadline = 0.0
        self.sessions: dict[str, str] = {}  # client -> its session
        self.ended: set[str] = set()  # sessions found over: their messages are refused
        self.via: dict[str, str] = {}  # rank -> the node client that speaks for it
        self.nodes: dict[str, str] = {}  # node client -> its address (the backend's, e.g. an actor name)
        self.processes: dict[str, dict] = {}  # client -> where it runs (the backend's ids: a Ray actor's)
        self._seen_sessions: set[str] = set()
        self._latest_session: str | None = None  # the session seen last (a new run's)
        self.changes = 0  # counts changes of sessions and relays (what a saved state must follow)
        self._closed_at: dict[int, float] = {}  # pending steps: when a client first closed them
        self._announced: dict[int, set[str]] = {}  # steps closed below a node, not forwarded yet: by whom
        self._sessions_checked = 0.0  # when the open sessions were last asked whether they ended
        self._direct = itertools.count()
        self._late = 0  # the engine's late count when the previous step was finalized
        self.logging_reader: tuple[str, str | None] | None = None  # (reader, session) ending steps
        self._returned: dict[str, tuple[int, int]] = {}  # reader -> newest step final(), result() gave it
        self.missed: dict[str, int] = {}  # client -> newest step a final() read ended without its close
        self.notices: list[Notice] = []  # what wait_final_res reads tell clients, for a backend to push

    @property
    def finalizes(self) -> bool:
        """This server finalizes steps (not a node sub-aggregator's: its root does)."""
        return self.upstream is None

    # ------------------------------------------------------------------------------- recovery
    def _load(self) -> dict | None:
        try:
            return None if self.store is None else self.store.load()
        except RefusedState as exc:
            self._refuse(str(exc))
            return None

    def _resume(self, saved: dict, recovery_timeout: float) -> bool:
        """Resume from ``saved``; False when unreadable: it starts empty (failing would restart forever)."""
        try:
            self.restore(saved, recovery_timeout)
            return True
        except Exception as exc:  # noqa: BLE001 - a state this server saved, in a form it does not read
            where = self.store.where if self.store is not None else "the given state"
            self._refuse(f"the saved state in {where} could not be read ({exc!r:.200})")
            self._start_empty()  # the failed restore may have left part of the state
            return False

    def _refuse(self, why: str) -> None:
        self.refused_state = f"{why}: refused; starting empty, the clients resend what they keep"
        logger.error("rlmetrics: %s", self.refused_state)

    def export_state(self, results: int = SAVED_RESULTS) -> dict:
        """What a next incarnation resumes from (JSON-ready): the engine's state, sessions and relays."""
        state = self.engine.export_state(results)
        state["sessions"] = dict(self.sessions)
        state["ended"] = sorted(self.ended)
        state["via"] = dict(self.via)
        state["nodes"] = dict(self.nodes)
        state["processes"] = dict(self.processes)
        return state

    def restore(self, state: Mapping, recovery_timeout: float) -> None:
        """Resume from :meth:`export_state`; wait at most ``recovery_timeout`` s for the clients' resends."""
        self.engine.restore_state(state)
        self.sessions = dict(state.get("sessions", {}))
        self.ended = set(state.get("ended", ()))
        self.via = dict(state.get("via", {}))
        self.nodes = dict(state.get("nodes", {}))
        self.processes = dict(state.get("processes", {}))
        self._seen_sessions = set(self.sessions.values()) | self.ended
        # a node resends for the ranks it speaks for (it resyncs under its own id)
        clients = state["clients"]
        self.awaiting = {c for c in clients if c not in self.via} | {
            self.via[c] for c in clients if c in self.via
        }
        self.recovery_deadline = time.monotonic() + recovery_timeout

    def recovering(self) -> bool:
        return bool(self.awaiting) and time.monotonic() < self.recovery_deadline

    def _marker(self) -> tuple:
        """What the saved state depends on (at a root also the finalized steps and newest result)."""
        engine = self.engine
        if not self.finalizes:
            return (frozenset(engine.clients), self.changes)
        done_below, finalized = engine.finalized_state()
        newest = tuple(step for step, _ in engine.newest_results(1))
        return (
            frozenset(engine.clients),
            done_below,
            len(finalized),
            engine.newest_closed,
            newest,
            self.changes,
        )

    def persist(self) -> None:
        """Save what a next incarnation resumes from, if that changed (with a store)."""
        if self.store is None:
            return
        marker = self._marker()  # on every call: built once (a frozenset of the clients)
        if marker == self._saved:
            return
        self._saved = marker
        state = self.export_state(results=0)
        if self.finalizes:  # the results as they are: the store encodes each once
            state["results"] = self.engine.newest_results(SAVED_RESULTS)
        else:
            state.update(done_below=0, finalized=[], results=[])
        self.store.save(state, lambda saved: self._on_saved(state, saved))

    def _on_saved(self, state: dict, saved: bool) -> None:
        if saved:
            self._durable = (state["done_below"], state["finalized"])
        else:  # the next change saves again; until a save lands, clients keep their steps
            self._saved = None

    def durable(self) -> tuple[int, list[int]]:
        """``(done_below, finalized)`` replies report: as saved last, as the root said, or the engine's."""
        if self.upstream is not None:
            return self.upstream.finalized_state
        return self._durable if self.store is not None else self.engine.finalized_state()

    # --------------------------------------------------------------------------------- intake
    def handle(self, messages: Iterable[Message]) -> list[Reply]:
        """Merge each message, finalize the steps they completed, save, reply (plain replies: one object)."""
        steps: set[int] = set()
        outcomes = []
        messages = list(messages)
        for message in messages:
            late: set[int] = set()
            errors = self.merge(*message, steps=steps, late=late)
            outcomes.append((errors, late))
        self.finalize_complete(steps)
        self.persist()
        plain = self.reply({})
        replies = []
        for message, (errors, late) in zip(messages, outcomes):
            missed = self.missed.get(message.client, -1)
            replies.append(self.reply(errors, late, missed) if errors or late or missed >= 0 else plain)
            if missed >= 0 and any(type(step) is int and step > missed for step in message.close):
                del self.missed[message.client]  # it closed a later step: it caught up
        return replies

    def merge(
        self,
        client_id: str,
        items: list[Submission],
        close: list[Close],
        resync: bool = False,
        session: str | None = None,
        steps: set[int] | None = None,
        late: set[int] | None = None,
    ) -> dict[str, str]:
        """:func:`merge_items` of one message (a ``resync`` is not late); its steps into ``steps``."""
        refused = self.join(client_id, session)
        if refused:
            return {client_id: refused}
        closed: set[int] = set()
        errors = merge_items(
            self.engine,
            client_id,
            items,
            close,
            count_late=not resync,
            speaks=self._speaks,
            closed=closed,
            late=late,
        )
        now = time.monotonic()
        for step in closed if self.finalizes else ():  # a node's steps have no deadline of their own
            self._closed_at.setdefault(step, now)
        if steps is not None:
            steps.update(closed)
            steps.update(item[0] for item in items if type(item[0]) is int)
        if resync:
            self.awaiting.discard(client_id)
        return errors

    def _speaks(self, sender: str, client_id: str) -> bool:
        return client_id == sender or self.via.get(client_id) == sender

    def join(self, client_id: str, session: str | None) -> str | None:
        """Note ``client_id``'s session; None, or why its message is refused (its run ended). Each new
        client ends the runs found over (Ray may record a killed run's end a moment later)."""
        if session is None or self.session_ended is None:
            return None
        if session in self.ended:
            return (
                f"client {client_id} belongs to run {session}, which ended: a restarted run's clients "
                "are new clients (this one's data is not merged)"
            )
        if client_id not in self.sessions:
            self.sessions[client_id] = session
            self.changes += 1
            new = session not in self._seen_sessions
            self._seen_sessions.add(session)
            if new:  # a lost rank of another run says nothing of this run's steps
                self._latest_session = session
                for lost in [c for c in self.engine.lost if self.sessions.get(c) != session]:
                    del self.engine.lost[lost]
            if new or time.monotonic() - self._sessions_checked >= 1.0:  # at most once a second
                self._end_sessions(session)
        return None

    def _end_sessions(self, new: str | None) -> None:
        """Close the runs seen that ended (``new``: the run that just started, None: none)."""
        ended = self.session_ended
        assert ended is not None  # join() tracks sessions only with it
        self._sessions_checked = time.monotonic()
        for old in sorted(self._seen_sessions - self.ended - {new}):
            if not ended(old):
                continue
            self.ended.add(old)
            self.changes += 1
            gone = {c for c, s in self.sessions.items() if s == old}
            for c in gone:
                del self.sessions[c]
                self.via.pop(c, None)
            self.awaiting.difference_update(gone)
            changed = self.engine.discard(gone)
            for step in list(self._announced):
                self._announced[step] -= gone
                if not self._announced[step]:
                    del self._announced[step]
                    changed.append(step)
            engine = self.engine
            for step in changed:  # a step that lost its closes has no deadline of the ended run's
                if not engine.closers(step) and step not in self._announced:
                    self._closed_at.pop(step, None)
            closed = [s for s in engine.pending_steps() if engine.closers(s)] + list(self._announced)
            final = [engine.newest_final] if engine.newest_final >= 0 else []
            engine.newest_closed = max([*closed, *final], default=None)
            logger.warning(
                "run %s ended%s: %d of its clients are no longer waited for, their open "
                "contributions to steps %s are dropped",
                old, f" (run {new} started)" if new else "", len(gone), changed[:10],
            )  # fmt: skip
            self.finalize_complete(self.engine.pending_steps())

    def relay(self, node: str, client_id: str, address: str, session: str | None = None) -> str | None:
        """``node`` (at ``address``) speaks for ``client_id``, which registers; None, or why refused."""
        refused = self.join(client_id, session)
        if refused:
            return refused
        if self.via.get(client_id) != node or self.nodes.get(node) != address:
            self.via[client_id] = node
            self.nodes[node] = address
            self.changes += 1
        self.engine.register(client_id)
        self.persist()
        return None

    def announce(self, step: int, client_id: str) -> None:
        """``client_id`` closed ``step`` below a node sub-aggregator, whose forward follows."""
        self.engine.note_closed(step, client_id)
        self._closed_at.setdefault(step, time.monotonic())
        self._announced.setdefault(step, set()).add(client_id)
        self.persist()

    def nodes_of(self, step: int) -> list[str]:
        """The addresses of the nodes that speak for a rank ``step`` misses (a deadline drains them)."""
        if self.engine.is_finalized(step):
            return []
        missing, _ = self.engine.missing(step)
        return sorted(
            {self.nodes[self.via[c]] for c in missing if c in self.via and self.via[c] in self.nodes}
        )

    def finalize_complete(self, steps: Iterable[int]) -> None:
        """Finalize those of ``steps`` that hold data, some client closed, and are complete now."""
        if not self.finalizes:
            return
        engine = self.engine
        for step in sorted(set(steps)):
            if engine.has_closed_data(step) and engine.is_settled(step):
                self.finalize(step)

    def reply(self, errors: dict[str, str], late: Iterable[int] = (), missed: int = -1) -> Reply:
        """The reply to a message: ``errors``, ``late`` steps, :meth:`durable` and ``missed``."""
        return Reply(errors, self.incarnation, *self.durable(), late=sorted(late), missed=missed)

    def submit_direct(self, metrics: Mapping[str, Any], world_size: int, step: int | None = None) -> None:
        """The seed's ``MetricWorker.submit_metric``: into ``step`` (default: the current round)."""
        target = self.engine.direct_step() if step is None else step
        self.engine.submit("direct", target, next(self._direct), world_size, pack(metrics), register=False)

    def register(self, client_id: str, session: str | None = None) -> str | None:
        """Wait for ``client_id`` in every step from now on; None, or why it is refused (as :meth:`join`)."""
        refused = self.join(client_id, session)
        if refused is None:
            self.engine.register(client_id)
            self.persist()
        return refused

    def depart(self, client_id: str) -> None:
        """``client_id`` leaves: no step waits for it, and steps that waited only for it finalize."""
        self.engine.depart(client_id)
        self.processes.pop(client_id, None)
        self.finalize_complete(self.engine.pending_steps())
        self.persist()

    def runs_in(self, client_id: str, process: Mapping[str, Any]) -> None:
        """``client_id`` runs in ``process`` (e.g. a Ray actor id), whose end the backend watches for."""
        if len(self.processes) >= 4 * len(self.engine.clients) + 1024:  # clients that never submitted
            self.processes = {c: p for c, p in self.processes.items() if c in self.engine.clients}
        self.processes[client_id] = dict(process)
        self.changes += 1
        self.persist()

    def watched(self) -> dict[str, dict]:
        """The registered clients whose process the backend is to watch: where each runs."""
        clients = self.engine.clients
        return {c: p for c, p in self.processes.items() if c in clients}

    def lose(self, client_id: str, why: str) -> None:
        """``client_id``'s process is gone (``why``): :meth:`~rlmetrics.engine.aggregator.Aggregator.lose`."""
        if client_id not in self.engine.clients:
            return
        if self.session_ended is not None and self._ended(self.sessions.get(client_id)):
            self.processes.pop(client_id, None)
            self._end_sessions(None)  # its whole run ended (a killed driver): closed, none of its steps ends
            self.persist()
            return
        latest = self._latest_session
        if latest is not None and self.sessions.get(client_id, latest) != latest:
            self.engine.depart(client_id)  # a newer run started: its steps are not this rank's
        else:
            self.engine.lose(client_id, why)
        self.processes.pop(client_id, None)
        self.changes += 1
        logger.warning(
            "rlmetrics: %s (%s) is gone: %s; the step it did not close ends partial naming it, later "
            "steps do not wait for it",
            rank_name(client_id), client_id, why,
        )  # fmt: skip
        self.finalize_complete(self.engine.pending_steps())
        self.persist()

    # ------------------------------------------------------------------------------ deadlines
    def tick(self, finalize: bool = True) -> tuple[list[int], float | None]:
        """The steps whose own deadline passed (finalized and saved when ``finalize``; a backend with
        nodes drains them first), and when the next passes (``time.monotonic()``; None: none)."""
        due = self._due()
        if finalize:
            for step in due:
                self.finalize(step)
            self.persist()
        return due, self._next_due()

    def _due(self) -> list[int]:
        if self.step_timeout is None or not self.finalizes or self.recovering():
            return []
        now, engine = time.monotonic(), self.engine
        for step in [s for s in self._closed_at if engine.is_finalized(s)]:
            del self._closed_at[step]
        return sorted(s for s, t in self._closed_at.items() if t + self.step_timeout <= now)

    def _next_due(self) -> float | None:
        if self.step_timeout is None or not self.finalizes or not self._closed_at:
            return None
        if self.recovering():
            return self.recovery_deadline
        return min(self._closed_at.values()) + self.step_timeout

    # ---------------------------------------------------------------------------------- reads
    def read(self, step: int | None = None, reader: str = "", session: str | None = None,
             finalize: bool = False) -> Read:  # fmt: skip
        """A read of ``step`` (None: a ``wait_final_res`` read, of the newest step every rank closed) by
        ``reader`` (a client's id, ``""``: anonymous) of run ``session`` (None: not tracked).

        The backend, holding its lock, waits until ``ready()`` (checked again at each change) or its
        deadline (its ``timeout``; ``final_timeout`` for ``wait_final_res``), asks the node
        sub-aggregators of ``drain()`` to forward (Ray only), then calls ``end()`` once (it may
        finalize the step); after a ``wait_final_res`` read it hands :attr:`notices` to the clients.
        """
        if finalize or step is None:
            self._note_reader(reader, session, finalize)
        return Read(self, step, reader, session, finalize)

    def _result_ready(self, step: int) -> bool:
        """A reader of ``step`` may stop waiting: final, or (no recovery under way) complete or passed."""
        engine = self.engine
        return engine.is_finalized(step) or (
            not self.recovering()
            and (
                engine.is_settled(step)
                or (engine.passed(step) and step not in self._announced)  # (a node's forward follows)
            )
        )

    def _result(self, step: int, finalize: bool, reader: str, session: str | None) -> StepResult:
        """``step``'s result now: final when ready or ``finalize`` (run not ended), else provisional."""
        engine = self.engine
        if not engine.knows(step) and step not in self._announced:
            return engine.peek(step, contributions=(0, 0), ranks_at=engine.ranks_closed_up_to())
        if self._result_ready(step) or (finalize and not self._ended(session)):
            result = self.finalize(step)
            self.persist()
            if reader:
                self._give(reader, step, by_result=True)
            return result
        return engine.peek(step, contributions=engine.contributions(step))

    def _note_reader(self, reader: str, session: str | None, finalize: bool) -> None:
        """A ``finalize=True`` read makes ``reader`` the logging reader; a ``wait_final_res`` one if none."""
        if finalize or self.logging_reader is None:
            self.logging_reader = (reader, session)

    def _logs(self, reader: str, session: str | None) -> bool:
        """Whether ``reader``'s ``wait_final_res`` ends its step at the deadline (the logging reader's)."""
        me = (reader, session)
        if self._ended(session):
            return False
        if self.logging_reader is None or (self.logging_reader != me and self._ended(self.logging_reader[1])):
            self.logging_reader = me
        return self.logging_reader == me

    def _ended(self, session: str | None) -> bool:
        return (
            session is not None
            and self.session_ended is not None
            and (session in self.ended or self.session_ended(session))
        )

    def finalize(self, step: int) -> StepResult:
        """The engine's ``finalize``, with ``meta.contributions`` and ``meta.late``."""
        engine = self.engine
        if engine.is_finalized(step):
            return engine.finalize(step)
        late, self._late = engine.late - self._late, engine.late
        result = engine.finalize(step, contributions=engine.contributions(step), late=late)
        self._closed_at.pop(step, None)
        self._announced.pop(step, None)
        return result

    def _final_target(self, reader: str = "") -> int | None:
        """The step ``reader``'s ``wait_final_res`` is about (None: nothing new; docs/steps.md, "Reading
        a step"): the newest step every rank closed, else the oldest later step some rank closed."""
        engine = self.engine
        after, read = self._returned.get(reader, (-1, -1))
        if engine.newest_closed is None:  # no rank closed a step: the seed's direct rounds, if no rank
            pending = [s for s in engine.pending_steps() if s > after]
            return pending[-1] if pending and not self._ranks() else None
        at = [s for c, s in engine.ranks_closed_up_to().items() if c not in engine.lost]
        agreed = min(at) if at else -1
        seen = max(after, read)
        if agreed > seen:
            return agreed
        closed = [s for s in engine.pending_steps() if s > seen and engine.closers(s)]
        later = min([*closed, *(s for s in self._announced if s > seen)], default=None)
        return agreed if later is None and agreed > after else later

    def _final_ready(self, target: int | None) -> bool:
        """A ``wait_final_res`` read of ``target`` may return: complete, or a direct round."""
        if target is None:
            return False
        if self.engine.newest_closed is None:
            return not self.recovering()
        return self._result_ready(target)

    def _ranks(self) -> bool:
        """Some registered client is not lost (a read waits for the ranks to close a step)."""
        return bool(self.engine.clients - self.engine.lost.keys())

    def _final(self, target: int | None, reader: str, session: str | None) -> StepResult:
        """``target`` final when ready or :meth:`_logs` (telling who missed it), else provisional."""
        engine = self.engine
        if target is None:  # nothing new: where the ranks are (-1: closed none yet)
            at = {c: -1 for c in engine.clients if c not in engine.lost} | engine.ranks_closed_up_to()
            return StepResult({}, -1, StepMeta.of(provisional=True, ranks_at=at))
        self._give(reader, target)
        ready = self._result_ready(target)
        if ready or self._logs(reader, session):
            self._tell_missed(target, at_deadline=not ready)
            result = self.finalize(target)
            self.persist()
            return result
        return engine.peek(target, contributions=engine.contributions(target))

    def _give(self, reader: str, step: int, by_result: bool = False) -> None:
        """``reader`` was given ``step`` final (by ``wait_final_res``, or by a step's read)."""
        if len(self._returned) >= 1024 and reader not in self._returned:
            self._returned.clear()  # readers come and go (a client each): the old ones are forgotten
        after, read = self._returned.get(reader, (-1, -1))
        self._returned[reader] = (after, max(step, read)) if by_result else (max(step, after), read)

    def _tell_missed(self, target: int, at_deadline: bool) -> None:
        """Tell the clients one step off when a ``final`` read ends ``target`` (docs/steps.md, "The step
        counter"); ended at the deadline, a client ahead may have closed ``target`` empty on its way."""
        engine = self.engine
        closers = set() if engine.is_finalized(target) else engine.closers(target)
        absent = engine.clients - closers - set(engine.lost) if closers else set()  # none: a direct round
        newest = engine.ranks_closed_up_to()
        gave = engine.contributors(target)  # a client that closed target empty on its way gave nothing
        ahead = sorted(c for c in closers - gave if newest.get(c, target) == target + 1)
        on_time = sorted(c for c in closers if newest.get(c, target) == target and c not in engine.lost)
        if at_deadline and not absent and ahead and gave.intersection(on_time):
            for client in on_time:
                if target + 1 > self.missed.get(client, -1):
                    self.missed[client] = target + 1
                    self.notices.append(Notice(client, target + 1, ahead=tuple(ahead)))
            self.notices += [Notice(client, target + 1, behind=tuple(on_time)) for client in ahead]
            return
        earlier = set().union(*(engine.closers(s) for s in engine.pending_steps() if s < target))
        on_time = sorted(absent & earlier)  # at an earlier pending step: not behind, the closers are ahead
        ahead = sorted(closers) if on_time else []
        for client in sorted(absent):
            if target > self.missed.get(client, -1):
                self.missed[client] = target
                others = tuple(ahead) if client in on_time else ()
                self.notices.append(Notice(client, target, ahead=others))
        self.notices += [Notice(client, target, behind=tuple(on_time)) for client in ahead]

    def stats(self) -> dict:
        """Registered clients, pending steps and what the engine holds (tests and monitoring)."""
        return {
            "clients": sorted(self.engine.clients),
            "pending": self.engine.pending_steps(),
            "memory": self.engine.memory(),
            "late": self.engine.late,
            "refused_state": self.refused_state,
        }


@dataclass
class Read:
    """A reader's read (:meth:`Server.read`) of ``step`` (None: ``wait_final_res``, about :attr:`target`)."""

    server: Server
    step: int | None
    reader: str = ""
    session: str | None = None
    finalize: bool = False

    @property
    def target(self) -> int | None:
        """The step read (a ``wait_final_res`` read's may move as ranks close steps)."""
        return self.step if self.step is not None else self.server._final_target(self.reader)

    def ready(self) -> bool:
        """The read may return before its deadline."""
        if self.step is not None:
            return self.server._result_ready(self.step)
        return self.server._final_ready(self.target)

    def drain(self) -> tuple[int, bool] | None:
        """At the deadline: ``(step, finalize)`` whose nodes forward what they hold first (None: none)."""
        if self.ready():
            return None
        if self.step is not None:
            return self.step, self.finalize
        target = self.target
        return (target, True) if target is not None and self.server._logs(self.reader, self.session) else None

    def end(self) -> StepResult:
        """The result: final when ready or at a finalizing reader's deadline, else provisional. Call
        it once: it finalizes and saves the step, and records it given to the reader."""
        if self.step is not None:
            return self.server._result(self.step, self.finalize, self.reader, self.session)
        return self.server._final(self.target, self.reader, self.session)


def merge_items(
    engine: Aggregator,
    client_id: str,
    items: list[Submission],
    close: list[Close],
    *,
    count_late: bool = True,
    speaks: Callable[[str, str], bool] | None = None,
    closed: set[int] | None = None,
    late: set[int] | None = None,
) -> dict[str, str]:
    """Merge a client's items, then its closes (into ``closed``; late steps into ``late``); the errors.
    Items and closes for other clients (a node's forward) are refused unless ``speaks(sender, client)``."""
    errors: dict[str, str] = {}
    for step, seq, world_size, packed in items:
        try:
            if isinstance(seq, tuple):
                others = _not_spoken_for(client_id, [key_client(key) for key in seq], speaks)
                if others:
                    raise SubmissionError(
                        f"{client_id} does not speak for {others[:3]} (no node relayed them)"
                    )
                merged = engine.submit_merged(seq, step, world_size, packed, count_late=count_late)
            else:
                merged = engine.submit(client_id, step, seq, world_size, packed, count_late=count_late)
            if not merged and count_late and late is not None and engine.is_finalized(step):
                late.add(step)
        except (SubmissionError, ValueError) as exc:
            errors[f"{client_id}/{step}/{_seq_text(seq)}"] = f"step {step}: {exc}"
    for entry in close:
        if type(entry) is int and 0 <= entry <= MAX_STEP:  # the common case: the sender closes a step
            engine.close(client_id, entry)
            if closed is not None:
                closed.add(entry)
            continue
        try:
            entry = close_entry(entry)
        except SubmissionError as exc:
            errors[f"{client_id}/close/{entry!r:.40}"] = str(exc)
            continue
        step, closers = entry if isinstance(entry, tuple) else (entry, (client_id,))
        others = _not_spoken_for(client_id, closers, speaks)
        if others:  # the others close: each close is one client's
            errors[f"{client_id}/{step}/close"] = f"step {step}: {client_id} does not close for {others[:3]}"
        for closer in closers:
            if closer not in others:
                engine.close(closer, step)
        if closed is not None and len(others) < len(closers):
            closed.add(step)
    return errors


def key_client(key: Any) -> str:
    """The client of a ``(client_id, seq)`` key of a merged item."""
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and type(key[1]) is int):
        raise SubmissionError(f"a merged item's keys are (client_id, seq) pairs, got {key!r:.60}")
    return key[0]


def _not_spoken_for(
    sender: str, clients: Iterable[str], speaks: Callable[[str, str], bool] | None
) -> list[str]:
    """The ``clients`` other than ``sender`` it does not speak for."""
    return [c for c in clients if c != sender and (speaks is None or not speaks(sender, c))]


def _seq_text(seq: Any) -> str:
    return str(seq) if not isinstance(seq, tuple) else f"merged({len(seq)})"
