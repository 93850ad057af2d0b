"""A client's link to an aggregator actor, the per-process sender (one call at a time) and the
watcher that resends what the clients keep when the actor restarts."""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.compat import ray
from rlmetrics.client import AggregatorRestarted
from rlmetrics.messages import Reply, StepResult, Submission
from rlmetrics.wire import encode

_KNOWN_LIMIT = 512  # schema ids a transport remembers the actor has


class RayTransport:
    """A client's link to a ``MetricWorker`` actor ``handle`` (``root``: where results come from, if not
    it). ``session``: the run its clients belong to, by default this process's Ray job (None: no run)."""

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

    def _encode(self, items: list[Submission], close: list[int], resync: bool = False) -> tuple:
        msg = encode(items, close, lambda sid: sid not in self._known, resync)
        if len(self._known) > _KNOWN_LIMIT:  # names that change over a run: send names again
            self._known.clear()
        self._known.update(item[3].schema.id for item in items)
        return msg

    def _track(self, reply: Reply, who: str, items: list[Submission], close: list, resync: bool) -> Reply:
        if not reply.merged:
            reply = self.repeat(who, items, close, resync)
        if reply.incarnation != self._incarnation:
            self._known = {item[3].schema.id for item in items}
            self._incarnation = reply.incarnation
        return reply

    def repeat(self, who: str, items: list[Submission], close: list, resync: bool) -> Reply:
        """Send a message again on its own, with every schema's names (the actor lost some)."""
        return self._call("send", who, encode(items, close, True, resync))

    def send(self, who: str, items: list[Submission], close: list, resync: bool = False) -> Reply:
        reply = self._call("send", who, self._encode(items, close, resync))
        return self._track(reply, who, items, close, resync)

    def post(self, who: str, items: list[Submission], close: list, block: bool = False) -> tuple:
        """Send without waiting; :meth:`collect` gives the reply (or raises AggregatorRestarted).
        ``block``: the caller collects at once (the send may then happen in its thread)."""
        return (self._sender.post(self, who, items, close, block), who, items, close)

    def collect(self, posted: tuple, block: bool = True) -> Reply | None:
        future, who, items, close = posted
        if not block and not future.done():
            return None
        return self._track(future.result(), who, items, close, False)

    def result(
        self, step: int, timeout: float | None, finalize: bool = False, who: str | None = None
    ) -> StepResult:
        return self._call("result", step, timeout, finalize, who, actor=self.root)

    def final(self, timeout: float | None = None, who: str | None = None) -> StepResult:
        return self._call("final", timeout, who, actor=self.root)

    def register(self, who: str) -> None:
        self._call("register", who)

    def depart(self, who: str) -> None:
        self._call("depart", who)

    def watch(self, client: Any) -> None:
        """Resend ``client``'s kept submissions when the actor restarts; tell the root where it runs."""
        _Watcher.of(self).clients.add(client)
        process = compat.process()
        if process is not None:  # no reply awaited: an error would come from a later call anyway
            compat.remote(self.root.runs_in, client.credential, process)


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
    """Group commit: one ``send_many`` call at a time carries every message this process's clients of
    one actor posted meanwhile (an async actor may interleave concurrent calls, and a close must not
    overtake its data); a lone client that waits sends from its own thread (docs/backends.md, "Ray")."""

    _by_actor: dict[str, _Sender] = {}
    _lock = threading.Lock()

    def __init__(self, transport: RayTransport) -> None:
        self.handle = transport.handle
        self.reconnect_timeout = transport.reconnect_timeout
        self._queue: list[tuple[RayTransport, str, list[Submission], list[int], Future]] = []
        self._cond = threading.Condition()
        self._busy = False  # a call is in flight
        self.transports: weakref.WeakSet = weakref.WeakSet()  # this process's clients of the actor
        threading.Thread(target=self._run, name="rlmetrics-send", daemon=True).start()

    @classmethod
    def of(cls, transport: RayTransport) -> _Sender:
        sender = _per_actor(cls, transport)
        sender.transports.add(transport)
        return sender

    def post(
        self, transport: RayTransport, client_id: str, items: list[Submission], close: list[int], block: bool
    ) -> Future:
        entry = (transport, client_id, items, close, Future())
        with self._cond:
            alone = block and len(self.transports) == 1 and not self._busy and not self._queue
            if alone:
                self._busy = True
            else:
                self._queue.append(entry)
                self._cond.notify()
        if alone:
            try:
                self._send([entry], threaded=False)
            except BaseException as exc:  # an interrupt in the caller's thread: the sender goes on
                if not entry[4].done():
                    self._done([entry], error=ConnectionError(f"send interrupted: {exc!r}"))
                raise
        return entry[4]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._busy:
                    self._cond.wait()
                batch, self._queue = self._queue, []
                self._busy = True
            if not self._send(batch):
                return

    def _send(self, batch: list[tuple], threaded: bool = True) -> bool:
        """One ``send_many`` call with ``batch``, replies or errors into its futures; False when Ray is
        shut down. ``threaded=False`` (the caller's thread): a ``SystemExit`` is the caller's, raised."""
        stop: tuple[type[BaseException], ...] = (Exception, SystemExit) if threaded else (Exception,)
        try:
            messages = [(who, transport._encode(items, close)) for transport, who, items, close, _ in batch]
            replies = compat.get(compat.remote(self.handle.send_many, messages))
        except compat.UNAVAILABLE:
            try:
                _wait_alive(self.handle, self.reconnect_timeout)
                error: BaseException = AggregatorRestarted("aggregator restarted during a send")
            except ConnectionError as exc:
                error = exc
            return self._done(batch, error=error)
        except stop as exc:  # Ray shut down
            self._done(batch, error=ConnectionError(f"send failed: {exc}"))
            return ray.is_initialized()
        return self._done(batch, replies)

    def _done(
        self, batch: list[tuple], replies: list[Reply] | None = None, error: BaseException | None = None
    ) -> bool:
        """The futures of ``batch``: its ``replies`` (repeating first what the actor asks) or ``error``."""
        outcomes: list[Reply | BaseException] = []
        for i, (transport, client_id, items, close, _) in enumerate(batch):
            outcome: Reply | BaseException = error if error is not None else replies[i]
            if isinstance(outcome, Reply) and not outcome.merged:
                try:
                    outcome = transport.repeat(client_id, items, close, False)
                except (Exception, SystemExit) as exc:  # AggregatorRestarted: the client resends
                    outcome = exc
            outcomes.append(outcome)
        with self._cond:  # the next call may go (a client woken below may make it)
            self._busy = False
            self._cond.notify()
        for (*_, future), outcome in zip(batch, outcomes):
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        return True


