"""The aggregator side shared by the in-process and Ray backends: what each call does to the engine,
and when a read may return. Backends add only locking and waiting (a thread condition, asyncio).

- ``receive``: a client's items and step closings are merged; every step this completes is
  finalized at once, read or not (its result is kept, up to ``keep_results``), so memory follows
  the steps in flight, not the steps nobody reads.
- ``result(step)`` may return once the step is complete or finalized; at the reader's deadline it
  finalizes that step, and only that step, as it stands.
- A step finalized here says how whole it is: ``meta.contributions`` is ``[received, expected]``
  contributions summed over its names, ``meta.late`` counts the contributions that arrived for
  steps already final since the previous step was finalized (they were dropped).
- ``final()`` (the seed's ``wait_final_res``) is about the newest step any client closed: it may
  return once that step is complete (every registered client closed it and every name has its
  contributions), at ``final_timeout`` partial. With no client at all (the seed's bare
  ``MetricWorker.submit_metric`` rounds) it finalizes what arrived since the last read, and the
  next submission starts a new round.
- A restarted incarnation (Ray) knows the registered clients from its saved state and waits, at most
  ``recovery_timeout`` seconds, until each of them resent what it keeps.

>>> from rlmetrics.packing import pack
>>> server = Server()
>>> for rank in ("rank0", "rank1"):
...     reply = server.receive(rank, [(0, 0, 2, pack({"loss": 1.0 if rank == "rank0" else 3.0}))], [0])
>>> server.engine.is_finalized(0), server.final_target(), dict(server.final(0))  # complete: finalized
(True, 0, {'loss': 2.0})
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from rlmetrics.aggregator import Aggregator
from rlmetrics.messages import Reply, StepResult, SubmissionError
from rlmetrics.packing import Packed, pack

Submission = tuple[int, int, int, Packed]  # (step, seq, world_size, packed)

FINAL_TIMEOUT = 60.0
"""Seconds ``wait_final_res()`` waits for the newest closed step to complete before it returns it
partial (with ``meta`` naming what is missing, and a warning)."""


class Server:
    """The engine and the rules of every call on it (see the module docstring).

    ``final_timeout``: default deadline of :meth:`final` reads; ``incarnation``: this server's id
    (a restarted Ray actor gets a new one); ``auto_finalize=False`` keeps complete steps pending
    (a node sub-aggregator forwards them instead); the rest goes to
    :class:`~rlmetrics.aggregator.Aggregator` (``renames``, ``keep_results``, ``forget_after``,
    ``max_pending``).
    """

    def __init__(
        self,
        *,
        final_timeout: float = FINAL_TIMEOUT,
        incarnation: str | None = None,
        auto_finalize: bool = True,
        **engine_options: Any,
    ) -> None:
        self.engine = Aggregator(**engine_options)
        self.final_timeout = final_timeout
        self.incarnation = incarnation or uuid.uuid4().hex
        self.auto_finalize = auto_finalize
        self.awaiting: set[str] = set()  # registered clients a restarted incarnation waits for
        self.recovery_deadline = 0.0
        self._direct = itertools.count()
        self._late = 0  # the engine's late count when the previous step was finalized

    # ------------------------------------------------------------------------------- recovery
    def restore(self, state: Mapping, recovery_timeout: float) -> None:
        """Resume from the engine state an earlier incarnation saved, and wait (at most
        ``recovery_timeout`` seconds) for its registered clients' resends."""
        self.engine.restore_state(state)
        self.awaiting = set(state["clients"])
        self.recovery_deadline = time.monotonic() + recovery_timeout

    def recovering(self) -> bool:
        return bool(self.awaiting) and time.monotonic() < self.recovery_deadline

    # --------------------------------------------------------------------------------- intake
    def receive(
        self, client_id: str, items: list[Submission], close: list[int], resync: bool = False
    ) -> Reply:
        """Merge one client's message (:meth:`merge`) and build its reply."""
        errors = self.merge(client_id, items, close, resync)
        self.finalize_complete(_steps_of(items, close))
        return self.reply(errors)

    def merge(self, client_id: str, items: list[Submission], close: list[int], resync: bool = False) -> dict:
        """:func:`merge_items`, and a resend after a restart ends the wait for that client. Call
        :meth:`finalize_complete` after."""
        errors = merge_items(self.engine, client_id, items, close)
        if resync:
            self.awaiting.discard(client_id)
        return errors

    def finalize_complete(self, steps: Iterable[int]) -> None:
        """Finalize those of ``steps`` that hold data, some client closed, and are complete now."""
        if not self.auto_finalize:
            return
        engine = self.engine
        for step in sorted(set(steps)):
            if engine.has_closed_data(step) and engine.is_complete(step):
                self.finalize(step)

    def reply(self, errors: dict[str, str]) -> Reply:
        return make_reply(self.engine, errors, self.incarnation)

    def submit_direct(self, metrics: Mapping[str, Any], world_size: int, step: int | None = None) -> None:
        """A submission without a client (the seed's ``MetricWorker.submit_metric``): into ``step``,
        by default the newest pending step, else a new round after the newest finalized step."""
        target = self.engine.direct_step() if step is None else step
        self.engine.submit("direct", target, next(self._direct), world_size, pack(metrics), register=False)

    def register(self, client_id: str) -> None:
        self.engine.register(client_id)

    def announce(self, client_id: str, step: int) -> None:
        """``client_id`` (a node sub-aggregator) will close ``step``: a rank below it closed it."""
        self.engine.register(client_id)
        self.engine.note_closed(step)

    def depart(self, client_id: str) -> None:
        """``client_id`` leaves: no step waits for it, and steps that waited only for it finalize."""
        self.engine.depart(client_id)
        self.finalize_complete(self.engine.pending_steps())

    # ---------------------------------------------------------------------------------- reads
    def result_ready(self, step: int) -> bool:
        """A reader of ``step`` may stop waiting (no recovery is under way)."""
        engine = self.engine
        return not self.recovering() and (engine.is_finalized(step) or engine.is_complete(step))

    def result(self, step: int) -> StepResult:
        """``step``'s result now: kept, complete, or partial (a reader's deadline passed)."""
        return self.finalize(step)

    def finalize(self, step: int) -> StepResult:
        """The engine's :meth:`~rlmetrics.aggregator.Aggregator.finalize`; a step finalized now also
        gets ``meta.contributions`` and ``meta.late`` (module docstring)."""
        engine = self.engine
        if engine.is_finalized(step):
            return engine.finalize(step)
        counts = engine.contributions(step)
        result = engine.finalize(step)
        result.meta.contributions = list(counts)
        result.meta.late, self._late = engine.late - self._late, engine.late
        return result

    def final_target(self) -> int | None:
        """The step :meth:`final` is about: the newest one any client closed; without clients the
        newest pending step (the seed's direct round); None when there is nothing."""
        engine = self.engine
        if engine.newest_closed is not None:
            return engine.newest_closed
        pending = engine.pending_steps()
        return pending[-1] if pending else None

    def final_ready(self, target: int | None) -> bool:
        """A ``final`` read of ``target`` may return: complete, or a direct round (never waited for)."""
        if target is None or self.engine.newest_closed is None:
            return not self.recovering()
        return self.result_ready(target)

    def final(self, target: int | None) -> StepResult:
        if target is None:
            return StepResult({}, -1)
        return self.finalize(target)

    def stats(self) -> dict:
        """Registered clients, pending steps and what the engine holds (tests and monitoring)."""
        return {
            "clients": sorted(self.engine.clients),
            "pending": self.engine.pending_steps(),
            "memory": self.engine.memory(),
            "late": self.engine.late,
        }


def merge_items(
    engine: Aggregator, client_id: str, items: list[Submission], close: list[int]
) -> dict[str, str]:
    """Merge a client's items, then its step closings; the errors keyed by client, step and seq
    (a rejected item does not stop the others)."""
    errors: dict[str, str] = {}
    for step, seq, world_size, packed in items:
        try:
            engine.submit(client_id, step, seq, world_size, packed)
        except (SubmissionError, ValueError) as exc:
            errors[f"{client_id}/{step}/{seq}"] = f"step {step}: {exc}"
    for step in close:
        engine.close(client_id, step)
    return errors


def make_reply(engine: Aggregator, errors: dict[str, str], incarnation: str) -> Reply:
    """The reply to a send: errors, and what the client may stop keeping (steps below
    ``done_below`` and those in ``finalized`` are finalized)."""
    done_below, finalized = engine.finalized_state()
    return Reply(errors, incarnation, done_below, finalized)


def _steps_of(items: list[Submission], close: list[int]) -> set[int]:
    return {item[0] for item in items} | set(close)
