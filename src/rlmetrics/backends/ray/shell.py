"""What the aggregator actor and a node sub-aggregator share (a shell around a
:class:`~rlmetrics.engine.server.Server`: decoding, waking the calls that wait), and how they are made.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from typing import Any

from rlmetrics.backends.options import check_options
from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.compat import ray
from rlmetrics.backends.ray.store import KVStore
from rlmetrics.client import identity, process_of, public_id
from rlmetrics.engine.server import Notice, Server
from rlmetrics.messages import Message, Reply, SubmissionError
from rlmetrics.wire import SchemaTable, decode


class Shell:
    """An actor body around ``self.server``; ``secret`` signs the saved state, the rest goes to the Server."""

    store_class = KVStore

    def __init__(self, recovery_timeout: float = 30.0, secret: str | None = None, **options: Any) -> None:
        context = ray.get_runtime_context()
        self._namespace = context.namespace
        key = f"rlmetrics/state/{context.get_actor_id()}".encode()
        self.store = self.store_class(key, (secret or secrets.token_hex(32)).encode())
        self.server = Server(
            store=self.store, recovery_timeout=recovery_timeout, session_ended=compat.job_dead, **options
        )
        self.engine = self.server.engine
        self.table = SchemaTable()
        self.calls: Counter[str] = Counter()
        self._changed = asyncio.Event()
        self._told = 0  # notices pushed so far (:meth:`tell`)
        self._notices: list[tuple[int, Notice]] = []  # the newest, numbered
        self._acked: dict[str, int] = {}  # process -> the newest notice number its watcher has
        self._telling = asyncio.Event()  # set when notices are added

    @property
    def incarnation(self) -> str:
        return self.server.incarnation

    @property
    def restored(self) -> bool:
        """This incarnation resumed from the state an earlier one saved (it restarted)."""
        return self.server.restored

    def changed(self) -> None:
        """After every call: forget the schemas the engine forgot, wake the waiting calls."""
        for sid in self.engine.drain_forgotten():
            self.table.schemas.pop(sid, None)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, ready: Any, timeout: float | None) -> None:
        """Until ``ready()`` or the deadline; woken by every change and at the end of a recovery."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            recovery = self.server.recovery_deadline if self.server.recovering() else None
            limits = [t - now for t in (deadline, recovery) if t is not None]
            try:
                await asyncio.wait_for(self._changed.wait(), min(limits) if limits else None)
            except asyncio.TimeoutError:
                pass

    def _who(self, who: str) -> tuple[str, str | None] | str:
        """``(client_id, session)`` of a credential, or why it is refused."""
        try:
            return identity(who)
        except SubmissionError as exc:
            return str(exc)

    # ------------------------------------------------------------------------ client calls
    async def send(self, who: str, msg: tuple) -> Reply:
        """One client's message (:mod:`rlmetrics.wire`); ``who``: its credential."""
        self.calls["send"] += 1
        return (await self._handle([(who, msg)]))[0]

    async def send_many(self, batch: list[tuple[str, tuple]]) -> list[Reply]:
        """Messages of one process's clients, posted while its previous call was in flight, in order."""
        self.calls["send_many"] += 1
        return await self._handle(batch)

    async def _handle(self, batch: list[tuple[str, tuple]]) -> list[Reply]:
        """Decode, admit and handle each ``(credential, message)`` in order; the replies. A message with a
        schema this incarnation lacks holds back its client's later ones (a close must not overtake)."""
        self.calls["messages"] += len(batch)
        replies: list[Reply | None] = []
        admitted: list[tuple[int, Message]] = []  # (its reply's place, the message) not handled yet
        waiting: dict[str, list[bytes]] = {}  # credentials with a message to repeat: the schemas

        def handle() -> None:
            for (i, _), reply in zip(admitted, self.server.handle([m for _, m in admitted])):
                replies[i] = reply
            admitted.clear()

        for who, msg in batch:
            client = self._who(who)
            if isinstance(client, str):
                replies.append(self.server.reply({public_id(who)[:80]: client}))
                continue
            try:
                items, close, unknown = decode(msg, self.table)
            except SubmissionError as exc:
                replies.append(self.server.reply({client[0]: str(exc)}))
                continue
            if unknown or who in waiting:
                replies.append(Reply({}, self.incarnation, unknown=waiting.setdefault(who, unknown)))
                continue
            message = Message(client[0], items, close, msg[4], client[1])
            if self._waits(message):
                handle()
            ready = await self._admit(who, message)
            replies.append(self.server.reply({client[0]: ready}) if isinstance(ready, str) else None)
            if not isinstance(ready, str):
                admitted.append((len(replies) - 1, ready))
        handle()
        self.changed()
        return replies  # every place is filled

    def _waits(self, message: Message) -> bool:
        """Whether admitting ``message`` waits for another actor (a node's relay to the root)."""
        return False

    async def _admit(self, who: str, message: Message) -> Message | str:
        """The message the server is to handle, or why it is refused (a node relays ranks first)."""
        return message

    async def register(self, who: str) -> None:
        client = self._who(who)
        refused = client if isinstance(client, str) else self.server.register(*client)
        if refused:
            raise SubmissionError(refused)
        self.changed()

    async def depart(self, who: str) -> None:
        client = self._who(who)
        if isinstance(client, str):
            raise SubmissionError(client)
        self.server.depart(client[0])
        self.changed()

    async def runs_in(self, who: str, process: dict) -> None:
        """The client ``who`` (a credential) runs in ``process``, whose end the root watches for."""
        client = self._who(who)
        if isinstance(client, str):
            raise SubmissionError(client)
        if not (isinstance(process, dict) and all(isinstance(v, str) for v in process.values())):
            raise SubmissionError(f"a process is a dict of str ids, got {process!r:.80}")
        self.server.runs_in(client[0], process)
        self.changed()

    async def watch(self, process: str | None = None, seen: int = -1) -> tuple[int, list[tuple[str, int]]]:
        """A process's watcher: fails when this incarnation dies; returns ``(number, notices)`` once there
        are notices after ``seen`` for clients of ``process`` (``"host:pid"``; None: never)."""
        if process is None:
            await asyncio.Event().wait()
        self._acked[process] = max(seen, self._acked.get(process, -1))
        self.changed()  # a read may be waiting for this acknowledgement
        while True:
            news = [
                notice for n, notice in self._notices if n > seen and process_of(notice.client) == process
            ]
            if news:
                return self._told, news
            await self._telling.wait()

    async def tell(self) -> None:
        """Push the server's notices to their clients' watchers and wait (at most ``TELL_TIMEOUT`` s)
        until acknowledged: a rank that skipped a close knows before the driver's next step."""
        new, self.server.notices = self.server.notices, []
        if not new:
            return
        for notice in new:
            self._told += 1
            self._notices.append((self._told, notice))
        del self._notices[:-NOTICES]
        told = self._told
        processes = {process_of(notice.client) for notice in new} & set(self._acked)
        self._telling.set()
        self._telling = asyncio.Event()
        await self._wait(lambda: all(self._acked[p] >= told for p in processes), TELL_TIMEOUT)

    async def ping(self) -> str:
        return self.incarnation

    async def stats(self) -> dict:
        """Calls received by method and the server's ``stats()`` (for tests and monitoring)."""
        return {"calls": dict(self.calls), **self.server.stats()}


