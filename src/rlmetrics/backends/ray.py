"""Ray backend: the seed's ``MetricWorker`` actor, a thin async shell over the engine.

- ``MetricWorker.remote()`` / ``get_metric_worker(name, namespace)``: one aggregator actor (async,
  ``num_cpus=0`` by default, ``max_restarts=-1``).
- Clients send one message per step (:mod:`rlmetrics.wire`: names once per schema, then float64
  buffers) and keep it until the step is finalized.
- Restarts: the actor keeps its registered clients and finalized steps in Ray's internal KV store.
  A new incarnation waits (at most ``recovery_timeout`` seconds) until every registered client has
  resent what it keeps; each client learns of the restart from a failed call, from the new
  incarnation id in a reply, or from its watcher (one outstanding ``watch`` call per process and
  actor, which fails when the actor dies).
- ``hierarchy="node"``: a ``NodeWorker`` per node merges its node's ranks and forwards one message
  per step to the root.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from rlmetrics.aggregator import Packed, PartlyMergedError, StepResult, SubmissionError
from rlmetrics.client import AggregatorRestarted
from rlmetrics.extras import require
from rlmetrics.server import Server, Submission
from rlmetrics.stat import stats_of_rows
from rlmetrics.wire import SchemaTable, decode, encode

ray = require("ray", "ray")
from ray.experimental import internal_kv  # noqa: E402  (after the extra check)

_UNAVAILABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
DEFAULT_NAME = "rlmetrics"
_KNOWN_LIMIT = 512  # schema ids a transport remembers the actor has
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
        saved = internal_kv._internal_kv_get(self._kv_key)
        if saved:  # an earlier incarnation of this actor: resume and wait for the clients' resends
            self.server.restore(json.loads(saved), recovery_timeout)
        self._saved: tuple = self._marker()
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
        return (
            frozenset(engine.clients),
            engine.finalized_state()[0],
            len(engine.finalized_state()[1]),
            engine.newest_closed,
            engine.memory()["results"] and max(engine._results),
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
        return self.engine.export_state()

    def _write_state(self) -> None:
        self._save_scheduled = False
        state = self._state
        results = {step: [step, values, meta] for step, values, meta in state.get("results", ())}
        self._encoded = {step: self._encoded.get(step) or json.dumps(r) for step, r in results.items()}
        head = json.dumps({k: v for k, v in state.items() if k != "results"})
        body = f'{head[:-1]}, "results": [{", ".join(self._encoded.values())}]}}'
        internal_kv._internal_kv_put(self._kv_key, body.encode(), overwrite=True)

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
    async def send(self, client_id: str, msg: tuple) -> dict:
        """One client's message (:mod:`rlmetrics.wire`)."""
        self.calls["send"] += 1
        self.calls["messages"] += 1
        decoded = self._decode(client_id, msg)
        if isinstance(decoded, dict):
            return self._reply(decoded)
        items, close, unknown = decoded
        if unknown:  # merge nothing (a close must not overtake its data): the client repeats with names
            return {"unknown": unknown, "incarnation": self.incarnation}
        await self._announce(close)
        errors = self.server.merge(client_id, items, close, msg[4])
        self.server.finalize_complete(_steps(items, close))
        self._changed_state()
        return self._reply(errors)

    async def send_many(self, batch: list[tuple[str, tuple]], merged: tuple | None = None) -> list[dict]:
        """Messages of several clients of one process, posted while its previous call was in flight.

        ``merged``: a message whose items each pre-merge submissions of several of those clients
        (their seq is the tuple of ``(client_id, seq)`` keys), merged before the clients' own
        messages, whose closes may follow them. If any schema is unknown nothing is merged, and if
        an item was partly merged before (a client's resend after a restart overtook it) it is not:
        either way each client repeats its whole message on its own, where every submission merges
        once (``{"unknown": ...}`` replies).
        """
        self.calls["send_many"] += 1
        self.calls["messages"] += len(batch)
        decoded = [self._decode(client_id, msg) for client_id, msg in batch]
        pre = self._decode("merged", merged) if merged is not None else ([], [], [])
        unknown = [sid for d in (*decoded, pre) if isinstance(d, tuple) for sid in d[2]]
        if unknown:
            return [{"unknown": unknown, "incarnation": self.incarnation}] * len(batch)
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
            return [{"unknown": [], "incarnation": self.incarnation}] * len(batch)
        shared = self._reply({})  # one object for every client without errors: pickled once
        return [self._reply(errs) if errs else shared for errs in errors]

    def _reply(self, errors: dict[str, str]) -> dict:
        return self.server.reply(errors)

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


