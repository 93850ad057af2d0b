"""In-process backend: one :class:`~rlmetrics.engine.server.Server` shared by threads.

>>> import threading, rlmetrics
>>> def rank(r):
...     client = rlmetrics.connect("local", world_size=2, name="doc")
...     client.submit_metric({"reward/mean": [float(r)] * (r + 1)})
...     client.wait_submit()
>>> threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
>>> for t in threads: t.start()
>>> for t in threads: t.join()
>>> reader = rlmetrics.connect("local", name="doc")
>>> round(reader.wait_final_res()["reward/mean"], 6)  # (0*1 + 1*2) / 3 observations
0.666667
>>> rlmetrics.backends.local.drop_worker("doc")
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from rlmetrics.backends.options import check_options
from rlmetrics.client import ClientCore, SyncTransport, identity, read_step
from rlmetrics.engine.server import Server
from rlmetrics.messages import Close, Message, Reply, StepResult, Submission, SubmissionError

_WORKERS: dict[str, LocalMetricWorker] = {}  # named in-process aggregators, like Ray's named actors
_WORKERS_LOCK = threading.Lock()


class LocalMetricWorker(SyncTransport):
    """The seed's ``MetricWorker`` in-process and thread-safe; blocking methods instead of ``.remote``.
    Options: ``final_timeout``, ``step_timeout``, ``renames``, ``keep_results``, ``forget_after``,
    ``max_pending`` (:class:`~rlmetrics.engine.server.Server`)."""

    def __init__(self, **options: Any) -> None:
        check_options("LocalMetricWorker()", "local", options, ("aggregator",))
        self.server = Server(incarnation="local", **options)
        self.engine = self.server.engine
        self._cond = threading.Condition()
        self.running = True
        self._clients: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # by client id

    # ----------------------------------------------------------------- the seed's worker API
    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def submit_metric(self, metrics: Mapping[str, Any], world_size: int, step: int | None = None) -> None:
        """A submission without a client: into ``step`` (default: the current round, see
        :meth:`~rlmetrics.engine.server.Server.submit_direct`)."""
        with self._cond:
            self.server.submit_direct(metrics, world_size, step)
            self._cond.notify_all()

    def wait_final_res(self, timeout: float | None = None, who: str | None = None) -> StepResult:
        """The newest step every rank closed, once complete (at most ``timeout`` s, default
        ``final_timeout``; then partial), once per reader ``who``; without clients, this round's."""
        reader, session = _reader(who)
        with self._cond:
            read = self.server.read(None, reader, session)
            self._wait(read.ready, self._deadline(timeout))
            out = read.end()
            self._tell()
            self._cond.notify_all()
            return out

    # ----------------------------------------------------------------- transport for clients
    def send(self, who: str, items: list[Submission], close: list[Close], resync: bool = False) -> Reply:
        try:
            client_id, session = identity(who)
        except SubmissionError as exc:
            return Reply({str(who)[:80]: str(exc)}, self.server.incarnation)
        with self._cond:
            self._tick()  # first: data after its step's deadline is late, as on Ray
            [reply] = self.server.handle([Message(client_id, items, close, resync, session)])
            self._cond.notify_all()
        return reply

    def result(
        self, step: int, timeout: float | None = None, finalize: bool = False, who: str | None = None
    ) -> StepResult:
        """``step`` once complete; at ``timeout`` final when ``finalize``, else provisional
        (:meth:`~rlmetrics.engine.server.Server.read`); ``who``: the reader's credential."""
        reader, session = _reader(who)
        with self._cond:
            read = self.server.read(read_step(step), reader, session, finalize)
            self._wait(read.ready, timeout)
            out = read.end()
            self._cond.notify_all()  # finalized at this reader's deadline: other readers of it return
            return out

    def final(self, timeout: float | None = None, who: str | None = None) -> StepResult:
        return self.wait_final_res(timeout, who)

    def watch(self, client: ClientCore) -> None:
        """Tell ``client`` of the steps a read ends without its close, before the read returns."""
        self._clients[client.client_id] = client

    def _tell(self) -> None:
        """Hand the server's notices to the clients they are about (with the lock held)."""
        for notice in self.server.notices:
            client = self._clients.get(notice.client)
            if client is not None:
                client.notify_missed(*notice[1:])
        self.server.notices.clear()

    def register(self, who: str) -> None:
        with self._cond:
            self.server.register(*identity(who))

    def depart(self, who: str) -> None:
        with self._cond:
            self.server.depart(identity(who)[0])
            self._cond.notify_all()

    def _deadline(self, timeout: float | None) -> float:
        return self.server.final_timeout if timeout is None else timeout

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> None:
        """Until ``ready()`` (lock held) or ``timeout`` s (None: no limit), finalizing steps that come due."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            due = self._tick()
            now = time.monotonic()
            if ready() or (deadline is not None and deadline <= now):
                return
            ends = [t for t in (deadline, due) if t is not None]
            self._cond.wait(max(min(ends) - now, 0.0) if ends else None)

    def _tick(self) -> float | None:
        """Finalize the steps whose own deadline passed (with the lock held); when the next passes."""
        finalized, due = self.server.tick()
        if finalized:
            self._cond.notify_all()
        return due


def _reader(who: str | None) -> tuple[str, str | None]:
    """``(reader, session)`` of a reader's credential (None: the seed's bare read, ``""``)."""
    return ("", None) if who is None else identity(who)


def get_worker(name: str = "default", **options: Any) -> LocalMetricWorker:
    """Get or create the named in-process worker (options apply on creation)."""
    with _WORKERS_LOCK:
        worker = _WORKERS.get(name)
        if worker is None:
            worker = _WORKERS[name] = LocalMetricWorker(**options)
        return worker


def drop_worker(name: str = "default") -> None:
    """Forget the named worker (the next ``get_worker`` makes a fresh one)."""
    with _WORKERS_LOCK:
        _WORKERS.pop(name, None)
