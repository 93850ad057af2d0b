"""A client's link to an aggregator actor: sends, the per-process sender that batches the posts of
every client of an actor (pre-merging their scalar submissions), and the watcher that resends what
the clients keep when the actor restarts."""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import numpy as np

from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.compat import ray
from rlmetrics.client import AggregatorRestarted, public_id
from rlmetrics.messages import Reply, StepResult
from rlmetrics.packing import Packed
from rlmetrics.server import Submission
from rlmetrics.stat import stats_of_rows
from rlmetrics.wire import encode

_KNOWN_LIMIT = 512  # schema ids a transport remembers the actor has


class RayTransport:
    """A client's link to a ``MetricWorker`` actor handle.

    ``post`` is the non-blocking send: every client of the same actor in this process shares one
    :class:`_Sender`, so messages posted while a call is in flight travel together in the next one.
    ``session``: the run its clients belong to, by default this process's Ray job (the driver's,
    for the actors it created): a restarted run is a new job, and the aggregator drops what the
    ended one left open (:class:`~rlmetrics.server.Server`); None for a client of no run.
    """

    def __init__(
        self, handle: Any, reconnect_timeout: float = 120.0, root: Any = None, session: Any = "job"
    ) -> None:
        self.handle = handle  # where sends go: the root, or this node's sub-aggregator
        self.root = root if root is not None else handle  # where results come from
        self.reconnect_timeout = reconnect_timeout
        self.session = ray.get_runtime_context().get_job_id() if session == "job" else session
        self._known: set[bytes] = set()  # schema ids the current incarnation has
        self._incarnation: str | None = None
        self._sender = _Sender.of(self)

    def _call(self, method: str, *args: Any, actor: Any = None) -> Any:
        actor = self.handle if actor is None else actor
        try:
            return compat.get(compat.remote(getattr(actor, method), *args))
        except compat.UNAVAILABLE as exc:
            _wait_alive(actor, self.reconnect_timeout)
            raise AggregatorRestarted(f"aggregator restarted during {method}") from exc

    def wait_alive(self) -> str:
        """Block until the actor answers (its next incarnation); ConnectionError after the timeout."""
        return _wait_alive(self.handle, self.reconnect_timeout)

    def knows(self, packed: Packed) -> bool:
        """The actor has the names of ``packed``'s schema (as far as this client knows)."""
        return packed.schema.id in self._known

    def _encode(self, items: list[Submission], close: list[int], resync: bool = False) -> tuple:
        msg = encode(items, close, lambda sid: sid not in self._known, resync)
        if len(self._known) > _KNOWN_LIMIT:  # names that change over a run: send names again
            self._known.clear()
        self._known.update(item[3].schema.id for item in items)
        return msg

    def _track(self, reply: Reply, who: str, items: list[Submission], close: list, resync: bool) -> Reply:
        if reply.unknown is not None:
            reply = self.repeat(who, items, close, resync)
        if reply.incarnation != self._incarnation:
            self._known = {item[3].schema.id for item in items}
            self._incarnation = reply.incarnation
        return reply

    def repeat(self, who: str, items: list[Submission], close: list, resync: bool) -> Reply:
        """Send a message again on its own, with every schema's names: the answer to an "unknown"
        reply (the actor lost some schemas, or could not merge a pre-merged item)."""
        return self._call("send", who, encode(items, close, True, resync))

    def send(self, who: str, items: list[Submission], close: list, resync: bool = False) -> Reply:
        reply = self._call("send", who, self._encode(items, close, resync))
        return self._track(reply, who, items, close, resync)

    def post(self, who: str, items: list[Submission], close: list) -> tuple:
        """Send without waiting; :meth:`collect` gives the reply (or raises AggregatorRestarted)."""
        return (self._sender.post(self, who, items, close), who, items, close)

    def collect(self, posted: tuple, block: bool = True) -> Reply | None:
        future, who, items, close = posted
        if not block and not future.done():
            return None
        return self._track(self._sender.wait(future), who, items, close, False)

    def result(self, step: int, timeout: float | None, finalize: bool = False) -> StepResult:
        return self._call("result", step, timeout, finalize, actor=self.root)

    def final(self, timeout: float | None = None) -> StepResult:
        return self._call("final", timeout, actor=self.root)

    def register(self, who: str) -> None:
        self._call("register", who)

    def depart(self, who: str) -> None:
        self._sender.forget(who)
        self._call("depart", who)

    def watch(self, client: Any) -> None:
        """Resend ``client``'s kept submissions whenever the actor restarts (one thread per actor)."""
        _Watcher.of(self).clients.add(client)


