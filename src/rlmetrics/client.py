"""Backend-neutral client logic: step counter, coalescing, resend buffer, sequence ids.

Over 400 lines on purpose: one state machine under one lock; split, each part would need the others'
invariants. A client sends a step's data to its :class:`Transport` in one call at ``wait_submit()``
and keeps it until the step is final, resending it after a restart (docs/steps.md, "Failures"; ids
and credentials: docs/reliability.md, "Trust model: other jobs on the cluster")."""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import os
import re
import secrets
import socket
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

from rlmetrics.core.groups import Labels, grouped_values, split_grouped
from rlmetrics.core.reduce import rules_version
from rlmetrics.core.stat import NAN_STRATEGIES, MetricValueError
from rlmetrics.engine.derived import without_reserved
from rlmetrics.messages import (
    MAX_STEP,
    ApproximateWarning,
    Close,
    LateDataWarning,
    NonFiniteWarning,
    OnBehalf,
    PartialStepWarning,
    ProvisionalWarning,
    Reply,
    StepResult,
    StepWarning,
    Submission,
    SubmissionError,
    WorldSizeWarning,
    caller_level,
    rank_name,
)
from rlmetrics.packing import MAX_WORLD_SIZE, Packed, pack, pack_known

T = TypeVar("T")
_SCHEMA_CACHE = 512  # schemas a client remembers; beyond, it forgets them all (names that change)


class AggregatorRestarted(ConnectionError):
    """The aggregator restarted during a call; it is reachable again. The client resends and retries."""


@runtime_checkable
class Transport(Protocol):
    """What a backend provides to a client: ``post`` sends without waiting, ``collect(posted, block)``
    gives its reply (None while not there and not ``block``), ``watch(client)`` calls
    ``client.resync()`` on a restart; ``who`` is a :func:`credential`. Any call may raise
    :class:`AggregatorRestarted`."""

    def send(self, who: str, items: list[Submission], close: list[Close], resync: bool = False) -> Reply: ...

    def post(self, who: str, items: list[Submission], close: list[Close], block: bool = False) -> Any: ...

    def collect(self, posted: Any, block: bool = True) -> Reply | None: ...

    def result(
        self, step: int, timeout: float | None, finalize: bool = False, who: str | None = None
    ) -> StepResult: ...

    def final(self, timeout: float | None = None, who: str | None = None) -> StepResult: ...

    def register(self, who: str) -> None: ...

    def depart(self, who: str) -> None: ...

    def watch(self, client: ClientCore) -> None: ...


class SyncTransport:
    """:class:`Transport` methods of an in-process transport: ``post`` is ``send``, nothing restarts."""

    def post(self, who: str, items: list[Submission], close: list[Close], block: bool = False) -> Any:
        return self.send(who, items, close)  # type: ignore[attr-defined]

    def collect(self, posted: Reply, block: bool = True) -> Reply:
        return posted

    def watch(self, client: ClientCore) -> None:
        """Nothing restarts in-process."""


_HASHED = re.compile(r"@.*:([0-9a-f]{16})$")  # an id new_identity made: it ends with its secret's hash
_PROCESS = re.compile(r"@(.*):[0-9a-f]{16}$")


def new_identity(label: str | None = None) -> tuple[str, str]:
    """``(client_id, secret)``: a unique id led by ``label`` (default ``"client"``), ending with a hash.

    >>> client_id, secret = new_identity("rank3")
    >>> client_id.startswith("rank3@"), identity(credential(client_id, secret, "job1")) == (client_id, "job1")
    (True, True)
    """
    secret = secrets.token_hex(16)
    return f"{label or 'client'}@{socket.gethostname()}:{os.getpid()}:{_digest(secret)}", secret


def process_of(client_id: str) -> str | None:
    """``"host:pid"`` of the process that made ``client_id`` with :func:`new_identity`, else None.

    >>> process_of("rank3@vm:42:0123456789abcdef"), process_of("rank3")
    ('vm:42', None)
    """
    found = _PROCESS.search(client_id)
    return found.group(1) if found else None


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


def credential(client_id: str, secret: str = "", session: str | None = None) -> str:
    """What a client hands its transport for itself: its id, secret and session (its run)."""
    return f"{client_id}#{secret}#{session or ''}"


def public_id(who: Any) -> str:
    """The client id a :func:`credential` claims (unchecked: what an error message may show)."""
    parts = str(who).rsplit("#", 2)
    return parts[0] if len(parts) == 3 else str(who)


