"""The aggregator actor: ``MetricWorker``, a thin async shell over :class:`~rlmetrics.server.Server`.

- ``MetricWorker.remote()`` / ``get_metric_worker(name, namespace)``: one aggregator actor (async,
  ``num_cpus=0`` by default, ``max_restarts=-1``).
- Clients send one message per step (:mod:`rlmetrics.wire`: names once per schema, then float64
  buffers) and keep it until the actor's saved state records the step finalized.
- Restarts: the actor saves its registered clients and finalized steps in Ray's internal KV store.
  A new incarnation waits (at most ``recovery_timeout`` seconds) until every registered client has
  resent what it keeps; each client learns of the restart from a failed call, from the new
  incarnation id in a reply, or from its watcher (:mod:`~rlmetrics.backends.ray.transport`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.compat import ray
from rlmetrics.messages import PartlyMergedError, Reply, StepResult, SubmissionError
from rlmetrics.server import Server
from rlmetrics.wire import SchemaTable, decode

DEFAULT_NAME = "rlmetrics"
_SAVED_RESULTS = 2  # newest results a next incarnation resumes with (a read retried across a restart)
logger = logging.getLogger(__name__)


class _MetricWorker:
    """The actor body: a :class:`~rlmetrics.server.Server` (the engine and the rules of every
    call), the schema table, waiting on asyncio, and the state a restarted incarnation resumes from
    (saved in Ray's internal KV store).

    Options: ``recovery_timeout`` (seconds a restarted incarnation waits for clients to resend);
    the rest goes to the Server (``final_timeout``, ``renames``, ``keep_results``,
    ``forget_after``, ``max_pending``).
    """

    _auto_finalize = True

    def __init__(self, recovery_timeout: float = 30.0, **options: Any) -> None:
        self.server = Server(auto_finalize=self._auto_finalize, **options)
        self.engine = self.server.engine
        self.table = SchemaTable()
        self.calls: Counter[str] = Counter()
        self.running = True
        self._changed = asyncio.Event()
        self._kv_key = f"rlmetrics/state/{ray.get_runtime_context().get_actor_id()}".encode()
        saved = compat.kv_get(self._kv_key)
        if saved:  # an earlier incarnation of this actor: resume and wait for the clients' resends
            self.server.restore(json.loads(saved), recovery_timeout)
        self._saved: tuple | None = self._marker()
        # what replies let clients forget: the finalized steps of the state saved last (see _reply)
        self._durable: tuple[int, list[int]] = self.engine.finalized_state()
        self._state: dict = {}
        self._encoded: dict[int, str] = {}  # JSON of kept results by step (a result never changes)
        self._save_scheduled = False
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmetrics-save")

    @property
    def incarnation(self) -> str:
        return self.server.incarnation

    # ------------------------------------------------------------------------------ helpers
    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _marker(self) -> tuple:
        """What the saved state depends on: registered clients and finalized steps."""
        engine = self.engine
        done_below, finalized = engine.finalized_state()
        return (
            frozenset(engine.clients),
            done_below,
            len(finalized),
            engine.newest_closed,
            tuple(step for step, _ in engine.newest_results(1)),
        )

    def _changed_state(self) -> None:
        """Wake the waiting readers; forget the schemas the engine forgot; save the state when what
        it records changed."""
        for sid in self.engine.drain_forgotten():
            self.table.schemas.pop(sid, None)
        marker = self._marker()
        if marker != self._saved:
            self._saved = marker
            self._save()
        self._wake()

    def _save(self) -> None:
        """Record registered clients and finalized steps for a next incarnation; encoding and writing
        happen off the event loop (a restart in the moment before the write lands may finalize a
        step a second time)."""
        self._state = self._export_state()
        if not self._save_scheduled:
            self._save_scheduled = True
            self._saver.submit(self._write_state)

    def _export_state(self) -> dict:
        """The engine's state, its newest results as ``(step, StepResult)``: the writer encodes each
        once (a result never changes; copying and encoding 1000 values and a meta listing every
        rank on the event loop at every finalized step slowed the steps)."""
        state = self.engine.export_state(results=0)
        state["results"] = self.engine.newest_results(_SAVED_RESULTS)
        return state

    def _write_state(self) -> None:
        self._save_scheduled = False
        state = self._state
        try:
            self._encoded = {
                step: self._encoded.get(step) or json.dumps([step, dict(res), res.meta.to_dict()])
                for step, res in state.get("results", ())
            }
            head = json.dumps({k: v for k, v in state.items() if k != "results"})
            body = f'{head[:-1]}, "results": [{", ".join(self._encoded.values())}]}}'
            compat.kv_put(self._kv_key, body.encode())
        except Exception:  # in the saver thread: nobody else would see it
            logger.exception("saving the aggregator's state failed; the next call saves it again")
            self._saved = None  # so the next call saves again; until a save lands, clients keep their steps
            return
        self._durable = (state["done_below"], state["finalized"])

    async def _wait(self, ready: Any, timeout: float | None) -> None:
        """Until ``ready()`` holds or the deadline; woken by every change and at the end of a
        recovery."""
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

    # ------------------------------------------------------------------ the seed's worker API
    async def start(self) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    async def submit_metric(
        self, metrics: Mapping[str, Any], world_size: int, step: int | None = None
    ) -> None:
        """A submission without a client: into ``step`` (default: the current round, see
        :meth:`~rlmetrics.server.Server.submit_direct`)."""
        self.calls["submit_metric"] += 1
        self.server.submit_direct(metrics, world_size, step)
        self._wake()

    async def wait_final_res(self, timeout: float | None = None) -> StepResult:
        return await self.final(timeout)

    # ------------------------------------------------------------------------ client calls
    async def send(self, client_id: str, msg: tuple) -> Reply:
        """One client's message (:mod:`rlmetrics.wire`)."""
        self.calls["send"] += 1
        self.calls["messages"] += 1
        decoded = self._decode(client_id, msg)
        if isinstance(decoded, dict):
            return self._reply(decoded)
        items, close, unknown = decoded
        if unknown:  # merge nothing (a close must not overtake its data): the client repeats with names
            return Reply({}, self.incarnation, unknown=unknown)
        await self._announce(close)
        errors = self.server.merge(client_id, items, close, msg[4])
        self.server.finalize_complete(_steps(items, close))
        self._changed_state()
        return self._reply(errors)

    async def send_many(self, batch: list[tuple[str, tuple]], merged: tuple | None = None) -> list[Reply]:
        """Messages of several clients of one process, posted while its previous call was in flight.

        ``merged``: a message whose items each pre-merge submissions of several of those clients
        (their seq is the tuple of ``(client_id, seq)`` keys), merged before the clients' own
        messages, whose closes may follow them. If any schema is unknown nothing is merged, and if
        an item was partly merged before (a client's resend after a restart overtook it) it is not:
        either way each client repeats its whole message on its own, where every submission merges
        once (replies with ``unknown``).
        """
        self.calls["send_many"] += 1
        self.calls["messages"] += len(batch)
        decoded = [self._decode(client_id, msg) for client_id, msg in batch]
        pre = self._decode("merged", merged) if merged is not None else ([], [], [])
        unknown = [sid for d in (*decoded, pre) if isinstance(d, tuple) for sid in d[2]]
        if unknown:
            return [Reply({}, self.incarnation, unknown=unknown)] * len(batch)
        await self._announce([step for d in decoded if isinstance(d, tuple) for step in d[1]])
        clients = [client_id for client_id, _ in batch]
        resend = False
        steps: set[int] = set()
        if isinstance(pre, tuple):
            pre_errors, resend = self._merge_premerged(pre[0], clients)
            steps |= _steps(pre[0], [])
        else:  # a malformed merged message concerns every client of the batch
            pre_errors = {client_id: pre for client_id in clients}
        errors = []
        for (client_id, msg), d in zip(batch, decoded):
            if isinstance(d, dict):
                errs = d
            else:
                errs = self.server.merge(client_id, d[0], d[1], msg[4])
                steps |= _steps(d[0], d[1])
            errors.append({**errs, **pre_errors.get(client_id, {})})
        self.server.finalize_complete(steps)
        self._changed_state()
        if resend:
            return [Reply({}, self.incarnation, unknown=[])] * len(batch)
        shared = self._reply({})  # one object for every client without errors: pickled once
        return [self._reply(errs) if errs else shared for errs in errors]

    def _reply(self, errors: dict[str, str]) -> Reply:
        """The reply to a send. The steps it lets the client forget are those finalized in the state
        saved last, not in memory: a next incarnation resumes from the saved state, and a step it
        does not know finalized is merged again from the clients' resends."""
        return Reply(errors, self.incarnation, *self._durable)

    async def _announce(self, close: list[int]) -> None:
        """Nothing here: a node sub-aggregator tells the root of new closes before it replies."""

    def _decode(self, client_id: str, msg: tuple) -> tuple | dict:
        """``decode``'s (items, close, unknown), or the errors of a malformed message."""
        try:
            return decode(msg, self.table)
        except SubmissionError as exc:
            return {client_id: str(exc)}

    def _merge_premerged(self, items: list, clients: list[str]) -> tuple[dict[str, dict[str, str]], bool]:
        """Merge pre-merged items; their errors by client (malformed keys: every client's), and
        whether one was partly merged before (left out: the clients must resend one by one)."""
        errors: dict[str, dict[str, str]] = {}
        resend = False
        for step, keys, world_size, packed in items:
            try:
                if not (isinstance(keys, tuple) and keys and all(_is_key(k) for k in keys)):
                    for client_id in clients:
                        errors.setdefault(client_id, {})["merged"] = (
                            "a merged item needs (client_id, seq) keys"
                        )
                    continue
                self.engine.submit_merged(keys, step, world_size, packed)
                self.calls["premerged"] += len(keys)
            except PartlyMergedError:
                resend = True
            except (SubmissionError, ValueError) as exc:
                for client_id, seq in keys:
                    errors.setdefault(client_id, {})[f"{client_id}/{step}/{seq}"] = f"step {step}: {exc}"
        return errors, resend

    async def result(self, step: int, timeout: float | None = None) -> StepResult:
        self.calls["result"] += 1
        await self._wait(lambda: self.server.result_ready(step), timeout)
        out = self.server.result(step)
        self._changed_state()
        return out

    async def final(self, timeout: float | None = None) -> StepResult:
        """The seed's ``wait_final_res`` (:meth:`~rlmetrics.server.Server.final_target`): after a
        recovery, about the newest step closed once the clients resent theirs."""
        self.calls["final"] += 1
        deadline = time.monotonic() + (self.server.final_timeout if timeout is None else timeout)
        await self._wait(lambda: not self.server.recovering(), None)
        target = self.server.final_target()
        await self._wait(lambda: self.server.final_ready(target), max(0.0, deadline - time.monotonic()))
        out = self.server.final(target)
        self._changed_state()
        return out

    async def announce(self, client_id: str, step: int) -> None:
        """A node sub-aggregator's client ``client_id`` will close ``step`` (one of its ranks did)."""
        self.server.announce(client_id, step)
        self._changed_state()

    async def register(self, client_id: str) -> None:
        self.server.register(client_id)
        self._changed_state()

    async def depart(self, client_id: str) -> None:
        self.server.depart(client_id)
        self._changed_state()

    async def watch(self) -> None:
        """Never returns: a client's watcher learns of this incarnation's death when it fails."""
        await asyncio.Event().wait()

    async def ping(self) -> str:
        return self.incarnation

    async def stats(self) -> dict:
        """Calls received by method, registered clients, pending steps and what the engine holds
        (for tests and monitoring)."""
        return {"calls": dict(self.calls), **self.server.stats()}


def _steps(items: list, close: list[int]) -> set[int]:
    return {item[0] for item in items} | set(close)


def _is_key(key: Any) -> bool:
    return isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and type(key[1]) is int


ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_concurrency": 100_000}
"""How aggregator actors are made: no training slot, restarted whenever they die, every waiting call
served at once (readers wait inside the actor)."""

MetricWorker = ray.remote(**ACTOR_OPTIONS)(_MetricWorker)


def get_metric_worker(
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    *,
    num_cpus: float = 0,
    hierarchy: str | None = None,
    **options: Any,
) -> Any:
    """Get the named aggregator actor, or create it (``options`` apply on creation).

    Create it from the driver first: a non-detached actor lives as long as its creator (pass
    ``lifetime="detached"`` to let it outlive the driver). This process keeps a handle to it (Ray
    kills a non-detached actor as soon as its creator drops the last handle), so a bare
    ``get_metric_worker(name)`` in the driver is enough; ``ray.kill(handle)`` ends it.
    ``hierarchy="node"`` also creates one sub-aggregator on every alive node now (see
    :func:`node_worker`).
    """
    actor_opts = {k: options.pop(k) for k in ("lifetime",) if k in options}
    node_opts = {k: options.pop(k) for k in ("node_timeout",) if k in options}
    root = MetricWorker.options(
        name=name, namespace=namespace, get_if_exists=True, num_cpus=num_cpus, **actor_opts
    ).remote(**options)
    keep(root)
    if hierarchy == "node":
        from rlmetrics.backends.ray.node import node_worker

        ray.get(root.ping.remote())
        nodes = [
            node_worker(name, namespace, n["NodeID"], **actor_opts, **node_opts)
            for n in ray.nodes()
            if n["Alive"]
        ]
        ray.get([n.ping.remote() for n in nodes])
    elif hierarchy is not None:
        raise ValueError(f"hierarchy must be None or 'node', got {hierarchy!r}")
    return root


_KEPT: dict[str, Any] = {}
"""The first handle this process got to each aggregator, by actor id, kept for the process's life:
only the creator's own handle keeps a non-detached actor alive (not one looked up by name later)."""


def keep(handle: Any) -> Any:
    _KEPT.setdefault(compat.actor_key(handle), handle)
    return handle