class _NodeWorker(_MetricWorker):
    """A per-node sub-aggregator: merges the ranks of its node and forwards each step upstream in
    one message, once every local client closed it (or ``node_timeout`` seconds after the step's
    first data, leaving out the local clients that did not close it).

    Before it answers a message that closes a step, it tells the root that its client will close
    that step (:meth:`_MetricWorker.announce`), so a ``wait_final_res`` at the root after the ranks'
    blocking ``wait_submit`` is about that step and waits for this node's forward.

    Clients keep their data until the root finalized the step (the node relays the root's finalized
    steps), and the node forwards with a fixed client id and fixed sequence numbers, so a restarted
    node re-forwards what its clients resend and the root merges it once.
    """

    _auto_finalize = False

    def __init__(self, root: str, namespace: str | None, node_id: str, node_timeout: float = 30.0, **options):
        super().__init__(**options)
        self.node_timeout = node_timeout
        self._first_seen: dict[int, float] = {}
        self._forwards: dict[int, int] = {}  # messages forwarded per step not yet finalized upstream
        self._announced = -1
        self._forwarder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmetrics-forward")
        from rlmetrics.backends import MetricClient

        self.upstream = MetricClient(
            ray.get_actor(root, namespace=namespace), client_id=f"node:{node_id}", blocking=False
        )
        self._timer: asyncio.Task | None = None

    def _export_state(self) -> dict:  # finalized steps are the root's business
        return {"clients": sorted(self.engine.clients), "done_below": 0, "finalized": []}

    async def _announce(self, close: list[int]) -> None:
        step = max(close, default=-1)
        if step > self._announced:
            self._announced = step
            await _remote(self.upstream.transport.handle.announce, self.upstream.client_id, step)

    def _changed_state(self) -> None:
        super()._changed_state()
        now = time.monotonic()
        for step in self.engine.pending_steps():
            self._first_seen.setdefault(step, now)
        self._forward_ready()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._tick())

    def _marker(self) -> tuple:
        return (frozenset(self.engine.clients),)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.node_timeout / 4))
            self._forward_ready()

    def _forward_ready(self) -> None:
        """Forward each step once every local client closed it; data of a client that joins after
        that (its first submission) follows in another message, which the root merges too."""
        if self.server.recovering():
            return
        now = time.monotonic()
        done_below = self.upstream.finalized_state[0]
        self._forwards = {s: n for s, n in self._forwards.items() if s >= done_below}
        for step in self.engine.pending_steps():
            late = now - self._first_seen.get(step, now) > self.node_timeout
            forwards = self._forwards.get(step, 0)
            ready = self.engine.is_closed(step) if forwards == 0 else self.engine.closed_by_contributors(step)
            if ready or late:
                if late:  # like a deadline at the root: stop waiting for the silent local clients
                    missing, _ = self.engine.missing(step)
                    logger.warning("node step %d forwarded without %s", step, missing)
                    self.engine.clients.difference_update(missing)
                parts = self.engine.take(step)
                self._first_seen.pop(step, None)
                self._forwards[step] = forwards + 1
                self._forwarder.submit(self._forward, step, parts, forwards)

    def _forward(self, step: int, parts: list, forwards: int) -> None:
        try:
            for i, (packed, world_size) in enumerate(parts):  # fixed seqs: a re-forward merges once
                self.upstream.submit_packed(packed, world_size, step, seq=forwards * 1_000_000 + i)
            self.upstream.close_step(step)
        except Exception:  # the upstream client resends what it keeps once the root answers
            logger.exception("forwarding step %d upstream failed", step)

    def _reply(self, errors: dict[str, str]) -> dict:
        reply = super()._reply(errors)
        reply["done_below"], reply["finalized"] = self.upstream.finalized_state
        return reply

    async def result(self, step: int, timeout: float | None = None) -> StepResult:
        return await asyncio.get_running_loop().run_in_executor(
            self._forwarder, lambda: self.upstream.result(step, timeout)
        )

    async def final(self, timeout: float | None = None) -> StepResult:
        return await asyncio.get_running_loop().run_in_executor(
            self._forwarder, lambda: self.upstream.wait_final_res(timeout)
        )