@functools.lru_cache(maxsize=4096)
def identity(who: str) -> tuple[str, str | None]:
    """``(client_id, session)`` of a :func:`credential` (a bare id: ``(id, None)``); cached. Raises
    :class:`~rlmetrics.messages.SubmissionError` when the secret does not match the id.

    >>> identity("rank0")
    ('rank0', None)
    >>> identity("rank0@h:1:0123456789abcdef#wrong#")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rlmetrics.messages.SubmissionError: client id rank0@h:1:0123456789abcdef: its key does not match ...
    """
    if not isinstance(who, str):
        raise SubmissionError(f"a client id is a str, got {type(who).__name__}")
    parts = who.rsplit("#", 2)
    client_id, secret, session = parts if len(parts) == 3 else (who, "", "")
    hashed = _HASHED.search(client_id)
    if hashed is not None and _digest(secret) != hashed.group(1):
        raise SubmissionError(
            f"client id {client_id}: its key does not match (a message under another client's id is refused; "
            "an id ending in ':<16 hex>' belongs to the client that made it: give yours a label=, or a "
            "fixed client_id= of another form)"
        )
    return client_id, session or None


def rank_arg(nan_strategy: str, rank: Any) -> int | None:
    """``rank`` as an int (None: not given), once ``nan_strategy`` and ``rank`` are known good
    (ValueError naming the bad one): what ``connect`` checks before it makes an aggregator."""
    if nan_strategy not in NAN_STRATEGIES:
        raise ValueError(f"nan_strategy must be one of {NAN_STRATEGIES}, got {nan_strategy!r}")
    if rank is not None and (not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank < 0):
        raise ValueError(
            f"rank must be a non-negative int (this rank's place among the ranks), got {rank!r:.80}"
        )
    return None if rank is None else int(rank)


