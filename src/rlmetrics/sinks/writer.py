"""A tracker's bounded queue and the thread that writes it, so a tracker never holds a training step.

>>> calls = []
>>> writer = Writer("printer", lambda steps: [])
>>> writer.put("train_step", 0, lambda: calls.append(0))
>>> writer.finish()
>>> writer.join(timeout=10), calls
([], [0])
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

Call = Callable[[], object]


@dataclass(frozen=True)
class Task:
    axis: str
    step: int
    call: Call


class Writer:
    """The queue of one tracker and its thread; ``refill(steps)``: their tasks, read back from the journal."""

    def __init__(
        self,
        name: str,
        refill: Callable[[list[tuple[str, int]]], list[Task]],
        *,
        transient: Callable[[Exception], bool] = lambda exc: True,
        fatal: Callable[[BaseException, Task], object] = lambda exc, task: None,
        bound: int = 1000,
        retry: float = 1.0,
        most: float = 60.0,
        journal: bool = True,
    ) -> None:
        self.name, self.refill, self.transient, self.fatal = name, refill, transient, fatal
        self.journal = journal  # refill reads the steps behind back (else they are dropped)
        self.bound, self.retry, self.most = bound, retry, most
        self._tasks: deque[Task] = deque()
        self._behind: list[tuple[str, int]] = []  # steps not queued (a full queue), in order
        self._reading = 0  # the first steps of _behind, being read back from the journal
        self._wake = threading.Condition()
        self._closing = self._abandoned = False
        self._down: float | None = None  # when the tracker started failing
        self._thread = threading.Thread(target=self._run, name=f"rlmetrics-{name}", daemon=True)
        self._thread.start()

    def put(self, axis: str, step: int, call: Call) -> None:
        """Queue ``call`` (a step of ``axis``); never waits."""
        with self._wake:
            if not self._behind and len(self._tasks) < self.bound:
                self._tasks.append(Task(axis, step, call))
                self._wake.notify()
                return
            if not self._behind:
                later = (
                    "from the journal once it caught up" if self.journal else "never (no journal: dropped)"
                )
                logger.warning(
                    "tracker %s is %d steps behind: it gets step %d and later %s (training goes on)",
                    self.name, len(self._tasks), step, later,
                )  # fmt: skip
            if len(self._behind) == self._reading or self._behind[-1] != (axis, step):
                self._behind.append((axis, step))  # a step logged in several calls is read back once

    def pending(self) -> list[tuple[str, int]]:
        """The steps not delivered yet (queued or behind), in order."""
        with self._wake:
            steps = [(t.axis, t.step) for t in self._tasks] + self._behind
        return list(dict.fromkeys(steps))

    def finish(self) -> None:
        """Take no more steps: the thread ends once it delivered those it has."""
        with self._wake:
            self._closing = True
            self._wake.notify()

    @property
    def down(self) -> bool:
        """The tracker's last call failed (it is being retried)."""
        return self._down is not None

    def join(self, timeout: float) -> list[tuple[str, int]]:
        """Wait ``timeout`` s at most for the thread to end; the steps left (it stops at its next retry)."""
        self._thread.join(max(timeout, 0.0))
        if not self._thread.is_alive():
            return []
        with self._wake:
            self._abandoned = True
            self._wake.notify()
        return self.pending()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._tasks and not self._behind:
                    if self._closing:
                        return
                    self._wake.wait()
                if self._abandoned:
                    return
                task = self._tasks[0] if self._tasks else None
                if task is None:
                    steps = list(self._behind)
                    self._reading = len(steps)
            if task is None:  # read the steps behind back from the journal
                self._read_back(steps)
                continue
            if not self._attempt(task):
                return
            with self._wake:
                self._tasks.popleft()

    def _read_back(self, steps: list[tuple[str, int]]) -> None:
        try:
            tasks = self.refill(steps)
        except Exception as exc:  # a journal that cannot be read: those steps are lost
            logger.error("tracker %s: the journal cannot be read back (%r)", self.name, exc)
            tasks = []
        found = {(t.axis, t.step) for t in tasks}
        lost = [s for s in steps if s not in found]
        if lost:
            logger.warning("tracker %s: %d steps are not in the journal and are lost: %s", self.name,
                           len(lost), lost[:5])  # fmt: skip
        with self._wake:
            del self._behind[: len(steps)]
            self._reading = 0
            self._tasks.extend(tasks)

    def _attempt(self, task: Task) -> bool:
        """Make ``task``'s call until it passes (True), fails for good or the writer is abandoned (False)."""
        delay = self.retry
        while True:
            try:
                task.call()
            except BaseException as exc:
                if not isinstance(exc, Exception) or not self.transient(exc):
                    self.fatal(exc, task)
                    return False
                if self._down is None:
                    self._down = time.monotonic()
                    logger.warning(
                        "tracker %s failed at %s %d (%r): its steps wait in a queue and it is tried again "
                        "after %g s, the wait doubling up to %g s; training goes on",
                        self.name, task.axis, task.step, exc, self.retry, self.most,
                    )  # fmt: skip
                with self._wake:
                    if not self._closing:  # a close started meanwhile ends the wait: it tries now
                        self._wake.wait_for(lambda: self._abandoned or self._closing, delay)
                    else:
                        self._wake.wait_for(lambda: self._abandoned, delay)
                    if self._abandoned:
                        return False
                delay = self.retry if self._closing else min(delay * 2, self.most)
                continue
            if self._down is not None:
                with self._wake:
                    behind = len(self._tasks) + (len(self._behind) if self.journal else 0)
                logger.warning("tracker %s is back after %.1f s; it catches up %d steps", self.name,
                               time.monotonic() - self._down, behind)  # fmt: skip
                self._down = None
            return True