class _Watcher:
    """One outstanding ``watch`` call per process and actor (no thread waits on it): when it fails
    (the actor died) every client resends what it keeps; when it returns, the clients it names are
    told of the steps ended without their close (:meth:`~rlmetrics.client.ClientCore.notify_missed`)."""

    _by_actor: dict[str, _Watcher] = {}
    _lock = threading.Lock()

    def __init__(self, transport: RayTransport) -> None:
        self.handle = transport.handle
        self.reconnect_timeout = transport.reconnect_timeout
        self.clients: weakref.WeakSet = weakref.WeakSet()
        self.process = f"{socket.gethostname()}:{os.getpid()}"  # as in the ids of its clients
        self.seen = -1  # the newest notice number received
        self._arm()

    @classmethod
    def of(cls, transport: RayTransport) -> _Watcher:
        return _per_actor(cls, transport)

    def _arm(self) -> None:
        try:
            compat.remote(self.handle.watch, self.process, self.seen).future().add_done_callback(self._fired)
        except ConnectionError:  # Ray is shut down: nothing to watch
            pass

    def _fired(self, future: Future) -> None:
        error = future.exception()
        if error is None:
            threading.Thread(
                target=self._tell, args=future.result(), name="rlmetrics-watch", daemon=True
            ).start()
        elif isinstance(error, compat.UNAVAILABLE) and ray.is_initialized():
            threading.Thread(target=self._recover, name="rlmetrics-watch", daemon=True).start()

    def _tell(self, seen: int, notices: list[tuple]) -> None:
        for client in list(self.clients):
            for notice in notices:
                if client.client_id == notice[0]:
                    client.notify_missed(*notice[1:])
        self.seen = seen
        self._arm()  # acknowledges them

    def _recover(self) -> None:
        try:
            _wait_alive(self.handle, self.reconnect_timeout)
        except ConnectionError:
            return
        self.seen = -1  # a new incarnation numbers its notices afresh
        self._arm()
        for client in list(self.clients):
            try:
                client.resync()
            except Exception:  # noqa: BLE001 - the client's own next call reports the problem
                pass