class ClientCore:
    """The client state machine shared by every backend (options: docs/backends.md):
    ``world_size``: contributions expected per name and step (:meth:`set_world_size` changes it);
    ``nan_strategy``: ``"propagate"``, ``"drop"`` or ``"error"`` for non-finite values; ``label``:
    leads the client id (default ``rank<N>`` with ``rank``); ``client_id``: a fixed id instead (it has
    no secret: anyone may send under it); ``blocking``: ``wait_submit()`` waits until the aggregator
    holds the step (``False``: an error about the data raises at the next call); ``naming``: a
    naming profile (:data:`rlmetrics.integrations.verl.NAMING`); ``rank``: orders its validation
    samples (else the number of a ``rankN`` label). Raises ValueError for a bad option."""

    max_restarts_per_call = 5

    def __init__(
        self,
        transport: Transport,
        *,
        world_size: int | None = None,
        nan_strategy: str = "propagate",
        label: str | None = None,
        client_id: str | None = None,
        blocking: bool = True,
        naming: Any = None,
        rank: int | None = None,
    ) -> None:
        self.rank = rank_arg(nan_strategy, rank)
        self.transport = transport
        self.world_size = None if world_size is None else world_size_arg(world_size)
        self.nan_strategy = nan_strategy
        self.naming = naming
        if label is None and self.rank is not None:
            label = f"rank{self.rank}"
        self.client_id, secret = (client_id, "") if client_id else new_identity(label)
        self.credential = credential(self.client_id, secret, getattr(transport, "session", None))
        self.blocking = blocking
        self.step = 0
        self._seq = 0
        self._buffer: list[Submission] = []
        self._kept: dict[int, list[Submission]] = {}  # sent, not yet finalized, by step
        # steps closed, not yet finalized: None closed by this client, else the clients closed on behalf of
        self._closed: dict[int, set[str] | None] = {}
        self._incarnation: str | None = None
        self._inflight: list[Any] = []  # posted sends whose replies are not handled yet
        self._schemas: dict = {}
        self._rules = rules_version()  # the reduction rules the cached schemas were resolved under
        self._nan_warned: set[str] = set()
        self._conflict_warned: set[str] = set()
        self._approximate_warned: set[str] = set()
        self._provisional_warned = False
        self._missed = -1  # newest step the aggregator ended without this client's close (notify_missed)
        self._notice: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # its ahead and behind
        self._told = -1  # the newest of those this client acted on and told
        self.stopped = False  # stop() left for good: no more submissions
        self.finalized_state: tuple[int, list[int]] = (0, [])  # as the aggregator last reported it
        self._lock = threading.RLock()  # a watcher thread may resend while the owner submits

    def submit_packed(self, packed: Packed, world_size: int, step: int, seq: Any = None) -> None:
        """Queue a summarized contribution (a node forwarding merged data; a fixed ``seq`` merges once)."""
        self._check_running()
        with self._lock:
            seq = self._next_seq() if seq is None else seq
            self._buffer.append(Submission(step, seq, world_size, packed))

    def close_step(self, step: int, on_behalf: Iterable[str] | None = None) -> None:
        """Send what is queued and close ``step``, or with ``on_behalf`` close it for those clients
        (a node for its ranks)."""
        if on_behalf is None:
            self._flush([step])
            return
        with self._lock:
            closers = self._closed.get(step) or set()  # a node closes steps only on behalf of its ranks
            closers.update(on_behalf)
            self._closed[step] = closers
            self._flush([OnBehalf(step, tuple(sorted(closers)))])

    def close_steps(self, steps: Iterable[int], block: bool = False) -> None:
        """Send what is queued and close ``steps`` (none: only send), in one message; ``block``:
        return once the aggregator holds it (an error about the data raises here)."""
        self._flush(sorted(steps), block)
        if block:
            self._collect(block=True)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def set_world_size(self, world_size: int) -> None:
        """Set the default ``world_size`` of later submissions.

        Args:
            world_size: the contributions expected per name and step, in [1, 2**32].

        Raises:
            ValueError: a ``world_size`` that is not such an int.

        Example:
        >>> import rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=4)
        >>> client.set_world_size(3)  # a rank is gone
        >>> client.world_size
        3
        """
        self.world_size = world_size_arg(world_size)

    def submit_metric(
        self,
        metrics: Mapping[str, Any],
        world_size: int | None = None,
        step: int | None = None,
        *,
        group_by: Mapping[str, Any] | None = None,
    ) -> None:
        """Summarize ``metrics`` and queue them for a step; nothing is sent before :meth:`wait_submit`.

        Args:
            metrics: name → value (docs/reductions.md, "The value policy").
            world_size: the contributions expected per name and step (None: the client's).
            step: the step (None: the client's current one, :attr:`step`; docs/steps.md).
            group_by: ``{tag: labels}``, one label per sample: each per-sample value is also submitted
                as ``group/<tag>/<label>/<name>`` (docs/groups.md).

        Raises:
            ValueError: no ``world_size`` here or on the client; a bad ``world_size`` or ``step``.
            TypeError: a ``group_by`` that is not a mapping.
            MetricValueError: ``metrics`` is not a mapping; or naming each refused value (or ``_aux/``
                name no derived metric uses), once the call's other names were queued.
            RuntimeError: the client was stopped (:meth:`stop`).

        Example:
        >>> import rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> client.submit_metric({"critic/score/max": [1.0, 3.0], "actor/loss": (2.0, 4)})
        >>> client.submit_metric({"acc": [1.0, 0.0, 1.0]}, group_by={"data_source": ["gsm", "math", "gsm"]})
        >>> client.submit_metric({"ok": 1.0, "bad": "x"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rlmetrics.core.values.MetricValueError: metric 'bad': expected a number, ... (1 metric(s) of this ...
        >>> client.wait_submit()
        >>> res = client.result(0)
        >>> res["critic/score/max"], res["actor/loss"], res["group/data_source/math/acc"], res["ok"]
        (3.0, 2.0, 0.0, 1.0)
        """
        ws = self.world_size if world_size is None else world_size_arg(world_size)
        if ws is None:
            raise ValueError("submit_metric needs world_size (or a client created with world_size=...)")
        if step is None:
            self._catch_up()
            step = self.step
        else:
            step = _step_arg(step)  # refused here, before anything is sent
        if not isinstance(metrics, Mapping):
            raise MetricValueError(
                f"metrics must be a mapping of name to value, got {type(metrics).__name__}"
            )
        if self._rules != rules_version():  # a reduction (un)registered: the names resolve anew
            self._schemas.clear()
            self._rules = rules_version()
        if group_by is None and self.naming is None and type(metrics) is dict:
            packed = pack_known(metrics, self.nan_strategy, self._schemas)  # the steady state
            if packed is not None:
                self.submit_packed(packed, ws, step)
                return
        errors: dict[str, str] = {}
        metrics = without_reserved(metrics, errors)
        plain, grouped = split_grouped(metrics)
        if group_by is not None:
            if not isinstance(group_by, Mapping):
                raise TypeError(f"group_by must map a tag to its labels, got {type(group_by).__name__}")
            labels = []
            for tag, tag_labels in group_by.items():
                try:
                    labels.append(Labels.of(tag, tag_labels))
                except ValueError as exc:  # that tag's groups only: the call's other names go on
                    errors[f"group tag {tag!r}"] = str(exc)
            grouped.update(grouped_values(metrics, labels, errors))
        kept = self._queue(plain, ws, step, errors)
        if grouped:
            kept += self._queue(grouped, 1, step, errors)
        if errors:
            raise MetricValueError(
                "; ".join(errors.values()) + f" ({kept} metric(s) of this call were submitted, for step "
                f"{step}; only what is named here was left out: fix it and submit that again)"
            )

    def _queue(self, metrics: Mapping[str, Any], ws: int, step: int, errors: dict[str, str]) -> int:
        """Pack and queue ``metrics`` (refused names' messages into ``errors``); how many were queued."""
        reductions = None
        if self.naming is not None:
            metrics, reductions = self.naming.prepare(metrics)
        if len(self._schemas) > _SCHEMA_CACHE:
            self._schemas.clear()
        packed = pack(metrics, self.nan_strategy, self._schemas, errors, reductions)
        if packed.schema.names:
            self.submit_packed(packed, ws, step)
        return len(packed.schema.names)

    # ------------------------------------------------------------------------------ sending
    def _flush(self, close: list[Close], block: bool = False) -> None:
        """Send what is queued and ``close``; ``block``: the caller waits for the reply at once."""
        with self._lock:
            items, self._buffer = self._buffer, []
            if not items and not close:
                return
            for item in items:
                self._kept.setdefault(item.step, []).append(item)
            for entry in close:
                if not isinstance(entry, tuple):
                    self._closed[entry] = None
            try:
                self._inflight.append(self.transport.post(self.credential, items, close, block))
            except AggregatorRestarted:
                self.resync()  # what was just sent is kept, so it goes with the resend
                return
            self._collect(block=False)  # the replies there are; the others at a later call

    def _collect(self, block: bool) -> None:
        """Handle the replies of posted sends (all of them when ``block``)."""
        with self._lock:
            while self._inflight:
                try:
                    reply = self.transport.collect(self._inflight[0], block)
                except AggregatorRestarted:
                    self._inflight.clear()  # everything in flight is kept: the resend carries it
                    self.resync()
                    return
                if reply is None:
                    return
                self._inflight.pop(0)
                self._handle(reply)

    def resync(self) -> None:
        """Resend everything kept (after an aggregator restart); safe to call at any time."""
        with self._lock:
            for _ in range(self.max_restarts_per_call):
                items = [item for step in sorted(self._kept) for item in self._kept[step]]
                close: list[Close] = [
                    s if v is None else OnBehalf(s, tuple(sorted(v))) for s, v in sorted(self._closed.items())
                ]
                try:
                    reply = self.transport.send(self.credential, items, close, resync=True)
                    if self.stopped:  # its data counts; its rank is not waited for again
                        self.transport.depart(self.credential)
                except AggregatorRestarted:
                    continue
                self._incarnation = reply.incarnation
                self._handle(reply)
                return
            raise ConnectionError(f"aggregator restarted {self.max_restarts_per_call} times during a resend")

    def resend(self, items: list[Submission]) -> None:
        """Send ``items`` now as resends (a node's, after its restart) and keep them as this client's."""
        with self._lock:
            for item in items:
                self._kept.setdefault(item.step, []).append(item)
            try:
                reply = self.transport.send(self.credential, items, [], resync=True)
            except AggregatorRestarted:
                self.resync()  # what was just kept goes with it
                return
            self._handle(reply)

    def _handle(self, reply: Reply) -> None:
        incarnation = reply.incarnation
        if self._incarnation is not None and incarnation != self._incarnation:
            self._incarnation = incarnation
            self.resync()
            return
        self._incarnation = incarnation
        self.finalized_state = (reply.done_below, reply.finalized)
        for step in [s for s in self._kept if reply.is_final(s)]:
            del self._kept[step]
        for step in [s for s in self._closed if reply.is_final(s)]:
            del self._closed[step]
        if reply.missed > self._missed:
            self.notify_missed(reply.missed)
        if reply.late:
            self._warn_late(reply.late, reply.missed)
            if self.step > reply.missed >= reply.late[0]:  # that warning told it: the counter is past
                self._told = max(self._told, reply.missed)
        if reply.errors:
            raise MetricValueError("; ".join(reply.errors.values()))

    def notify_missed(self, step: int, ahead: Iterable[str] = (), behind: Iterable[str] = ()) -> None:
        """Note that a read ended ``step`` without this client's close (``ahead`` had closed it), or
        that it closed ``step`` before ``behind``: its next call goes on at ``step + 1`` and warns once
        (docs/steps.md, "The step counter"). Any thread may call it."""
        if step > self._missed:
            self._notice = (tuple(ahead), tuple(behind))
            self._missed = step

    def _catch_up(self) -> None:
        """Move past the step :meth:`notify_missed` noted, dropping what is queued for it; warn once."""
        if self._missed <= self._told:
            return
        with self._lock:
            missed, (ahead, behind) = self._missed, self._notice
            self._told = missed
            skipped = list(range(self.step, missed + 1))
            dropped = [item for item in self._buffer if item.step <= missed]
            self._buffer = [item for item in self._buffer if item.step > missed]
            self.step = max(self.step, missed + 1)
        lost = f"; {len(dropped)} queued submission(s) for it were dropped" if dropped else ""
        me = f"rlmetrics: client {self.client_id}"
        if behind:
            text = (
                f"{me}: closed step {missed} before rank(s) {_names(behind)} did, one step more than they "
                f"({_TWICE}); they go on at step {missed + 1}, as it does. {_CLOSE_ONCE}"
            )
        elif not skipped:
            return
        else:
            why = (
                f"rank(s) {_names(ahead)} had closed step {missed}, one step more ({_TWICE})"
                if ahead
                else (f"the others had closed them: {_SKIPPED}")
            )
            text = (
                f"{me}: step(s) {_steps_text(skipped)} ended at wait_final_res() without this rank's close; "
                f"{why}{lost}. This rank goes on at step {self.step}, where the others are. "
                f"{_CLOSE_ONCE if ahead else _CLOSE_EVERY}"
            )
        warnings.warn(text, StepWarning, stacklevel=caller_level())

    def _warn_late(self, late: list[int], missed: int) -> None:
        if late[0] <= missed:  # the seed's read ended it after every rank's step: a close was skipped
            hint = f"wait_final_res() ended it without this rank's close: {_SKIPPED}. {_CLOSE_EVERY}"
        elif late[0] == 0:  # a new client starts at step 0
            hint = (
                "This rank was created after the others closed step 0: create the clients before the "
                "first step, or set client.step = N (or pass wait_submit(step=N)) to join at step N"
            )
        else:
            hint = (
                "A reader's deadline ended it first (result(step, timeout, finalize=True), or the "
                "aggregator's step_timeout): give it a longer timeout if this rank is that slow; if "
                f"{_SKIPPED[2:]}, pass the trainer's step: wait_submit(step=...)"
            )
        warnings.warn(
            f"rlmetrics: client {self.client_id}: its data for step(s) {_steps_text(late)} came after the "
            f"step was final and was dropped (counted in meta.late). {hint}",
            LateDataWarning,
            stacklevel=caller_level(),
        )

    def flush(self) -> None:
        """Send what is queued, without closing a step, and wait until the aggregator holds it all.

        Raises:
            MetricValueError: the aggregator refused part of what this client sent (the rest is merged).

        Example:
        >>> import rlmetrics, warnings
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> client.submit_metric({"loss": 2.0})
        >>> client.flush()
        >>> with warnings.catch_warnings(record=True):
        ...     res = client.result(0, timeout=0)  # held, provisional: step 0 is not closed
        >>> dict(res), res.meta.provisional, client.step
        ({'loss': 2.0}, True, 0)
        """
        self._flush([], block=True)
        self._collect(block=True)

    def _retrying(self, call: Callable[[], T]) -> T:
        for _ in range(self.max_restarts_per_call):
            try:
                return call()
            except AggregatorRestarted:
                self.resync()
        raise ConnectionError(f"aggregator restarted {self.max_restarts_per_call} times during one call")

    # ------------------------------------------------------------------------------ the API
    def wait_submit(self, step: int | None = None, block: bool | None = None) -> None:
        """Send everything queued in one message, close the current step (or ``step``), advance past it.

        Args:
            step: the step to close (None: the current one); the counter goes on at ``step + 1``
                (docs/steps.md, "The step counter"). Data queued for other steps travels, unclosed.
            block: return once the aggregator holds the message (None: the client's ``blocking``);
                ``False``: an error about the data raises at the client's next call.

        Raises:
            MetricValueError: blocking, the aggregator refused part of the message (the rest is merged).
            ValueError: a bad ``step``.
            RuntimeError: the client was stopped (:meth:`stop`).

        Example:
        >>> import rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> client.submit_metric({"loss": 2.0})
        >>> client.wait_submit()  # closes step 0
        >>> client.submit_metric({"loss": 3.0}, step=7)
        >>> client.wait_submit(step=7)  # the trainer's step
        >>> client.step, client.result(7)["loss"]
        (8, 3.0)
        """
        self._check_running()
        with self._lock:
            if step is None:
                self._catch_up()
            current = self.step if step is None else _step_arg(step)
            others = {item.step for item in self._buffer} - {current}
            if others and not any(item.step == current for item in self._buffer):
                if min(others) > current:
                    advice = "pass step= to wait_submit to close those"
                elif self.step in others:  # submit_metric without step= went to the client's counter
                    advice = (
                        f"submit_metric without step= uses this client's counter ({self.step}): pass the "
                        f"trainer's step to both, submit_metric(..., step={current}) and wait_submit(step="
                        f"{current})"
                    )
                else:
                    advice = ""
                if advice:
                    warnings.warn(
                        f"rlmetrics: wait_submit() closes step {current}, but the data queued since the last "
                        f"one is for step(s) {sorted(others)[:5]}, which stay open; {advice}",
                        StepWarning,
                        stacklevel=caller_level(),
                    )
            block = self.blocking if block is None else block
            try:
                self._flush([current], block)
            finally:  # the step is closed even when the aggregator refused some of its data
                self.step = current + 1
            if block:
                self._collect(block=True)

    def result(self, step: int, timeout: float | None = None, *, finalize: bool = False) -> StepResult:
        """The result of ``step`` once complete or final (docs/steps.md, "Reading a step").

        Args:
            step: the step to read.
            timeout: seconds to wait (None: no limit); then what arrived, provisional: the step stays open.
            finalize: at ``timeout``, make what arrived the step's final, partial result, with a
                :class:`~rlmetrics.messages.PartialStepWarning` (the reader that logs the run).

        Returns:
            A :class:`~rlmetrics.messages.StepResult`: ``{name: value}`` with ``step`` and ``meta``.

        Raises:
            TypeError: a ``step`` that is not an int.
            ValueError: a ``step`` outside ``[0, 2**53]``.
            MetricValueError: the aggregator refused part of what this client sent (the read sends first).

        Example:
        >>> import rlmetrics, warnings
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=2)
        >>> client.submit_metric({"loss": 1.0})
        >>> client.wait_submit()  # the other contribution never comes
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     res = client.result(0, timeout=0.1, finalize=True)
        >>> dict(res), res.meta.missing_metrics, [type(w.message).__name__ for w in caught]
        ({'loss': 1.0}, {'loss': [1, 2]}, ['PartialStepWarning'])
        """
        step = read_step(step)
        self.flush()
        read = lambda: self.transport.result(step, timeout, finalize, self.credential)  # noqa: E731
        return self._checked(self._retrying(read))

    def wait_final_res(self, timeout: float | None = None) -> StepResult:
        """The seed's read: the newest step every registered rank closed (docs/steps.md, "Reading a step").

        Args:
            timeout: seconds to wait for it to complete (None: the aggregator's ``final_timeout``, 60 s);
                then the step as it stands, with a :class:`~rlmetrics.messages.PartialStepWarning`.

        Returns:
            A :class:`~rlmetrics.messages.StepResult`; each step at most once per reader, in order; with
            no new step by ``timeout``, an empty one of step -1 (a StepWarning).

        Raises:
            MetricValueError: the aggregator refused part of what this client sent (the read sends first).

        Example:
        >>> import rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> for loss in (2.0, 3.0):
        ...     client.submit_metric({"loss": loss})
        ...     client.wait_submit()
        >>> res = client.wait_final_res()
        >>> res.step, dict(res)
        (1, {'loss': 3.0})
        """
        self.flush()
        return self._checked(self._retrying(lambda: self.transport.final(timeout, self.credential)))

    def _checked(self, res: StepResult) -> StepResult:
        """Warn about ``res`` (provisional: once per client; non-finite, approximate: once per name)."""
        meta = res.meta
        if meta.ranks_at and not res and not meta.contributors:
            if res.step >= 0 or not self._provisional_warned:  # nothing new for a reader: once
                self._provisional_warned = res.step < 0 or self._provisional_warned
                warnings.warn(f"rlmetrics: {_nothing_for(res)}", StepWarning, stacklevel=caller_level())
        elif meta.evicted:
            warnings.warn(
                f"rlmetrics: step {res.step} is no longer kept (more than keep_results newer results "
                "were finalized); its values are lost to this read",
                PartialStepWarning,
                stacklevel=caller_level(),
            )
        elif meta.provisional:
            if not self._provisional_warned:  # once: a dashboard reads provisional results all along
                self._provisional_warned = True
                warnings.warn(
                    f"rlmetrics: step {res.step} is provisional (the read's timeout passed; "
                    f"{_missing(res)}): it stays open; the reader that logs the run passes "
                    "result(step, timeout, finalize=True) to end a step at its deadline (warned once)",
                    ProvisionalWarning,
                    stacklevel=caller_level(),
                )
        elif not meta.complete:
            warnings.warn(
                f"rlmetrics: step {res.step} is partial: {_missing(res)}",
                PartialStepWarning,
                stacklevel=caller_level(),
            )
        conflicts = [n for n in meta.conflicts if n not in self._conflict_warned]
        if conflicts:
            self._conflict_warned.update(conflicts)
            warnings.warn(
                f"rlmetrics: step {res.step}: {meta.conflicts[conflicts[0]]} "
                f"({len(conflicts)} name(s) in meta.conflicts; warned once per name)",
                WorldSizeWarning,
                stacklevel=caller_level(),
            )
        approximate = [n for n in meta.approximate if n not in self._approximate_warned]
        if approximate:
            self._approximate_warned.update(approximate)
            warnings.warn(
                f"rlmetrics: step {res.step}: quantile(s) {approximate[:5]} are approximate (within 0.5%): "
                "more values in the step than the ranks' exact bound (1,000,000 per name and step unless "
                "RLMETRICS_EXACT_QUANTILES in every rank's environment sets it) or weighted values; "
                f"{len(approximate)} name(s) in meta.approximate (warned once per name)",
                ApproximateWarning,
                stacklevel=caller_level(),
            )
        if math.isfinite(sum(res.values())):  # else a value is not finite, or the sum overflowed
            return res
        bad = [n for n, v in res.items() if not math.isfinite(v) and n not in self._nan_warned]
        if bad:
            if len(self._nan_warned) > _SCHEMA_CACHE * 64:
                self._nan_warned.clear()
            self._nan_warned.update(bad)
            warnings.warn(
                f"rlmetrics: non-finite value in metric(s) {bad[:10]}",
                NonFiniteWarning,
                stacklevel=caller_level(),
            )
        return res

    def register(self) -> None:
        """Count this client as a rank from now on: no step completes before it closed it.

        Without it a client registers with its first submission; ``connect(..., world_size=W)`` calls it.

        Example:
        >>> import rlmetrics, warnings
        >>> worker = rlmetrics.LocalMetricWorker()
        >>> fast, slow = rlmetrics.MetricClient(worker, world_size=1), rlmetrics.MetricClient(worker)
        >>> slow.register()
        >>> fast.submit_metric({"loss": 2.0})
        >>> fast.wait_submit()
        >>> with warnings.catch_warnings(record=True):
        ...     res = fast.result(0, timeout=0.1)  # provisional: ``slow`` has not closed step 0
        >>> dict(res), res.meta.provisional
        ({'loss': 2.0}, True)
        """
        self._retrying(lambda: self.transport.register(self.credential))

    def stop(self) -> None:
        """Send what is queued and leave for good: no step waits for this client; its reads still work.

        Raises:
            MetricValueError: the aggregator refused part of what was sent (the client leaves all the same).

        Example:
        >>> import rlmetrics
        >>> client = rlmetrics.MetricClient(rlmetrics.LocalMetricWorker(), world_size=1)
        >>> client.stop()
        >>> client.submit_metric({"loss": 1.0})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: rlmetrics: client ... was stopped: stop() leaves for good and no step waits for it; ...
        """
        if self.stopped:
            return
        try:
            self.flush()  # may raise about refused data: the client leaves all the same
        finally:
            self._retrying(lambda: self.transport.depart(self.credential))
            self.stopped = True

    def _check_running(self) -> None:
        if self.stopped:
            raise RuntimeError(
                f"rlmetrics: client {self.client_id} was stopped: stop() leaves for good and no step waits "
                "for it; create a new client (rlmetrics.connect(...)) to submit again"
            )


