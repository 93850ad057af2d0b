"""Whether the ranks of a torch.distributed group are alive: heartbeats in the default group's store.
docs/torch-distributed.md, "Steps, slips and a rank that is gone".
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

from rlmetrics.extras import require

dist = require("torch.distributed", "torch")

__all__ = ["BEAT", "GONE_AFTER", "Beats", "RankGoneError", "are_gone", "heartbeat", "survivors"]

BEAT = 0.5
"""Seconds between two heartbeats of a process, and between two reads of the counters by a waiting rank."""
GONE_AFTER = 2.0
"""Seconds a rank's counter stands still before the rank is named gone."""
_beating: dict[int, threading.Thread] = {}  # id(store): this process's heartbeat thread


class RankGoneError(RuntimeError):
    """A step's collective failed: a rank is gone and the others could not go on without it (the
    message names it, the step, and what to do); ``gone``: the global ranks found gone."""

    def __init__(self, message: str, gone: list[int]) -> None:
        super().__init__(message)
        self.gone = gone


def _beat(store: Any, key: str) -> None:
    while True:
        try:
            store.add(key, 1)
        except Exception:  # the process group was destroyed: nothing to tell
            return
        if _stop.wait(BEAT):
            return


def _stop_beating() -> None:
    """At exit, before the interpreter tears down: the heartbeat threads stop and are joined (a
    thread still inside the store's C++ call while the process exits aborts it: SIGABRT)."""
    _stop.set()
    for beat in _beating.values():
        beat.join(timeout=5 * BEAT)


_stop = threading.Event()
atexit.register(_stop_beating)


class Beats:
    """The heartbeat counters of a group's ranks, as one waiting rank reads them."""

    def __init__(self, store: Any, ranks: list[int]) -> None:
        self.store, self.ranks = store, ranks
        self.seen: dict[int, tuple[int, float]] = {}  # rank: (counter, when it was first read so)
        self.first = time.monotonic()

    def gone(self) -> list[int]:
        """The ranks whose counter did not move for :data:`GONE_AFTER` seconds (every rank when
        the store is gone: it went with the rank that hosts it, rank 0 under torchrun)."""
        now, out = time.monotonic(), []
        try:
            counts = [self.store.add(f"rlmetrics/beat/{g}", 0) for g in self.ranks]
        except Exception:
            return list(self.ranks)
        for g, count in zip(self.ranks, counts):
            last = self.seen.get(g)
            if last is None or last[0] != count:
                self.seen[g] = (count, now)
            elif now - last[1] >= GONE_AFTER:
                out.append(g)
        return out

    def settled(self) -> list[int]:
        """:meth:`gone`, once the counters were read for :data:`GONE_AFTER` seconds."""
        while True:
            gone = self.gone()
            if gone or time.monotonic() - self.first > GONE_AFTER + BEAT:
                return gone
            time.sleep(BEAT / 2)


def are_gone(ranks: list[int]) -> str:
    return f"{', '.join(f'rank{g}' for g in ranks)} {'is' if len(ranks) == 1 else 'are'} gone"


def heartbeat() -> Any:
    """The default group's store, where this process beats; None without that private torch API."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    if id(store) not in _beating:
        beat = threading.Thread(target=_beat, args=(store, f"rlmetrics/beat/{dist.get_rank()}"), daemon=True)
        _beating[id(store)] = beat
        beat.start()
    return store


def survivors(store: Any, generation: int, ranks: list[int], gone: list[int]) -> list[int]:
    """The ranks that go on after ``gone``, as the first survivor wrote them (one group for all)."""
    key = f"rlmetrics/regroup/{generation}/{','.join(map(str, ranks))}"
    alive = ",".join(str(g) for g in ranks if g not in gone)
    return [int(g) for g in store.compare_set(key, "", alive).decode().split(",") if g]
