"""Where a server keeps the state a next incarnation resumes from: the :class:`Store` protocol,
:class:`MemoryStore` and :func:`dump_state` (on Ray: :class:`~rlmetrics.backends.ray.store.KVStore`).

>>> store = MemoryStore()
>>> store.save({"clients": ["rank0"], "results": []}, done=print)
True
>>> store.load()
{'clients': ['rank0'], 'results': []}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Protocol

from rlmetrics.engine.aggregator import saved_result


class RefusedState(Exception):
    """A stored state not to be resumed from (not this aggregator's, or unreadable), saying why."""


class Store(Protocol):
    """Where a server keeps the state a next incarnation resumes from; ``where`` names it in messages."""

    where: str

    def load(self) -> dict | None:
        """The saved state, None when nothing is saved; raises :class:`RefusedState`."""
        ...

    def save(self, state: dict, done: Callable[[bool], None]) -> None:
        """Save ``state`` (:func:`dump_state` encodes it), then call ``done(saved)``, maybe later
        and from another thread; of saves not yet written, only the newest need be."""
        ...


class MemoryStore:
    """A :class:`Store` in memory, saved at once (a restart in a test: a new ``Server`` on it)."""

    where = "memory"

    def __init__(self) -> None:
        self.saved: str | None = None

    def load(self) -> dict | None:
        return None if self.saved is None else json.loads(self.saved)

    def save(self, state: dict, done: Callable[[bool], None]) -> None:
        self.saved = dump_state(state)
        done(True)


def dump_state(state: Mapping, encoded: dict[int, str] | None = None) -> str:
    """``state`` as JSON; ``encoded``: results' JSON by step, kept between calls (each encoded once)."""
    results = {
        step: (encoded or {}).get(step) or json.dumps(saved_result(step, res))
        for step, res in state.get("results", ())
    }
    if encoded is not None:
        encoded.clear()
        encoded.update(results)
    head = json.dumps({k: v for k, v in state.items() if k != "results"})
    return f'{head[:-1]}, "results": [{", ".join(results.values())}]}}'