def _missing(res: StepResult) -> str:
    """What a result misses, in words: the ranks that did not close its step, its incomplete metrics."""
    meta = res.meta
    ranks = meta.missing_ranks
    closing = f"registered ranks that have not closed it: {', '.join(map(rank_name, ranks[:5]))}" + (
        f" and {len(ranks) - 5} more" if len(ranks) > 5 else ""
    )
    closing += "".join(f" ({rank_name(c)} is gone: {why})" for c, why in list(meta.lost.items())[:3])
    if not meta.contributors and not res:
        if not ranks:
            return f"no data arrived for step {res.step}, and no rank is registered"
        return f"no data arrived for step {res.step}; {closing}"
    missing = meta.missing_metrics
    closing = closing if ranks else "every registered rank closed it"
    if not missing:
        return f"{closing}; every metric it holds has all its contributions"
    first = list(missing.items())[:5]
    shown = ", ".join(f"{name!r} ({got} of {want} contributions)" for name, (got, want) in first)
    text = f"{closing}; {len(missing)} incomplete metric(s): {shown}"
    if any(name in meta.conflicts for name in missing):
        text += " (ranks gave them different world_size: meta.conflicts)"
    return text


def _nothing_for(res: StepResult) -> str:
    """Why a read got nothing: where the ranks are (``meta.ranks_at``), and how to align.

    >>> from rlmetrics.messages import StepMeta
    >>> meta = StepMeta.of(provisional=True, ranks_at={"rank0@h:1:ab": 2, "rank1@h:1:cd": 2})
    >>> print(_nothing_for(StepResult({}, 3, meta)))  # doctest: +ELLIPSIS
    no rank has submitted anything for step 3 (ranks rank0, rank1 have closed up to step 2): ...
    """
    by_step: dict[int, list[str]] = {}
    for client, step in res.meta.ranks_at.items():
        by_step.setdefault(step, []).append(client.split("@")[0])
    where = "; ".join(
        f"rank{'s' if len(c) > 1 else ''} {', '.join(c[:8])}{' ...' if len(c) > 8 else ''} "
        f"{'have' if len(c) > 1 else 'has'} closed up to step {s}"
        for s, c in sorted(by_step.items())
    )
    if res.step < 0 and set(by_step) == {-1}:
        return (
            "wait_final_res: no rank has closed a step within the timeout (registered: "
            f"{_names(res.meta.ranks_at)}); a rank closes its step with wait_submit(), and this read "
            "returns it once every registered rank closed it (warned once)"
        )
    if res.step < 0:
        return (
            f"wait_final_res: no new step for this reader within the timeout ({where}); it returns each step "
            "once, in order: it returns the next step once every registered rank closed it (warned once)"
        )
    newest = max(res.meta.ranks_at.values())
    advice = (
        "a 1-based trainer step? pass the trainer's step to the ranks too: "
        "wait_submit(step=global_steps) / submit_metric(..., step=global_steps)"
        if newest < res.step
        else "the ranks went past it without data for it: read the step the ranks passed to wait_submit"
    )
    return (
        f"no rank has submitted anything for step {res.step} ({where}): nothing was finalized, data that "
        f"comes for it still counts; you read step {res.step}: {advice}"
    )