def _steps(items: list, close: list[int]) -> set[int]:
    return {item[0] for item in items} | set(close)


def _is_key(key: Any) -> bool:
    return isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and type(key[1]) is int


MetricWorker = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=100_000)(_MetricWorker)
NodeWorker = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=100_000)(_NodeWorker)


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
    _keep(root)
    if hierarchy == "node":
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


def _keep(handle: Any) -> Any:
    _KEPT.setdefault(handle._actor_id.hex(), handle)
    return handle


def node_worker(name: str, namespace: str | None, node_id: str | None = None, **options: Any) -> Any:
    """Get or create the sub-aggregator of aggregator ``name`` on node ``node_id`` (default: this
    process's node), pinned there with hard node affinity."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    actor_name = f"{name}/node/{node_id}"
    try:
        return ray.get_actor(actor_name, namespace=namespace)
    except ValueError:
        pass
    actor_opts = {k: options.pop(k) for k in ("lifetime",) if k in options}
    for _ in range(50):  # processes of one node may race to create it: one wins, the others look it up
        try:
            return _keep(
                NodeWorker.options(
                    name=actor_name,
                    namespace=namespace,
                    get_if_exists=True,
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    **actor_opts,
                ).remote(name, namespace, node_id, **options)
            )
        except ValueError:
            time.sleep(0.1)
    return ray.get_actor(actor_name, namespace=namespace)


class RayTransport:
    """A client's link to a ``MetricWorker`` actor handle.

    ``post`` is the non-blocking send: every client of the same actor in this process shares one
    :class:`_Sender`, so messages posted while a call is in flight travel together in the next one.
    """

    def __init__(self, handle: Any, reconnect_timeout: float = 120.0, root: Any = None) -> None:
        self.handle = handle  # where sends go: the root, or this node's sub-aggregator
        self.root = root if root is not None else handle  # where results come from
        self.reconnect_timeout = reconnect_timeout
        self._known: set[bytes] = set()  # schema ids the current incarnation has
        self._incarnation: str | None = None
        self._sender = _Sender.of(self)

    def _call(self, method: str, *args: Any, actor: Any = None) -> Any:
        actor = self.handle if actor is None else actor
        try:
            return _get(_remote(getattr(actor, method), *args))
        except _UNAVAILABLE as exc:
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

    def _track(
        self, reply: dict, client_id: str, items: list[Submission], close: list[int], resync: bool
    ) -> dict:
        if "unknown" in reply:
            reply = self.repeat(client_id, items, close, resync)
        if reply["incarnation"] != self._incarnation:
            self._known = {item[3].schema.id for item in items}
            self._incarnation = reply["incarnation"]
        return reply

    def repeat(self, client_id: str, items: list[Submission], close: list[int], resync: bool) -> dict:
        """Send a message again on its own, with every schema's names: the answer to an "unknown"
        reply (the actor lost some schemas, or could not merge a pre-merged item)."""
        return self._call("send", client_id, encode(items, close, True, resync))

    def send(self, client_id: str, items: list[Submission], close: list[int], resync: bool = False) -> dict:
        reply = self._call("send", client_id, self._encode(items, close, resync))
        return self._track(reply, client_id, items, close, resync)

    def post(self, client_id: str, items: list[Submission], close: list[int]) -> tuple:
        """Send without waiting; :meth:`collect` gives the reply (or raises AggregatorRestarted)."""
        return (self._sender.post(self, client_id, items, close), client_id, items, close)

    def collect(self, posted: tuple, block: bool = True) -> dict | None:
        future, client_id, items, close = posted
        if not block and not future.done():
            return None
        return self._track(future.result(), client_id, items, close, False)

    def result(self, step: int, timeout: float | None) -> StepResult:
        return self._call("result", step, timeout, actor=self.root)

    def final(self, timeout: float | None = None) -> StepResult:
        return self._call("final", timeout, actor=self.root)

    def register(self, client_id: str) -> None:
        self._call("register", client_id)

    def depart(self, client_id: str) -> None:
        self._call("depart", client_id)

    def watch(self, client: Any) -> None:
        """Resend ``client``'s kept submissions whenever the actor restarts (one thread per actor)."""
        _Watcher.of(self).clients.add(client)


