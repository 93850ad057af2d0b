"""In-process backend: one :class:`~rlmetrics.aggregator.Aggregator` shared by threads.

>>> import threading, rlmetrics
>>> def rank(r):
...     client = rlmetrics.connect("local", world_size=2, name="doc")
...     client.submit_metric({"reward/mean": [float(r)] * (r + 1)})
...     client.wait_submit()
>>> threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
>>> for t in threads: t.start()
>>> for t in threads: t.join()
>>> reader = rlmetrics.connect("local", name="doc")
>>> round(reader.result(0, timeout=5)["reward/mean"], 6)  # (0*1 + 1*2) / 3 observations
0.666667
>>> rlmetrics.backends.local.drop_worker("doc")
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from typing import Any

from rlmetrics.aggregator import Aggregator, StepResult, pack
from rlmetrics.client import Submission, receive

_WORKERS: dict[str, LocalMetricWorker] = {}  # named in-process aggregators, like Ray's named actors
_WORKERS_LOCK = threading.Lock()


class LocalMetricWorker:
    """The seed's ``MetricWorker`` in-process and thread-safe; blocking methods instead of ``.remote``.

    Keyword options go to :class:`~rlmetrics.aggregator.Aggregator` (``renames``, ``keep_results``).
    """

    def __init__(self, **options: Any) -> None:
        self.engine = Aggregator(**options)
        self._cond = threading.Condition()
        self._direct = itertools.count()
        self.running = True

    # ----------------------------------------------------------------- the seed's worker API
    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def submit_metric(self, metrics: Mapping[str, Any], world_size: int, step: int | None = None) -> None:
        """A submission without a client: into ``step`` (default: the newest pending step, or 0)."""
        packed = pack(metrics)
        with self._cond:
            pending = self.engine.pending_steps()
            target = step if step is not None else (pending[-1] if pending else 0)
            self.engine.submit("direct", target, next(self._direct), world_size, packed, register=False)
            self._cond.notify_all()

    def wait_final_res(self) -> StepResult:
        with self._cond:
            return self.engine.finalize_pending()

    # ----------------------------------------------------------------- transport for clients
    def send(self, client_id: str, items: list[Submission], close: list[int], resync: bool = False) -> dict:
        with self._cond:
            reply = receive(self.engine, client_id, items, close)
            self._cond.notify_all()
        return reply

    def result(self, step: int, timeout: float | None = None) -> StepResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not (self.engine.is_finalized(step) or self.engine.is_complete(step)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return self.engine.finalize(step)

    def final(self) -> StepResult:
        return self.wait_final_res()

    def register(self, client_id: str) -> None:
        with self._cond:
            self.engine.register(client_id)

    def depart(self, client_id: str) -> None:
        with self._cond:
            self.engine.depart(client_id)
            self._cond.notify_all()


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