_SKIPPED = "a wait_submit() was skipped (after a caught exception?)"
_TWICE = "wait_submit() twice in one iteration?"
_CLOSE_EVERY = (
    "Close every step with wait_submit() (in a finally: block), or pass the trainer's step: "
    "wait_submit(step=...)"
)
_CLOSE_ONCE = "Close each step once, or pass the trainer's step: wait_submit(step=...)"


def _names(clients: Iterable[str]) -> str:
    names = [c.split("@", 1)[0] if "@" in c and not c.startswith("client@") else c for c in clients]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _steps_text(steps: list[int]) -> str:
    """Steps in a message: a list, or its bounds when long.

    >>> _steps_text([1, 2]), _steps_text(list(range(3, 40)))
    ('[1, 2]', '3..39 (37 steps)')
    """
    return str(steps) if len(steps) <= 5 else f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"


def read_step(step: Any) -> int:
    """The step a ``result(step)`` reads, as an int; TypeError when not an int (``wait_final_res()``
    reads the newest step without one), ValueError outside the steps a rank can submit.

    >>> read_step(-5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: result(step): step must be an int in [0, 9007199254740992] (the trainer's step, ...), got -5
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(
            f"result(step): step must be an int, got {step!r:.40}; wait_final_res() reads the newest step"
        )
    try:
        return _step_arg(step)
    except ValueError as e:
        raise ValueError(f"result(step): {e}") from None


def world_size_arg(world_size: Any) -> int:
    """``world_size`` as an int, or ValueError naming it.

    >>> world_size_arg(4)
    4
    >>> world_size_arg("4")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: world_size must be an int in [1, 4294967296] (the number of contributions ...), got '4'
    """
    if (
        not isinstance(world_size, numbers.Integral)
        or isinstance(world_size, bool)
        or not 1 <= int(world_size) <= MAX_WORLD_SIZE
    ):
        raise ValueError(
            f"world_size must be an int in [1, {MAX_WORLD_SIZE}] (the number of contributions expected per "
            f"metric name and step, e.g. the data-parallel size), got {world_size!r:.80}"
        )
    return int(world_size)


def _step_arg(step: Any) -> int:
    """``step`` as an int, or ValueError naming it.

    >>> _step_arg(2**63)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: step must be an int in [0, 9007199254740992] (the trainer's step, e.g. verl's ...
    """
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or not 0 <= int(step) <= MAX_STEP:
        raise ValueError(
            f"step must be an int in [0, {MAX_STEP}] (the trainer's step, e.g. verl's global_steps; "
            f"not a token or sample count), got {step!r:.80}"
        )
    return int(step)