def _wait_alive(handle: Any, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return compat.get(compat.remote(handle.ping), timeout=10)
        except (*compat.UNAVAILABLE, ray.exceptions.GetTimeoutError):
            if compat.actor_dead(handle):  # no incarnation will come: fail now, not at the timeout
                raise ConnectionError("metric worker is gone: Ray records it dead for good") from None
            if time.monotonic() > deadline:
                raise ConnectionError(f"metric worker unreachable for {timeout} s") from None
            time.sleep(0.1)
        except Exception as exc:  # Ray refuses to even submit: the actor is gone for good
            raise ConnectionError(f"metric worker is gone: {exc}") from exc


def _per_actor(cls: Any, transport: RayTransport) -> Any:
    """The one ``cls`` instance of this process for the transport's actor."""
    key = compat.actor_key(transport.handle)
    with cls._lock:
        if key not in cls._by_actor:
            cls._by_actor[key] = cls(transport)
        return cls._by_actor[key]


class _Sender:
    """Group commit: a ``send_many`` call carries every message posted while the previous call was
    in flight, and the steady scalar submissions of several clients for one step and schema travel
    pre-merged (:func:`_premerge`), so the aggregator's work per step follows processes, not ranks.

    A process that hosts several ranks sends each step in one call, not in a first call with the
    quickest rank and more behind it (a call costs both sides far more than a rank's message in
    it): a message that closes step ``s`` waits, at most ``linger`` seconds, for this process's
    other clients that closed ``s - 1`` — unless every thread that posted those closes is waiting
    for a reply of a message still queued (ranks taking turns in one thread, or fewer threads than
    ranks: no more messages will come) and none came for ``quiet`` seconds, or none came for
    ``silence`` seconds. A process with one client never waits.
    """

    _by_actor: dict[str, _Sender] = {}
    _lock = threading.Lock()
    linger = 0.05  # the longest a message waits for the process's other clients of its step
    quiet = 0.001  # no message for this long, every poster waiting: no more will come
    silence = 0.01  # no message for this long: none is coming soon

    def __init__(self, transport: RayTransport) -> None:
        self.handle = transport.handle
        self.reconnect_timeout = transport.reconnect_timeout
        self._queue: list[tuple[RayTransport, str, list[Submission], list[int], Future]] = []
        self._cond = threading.Condition()
        self._closed: dict[str, int] = {}  # the newest step each client closed in a message sent
        self._posters: dict[int, set[int]] = {}  # threads that posted the closes of a recent step
        self._poster: dict[Future, int] = {}  # the thread that posted each queued message
        self._waiting: set[int] = set()  # threads waiting for the reply of a queued message
        threading.Thread(target=self._run, name="rlmetrics-send", daemon=True).start()

    @classmethod
    def of(cls, transport: RayTransport) -> _Sender:
        return _per_actor(cls, transport)

    def post(
        self, transport: RayTransport, client_id: str, items: list[Submission], close: list[int]
    ) -> Future:
        future: Future = Future()
        with self._cond:
            self._queue.append((transport, client_id, items, close, future))
            self._poster[future] = threading.get_ident()
            self._cond.notify()
        return future

    def wait(self, future: Future) -> Any:
        """``future.result()``; while its message is queued the sender knows this thread waits."""
        if not future.done():
            with self._cond:
                if future in self._poster:
                    self._waiting.add(threading.get_ident())
                    self._cond.notify()
        return future.result()

    def forget(self, client_id: str) -> None:
        """``client_id`` left: no message waits for it."""
        with self._cond:
            self._closed.pop(client_id, None)

    def _take(self) -> list[tuple]:
        """The next batch (called holding ``_cond``)."""
        while not self._queue:
            self._cond.wait()
        closes = [step for *_, close, _ in self._queue for step in _own_closes(close)]
        if closes and len(self._closed) > 1:
            self._linger(max(closes))
        batch, self._queue = self._queue, []
        for _, client_id, _, close, future in batch:
            own = _own_closes(close)
            if own:
                self._closed[client_id] = max(self._closed.get(client_id, -1), *own)
                self._posters.setdefault(max(own), set()).add(self._poster.get(future))
        self._poster.clear()
        self._waiting.clear()
        newest = max(self._closed.values(), default=0)
        for client_id in [c for c, step in self._closed.items() if step < newest - 1]:
            del self._closed[client_id]  # out of step: awaited by no one (and the dict stays small)
        for step in [s for s in self._posters if s < newest - 1]:
            del self._posters[step]
        return batch

    def _linger(self, step: int) -> None:
        """Wait until the clients that closed ``step - 1`` posted, every thread that posted those
        closes waits for a queued reply (and no message came for ``quiet`` seconds: a pool's idle
        thread may still be picking up a rank's work), no message came for ``silence`` seconds, or
        ``linger`` passed (see the class docstring)."""
        awaited = {c for c, s in self._closed.items() if s == step - 1}
        threads = len(self._posters.get(step - 1, ()))
        now = last = time.monotonic()
        deadline = now + self.linger
        seen = 0
        while True:
            if len(self._queue) > seen:
                awaited.difference_update(entry[1] for entry in self._queue[seen:])
                seen, last = len(self._queue), now
            quiet = now - last
            if (
                not awaited
                or (len(self._waiting) >= threads and quiet >= self.quiet)
                or quiet >= self.silence
                or now >= deadline
            ):
                return
            wake = deadline if len(self._waiting) < threads else min(deadline, last + self.quiet)
            self._cond.wait(max(0.0, min(wake, last + self.silence) - now))
            now = time.monotonic()

    def _run(self) -> None:
        while True:
            with self._cond:
                batch = self._take()
            try:
                replies = compat.get(compat.remote(self.handle.send_many, *_premerge(batch)))
            except compat.UNAVAILABLE:
                try:
                    _wait_alive(self.handle, self.reconnect_timeout)
                    error: BaseException = AggregatorRestarted("aggregator restarted during a send")
                except ConnectionError as exc:
                    error = exc
                for *_, future in batch:
                    future.set_exception(error)
                continue
            except (Exception, SystemExit) as exc:  # Ray shut down
                for *_, future in batch:
                    future.set_exception(ConnectionError(f"send failed: {exc}"))
                if not ray.is_initialized():
                    return
                continue
            for (transport, client_id, items, close, future), reply in zip(batch, replies):
                if reply.unknown is not None:  # repeat now, not at the client's next call: a reader waits
                    try:
                        reply = transport.repeat(client_id, items, close, False)
                    except (Exception, SystemExit) as exc:  # AggregatorRestarted: the client resends
                        future.set_exception(exc)
                        continue
                future.set_result(reply)


def _own_closes(close: list) -> list[int]:
    """The steps a message closes for its own client (not those closed on behalf of others)."""
    return [step for step in close if not isinstance(step, tuple)]


def _premerge(batch: list[tuple]) -> tuple[list[tuple[str, tuple]], tuple | None]:
    """The clients' messages of a batch, and one message with the items merged across clients:
    1-D submissions (one value per metric) of one step, world size and known schema become one
    ``(5, M)`` stat array keyed by every ``(client_id, seq)`` (:meth:`Aggregator.submit_merged`)."""
    own: list[list[Submission]] = []
    groups: dict[tuple, list[tuple[str, Submission, list]]] = {}
    for transport, client_id, items, _close, _future in batch:
        mine: list[Submission] = []
        for item in items:
            step, _seq, world_size, packed = item
            if packed.stats.ndim == 1 and not packed.states and transport.knows(packed):
                groups.setdefault((step, world_size, packed.schema.id), []).append((client_id, item, mine))
            else:
                mine.append(item)
        own.append(mine)
    merged = []
    for (step, world_size, _), members in groups.items():
        if len(members) == 1:
            _, item, mine = members[0]
            mine.append(item)
            continue
        packs = [item[3] for _, item, _ in members]
        stats = stats_of_rows(np.stack([p.stats for p in packs]))
        keys = tuple((public_id(who), item[1]) for who, item, _ in members)
        contributions = sum(p.contributions for p in packs)
        merged.append((step, keys, world_size, Packed(packs[0].schema, stats, contributions=contributions)))
    messages = [(b[1], b[0]._encode(mine, b[3])) for b, mine in zip(batch, own)]
    return messages, (encode(merged, [], False) if merged else None)


class _Watcher:
    """One outstanding ``watch`` call per process and actor; when it fails (the actor died), every
    client of this process resends what it keeps to the next incarnation.

    No thread waits on the call: Ray resolves it, and only then a short-lived thread does the work.
    """

    _by_actor: dict[str, _Watcher] = {}
    _lock = threading.Lock()

    def __init__(self, transport: RayTransport) -> None:
        self.handle = transport.handle
        self.reconnect_timeout = transport.reconnect_timeout
        self.clients: weakref.WeakSet = weakref.WeakSet()
        self._arm()

    @classmethod
    def of(cls, transport: RayTransport) -> _Watcher:
        return _per_actor(cls, transport)

    def _arm(self) -> None:
        try:
            compat.remote(self.handle.watch).future().add_done_callback(self._fired)
        except ConnectionError:  # Ray is shut down: nothing to watch
            pass

    def _fired(self, future: Future) -> None:
        if isinstance(future.exception(), compat.UNAVAILABLE) and ray.is_initialized():
            threading.Thread(target=self._recover, name="rlmetrics-watch", daemon=True).start()

    def _recover(self) -> None:
        try:
            _wait_alive(self.handle, self.reconnect_timeout)
        except ConnectionError:
            return
        self._arm()
        for client in list(self.clients):
            try:
                client.resync()
            except Exception:  # noqa: BLE001 - the client's own next call reports the problem
                pass