def _remote(method: Any, *args: Any) -> Any:
    """``method.remote(*args)`` on an existing actor handle, raising ConnectionError where Ray's
    ``.remote()`` would start a new local Ray instance (Ray not initialized).

    A client used after ``ray.shutdown()``, or one of its threads still waiting for an aggregator
    while the user shuts Ray down, must not start a stray Ray instance in the user's process (one
    started so during a shutdown made the next ``ray.init`` fail).
    """
    if not ray.is_initialized():
        raise ConnectionError("Ray is shut down")
    submit = getattr(type(method)._remote, "__wrapped__", None)  # Ray's _remote without that step
    try:
        return method.remote(*args) if submit is None else submit(method, args, {})
    except ray.exceptions.RaySystemError as exc:  # shut down meanwhile
        raise ConnectionError(f"Ray is shut down: {exc}") from exc


_ray_get = getattr(ray.get, "__wrapped__", ray.get)  # ray.get without starting Ray


def _get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get(ref, timeout=timeout)``, raising ConnectionError where Ray's would start a new
    local Ray instance (see :func:`_remote`)."""
    try:
        return _ray_get(ref, timeout=timeout)
    except ray.exceptions.RaySystemError as exc:
        raise ConnectionError(f"Ray is shut down: {exc}") from exc


def _wait_alive(handle: Any, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _get(_remote(handle.ping), timeout=10)
        except (*_UNAVAILABLE, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise ConnectionError(f"metric worker unreachable for {timeout} s") from None
            time.sleep(0.1)
        except Exception as exc:  # Ray refuses to even submit: the actor is gone for good
            raise ConnectionError(f"metric worker is gone: {exc}") from exc


def _per_actor(cls: Any, transport: RayTransport) -> Any:
    """The one ``cls`` instance of this process for the transport's actor."""
    key = transport.handle._actor_id.hex()
    with cls._lock:
        if key not in cls._by_actor:
            cls._by_actor[key] = cls(transport)
        return cls._by_actor[key]


class _Sender:
    """Group commit: a ``send_many`` call carries every message posted while the previous call was
    in flight, so no message waits for a timer and a busy process makes few calls; the steady
    scalar submissions of several clients for one step and schema travel pre-merged
    (:func:`_premerge`), so the aggregator's work per step follows processes, not ranks."""

    _by_actor: dict[str, _Sender] = {}
    _lock = threading.Lock()

    def __init__(self, transport: RayTransport) -> None:
        self.handle = transport.handle
        self.reconnect_timeout = transport.reconnect_timeout
        self._queue: list[tuple[str, tuple, Future]] = []
        self._cond = threading.Condition()
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
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                batch, self._queue = self._queue, []
            try:
                replies = _get(_remote(self.handle.send_many, *_premerge(batch)))
            except _UNAVAILABLE:
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
                if "unknown" in reply:  # repeat now, not at the client's next call: a reader may wait for it
                    try:
                        reply = transport.repeat(client_id, items, close, False)
                    except (Exception, SystemExit) as exc:  # AggregatorRestarted: the client resends
                        future.set_exception(exc)
                        continue
                future.set_result(reply)


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
            if (
                packed.stats.ndim == 1
                and not packed.sketches
                and not packed.records
                and transport.knows(packed)
            ):
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
        keys = tuple((client_id, item[1]) for client_id, item, _ in members)
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
            _remote(self.handle.watch).future().add_done_callback(self._fired)
        except ConnectionError:  # Ray is shut down: nothing to watch
            pass

    def _fired(self, future: Future) -> None:
        if isinstance(future.exception(), _UNAVAILABLE) and ray.is_initialized():
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