TELL_TIMEOUT = 5.0
"""Seconds a read waits for the watchers of the ranks it ended a step without (:meth:`Shell.tell`)."""
NOTICES = 1024
"""Notices an aggregator keeps for its watchers."""

ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_concurrency": 100_000}
"""Aggregator actors: no training slot, restarted whenever they die, every waiting reader served at once."""


class AggregatorClass:
    """``ray.remote(**ACTOR_OPTIONS)(cls)``, every new actor with a fresh ``secret`` among its arguments."""

    def __init__(self, cls: type) -> None:
        self.actor_class = ray.remote(**ACTOR_OPTIONS)(cls)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor_class.remote(*args, **_with_secret(kwargs))

    def options(self, **options: Any) -> Any:
        made = self.actor_class.options(**options)

        class _Options:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return made.remote(*args, **_with_secret(kwargs))

        return _Options


def _with_secret(kwargs: dict) -> dict:
    # else the actor's creation fails, and its callers see "metric worker is gone"
    check_options("MetricWorker.remote()", "ray", kwargs, ("aggregator",))
    return {"secret": secrets.token_hex(32), **kwargs}


_KEPT: dict[str, Any] = {}
"""The first handle this process got to each aggregator, by actor id, kept for the process's life:
only the creator's own handle keeps a non-detached actor alive (not one looked up by name later)."""


def keep(handle: Any) -> Any:
    _KEPT.setdefault(compat.actor_key(handle), handle)
    return handle
