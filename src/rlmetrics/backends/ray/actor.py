"""The aggregator actor: ``MetricWorker``, a thin async shell over :class:`~rlmetrics.server.Server`.

- ``MetricWorker.remote()`` / ``get_metric_worker(name, namespace)``: one aggregator actor (async,
  ``num_cpus=0`` by default, ``max_restarts=-1``).
- Clients send one message per step (:mod:`rlmetrics.wire`: names once per schema, then float64
  buffers) with their credential (:func:`~rlmetrics.client.credential`), and keep it until the
  actor's saved state records the step finalized.
- Restarts: the actor saves its registered clients and finalized steps in Ray's internal KV store,
  signed with a secret the actor was created with (Ray hands a restarted actor its creation
  arguments again): a state that another job wrote there is refused, never obeyed. A new
  incarnation waits (at most ``recovery_timeout`` seconds) until every registered client has resent
  what it keeps; each client learns of the restart from a failed call, from the new incarnation id
  in a reply, or from its watcher (:mod:`~rlmetrics.backends.ray.transport`).
- Deadlines: a step is finalized as it stands at the deadline of a reader that finalizes
  (``result(step, timeout, finalize=True)``, ``wait_final_res``) or, with ``step_timeout``, at its
  own deadline (that long after its first close); first, the node sub-aggregators that speak for a rank
  the step misses forward what they hold of it (:mod:`~rlmetrics.backends.ray.node`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlmetrics.aggregator import saved_result
from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.compat import ray
from rlmetrics.client import identity, public_id
from rlmetrics.messages import RayStartedWarning, Reply, StepResult, SubmissionError
from rlmetrics.server import Server
from rlmetrics.wire import SchemaTable, decode

DEFAULT_NAME = "rlmetrics"
_SAVED_RESULTS = 2  # newest results a next incarnation resumes with (a read retried across a restart)
DRAIN_TIMEOUT = 10.0  # seconds a deadline waits for a node sub-aggregator's forward
logger = logging.getLogger(__name__)


class _MetricWorker:
    """The actor body: a :class:`~rlmetrics.server.Server` (the engine and the rules of every
    call), the schema table, waiting on asyncio, and the state a restarted incarnation resumes from
    (saved in Ray's internal KV store).

    Options: ``recovery_timeout`` (seconds a restarted incarnation waits for clients to resend),
    ``secret`` (the key that signs the saved state; :data:`MetricWorker` gives every new actor one);
    the rest goes to the Server (``final_timeout``, ``step_timeout``, ``renames``, ``keep_results``,
    ``forget_after``, ``max_pending``).
    """

    _auto_finalize = True

    def __init__(self, recovery_timeout: float = 30.0, secret: str | None = None, **options: Any) -> None:
        self._new_server(options)
        self.table = SchemaTable()
        self.calls: Counter[str] = Counter()
        self.running = True
        self._changed = asyncio.Event()
        context = ray.get_runtime_context()
        self._namespace = context.namespace
        self._kv_key = f"rlmetrics/state/{context.get_actor_id()}".encode()
        self._secret = (secret or secrets.token_hex(32)).encode()
        self.refused_state: str | None = None  # why a saved state was refused (stats)
        saved = self._verified(compat.kv_get(self._kv_key))
        # an earlier incarnation: resume, and wait for the clients' resends
        self._restored = saved is not None and self._restore(saved, recovery_timeout, options)
        self._saved: tuple | None = self._marker()
        # what replies let clients forget: the finalized steps of the state saved last (see _reply)
        self._durable: tuple[int, list[int]] = self.engine.finalized_state()
        self._state: dict = {}
        self._encoded: dict[int, str] = {}  # JSON of kept results by step (a result never changes)
        self._save_scheduled = False
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmetrics-save")
        self._deadlines: asyncio.Task | None = None
        self._nodes: dict[str, Any] = {}  # node sub-aggregator handles by actor name

    def _new_server(self, options: dict) -> None:
        self.server = Server(auto_finalize=self._auto_finalize, session_ended=compat.job_dead, **options)
        self.engine = self.server.engine

    def _restore(self, saved: dict, recovery_timeout: float, options: dict) -> bool:
        """Resume from ``saved``; False, logged and in ``stats()``, when this version cannot read it
        (it then starts empty, as after a refused state: a restart that failed on it would restart
        forever)."""
        try:
            self.server.restore(saved, recovery_timeout)
            return True
        except Exception as exc:  # noqa: BLE001 - signed by this aggregator, in a form it does not read
            self.refused_state = (
                f"the saved state under {self._kv_key.decode()} could not be read ({exc!r:.200}): "
                "refused; starting empty, the clients resend what they keep"
            )
            logger.error("rlmetrics: %s", self.refused_state)
            self._new_server(options)  # the failed restore may have left part of the state
            return False

    @property
    def incarnation(self) -> str:
        return self.server.incarnation

    # ------------------------------------------------------------------------------ helpers
    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _marker(self) -> tuple:
        """What the saved state depends on: registered clients, finalized steps, sessions, nodes."""
        server, engine = self.server, self.engine
        done_below, finalized = engine.finalized_state()
        return (
            frozenset(engine.clients),
            done_below,
            len(finalized),
            engine.newest_closed,
            tuple(step for step, _ in engine.newest_results(1)),
            server.changes,
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
        if self._deadlines is None and self._auto_finalize and self.server.step_timeout is not None:
            self._deadlines = asyncio.get_running_loop().create_task(self._end_due_steps())
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
        """The server's state, its newest results as ``(step, StepResult)``: the writer encodes each
        once (a result never changes; copying and encoding 1000 values and a meta listing every
        rank on the event loop at every finalized step slowed the steps)."""
        state = self.server.export_state(results=0)
        state["results"] = self.engine.newest_results(_SAVED_RESULTS)
        return state

    def _write_state(self) -> None:
        self._save_scheduled = False
        state = self._state
        try:
            self._encoded = {
                step: self._encoded.get(step) or json.dumps(saved_result(step, res))
                for step, res in state.get("results", ())
            }
            head = json.dumps({k: v for k, v in state.items() if k != "results"})
            body = f'{head[:-1]}, "results": [{", ".join(self._encoded.values())}]}}'.encode()
            compat.kv_put(self._kv_key, self._sign(body) + b"\n" + body)
        except Exception:  # in the saver thread: nobody else would see it
            logger.exception("saving the aggregator's state failed; the next call saves it again")
            self._saved = None  # so the next call saves again; until a save lands, clients keep their steps
            return
        self._durable = (state["done_below"], state["finalized"])

    def _sign(self, body: bytes) -> bytes:
        return hmac.new(self._secret, self._kv_key + b"\n" + body, hashlib.sha256).hexdigest().encode()

    def _verified(self, saved: bytes | None) -> dict | None:
        """The state an earlier incarnation saved, or None: nothing saved, or a state this actor did
        not sign (written by another job, or by another aggregator), which is refused and logged."""
        if not saved:
            return None
        mac, _, body = saved.partition(b"\n")
        if hmac.compare_digest(mac, self._sign(body)):
            return json.loads(body)
        self.refused_state = (
            f"the saved state under {self._kv_key.decode()} is not this aggregator's (its signature does "
            "not match): refused; starting empty, the clients resend what they keep"
        )
        logger.error("rlmetrics: %s", self.refused_state)
        return None

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

    async def _end_due_steps(self) -> None:
        """Finalize every step whose own deadline passes (``step_timeout`` after its first close).
        A step closed later has a later deadline, so this sleeps until the earliest one, and waits
        for a change only while no step has one."""
        while True:
            due = self.server.next_due()
            if due is None:
                await self._changed.wait()
                continue
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                steps = self.server.due_steps()
                for step in steps:
                    await self._drain(step)
                    self.server.finalize(step)
                if steps:
                    self._changed_state()
            except Exception:  # noqa: BLE001 - the next deadline is still kept
                logger.exception("finalizing the steps whose deadline passed failed; again in a second")
                await asyncio.sleep(1.0)

    async def _drain(self, step: int) -> None:
        """Before ``step`` is finalized at a deadline: the node sub-aggregators that speak for a rank
        it misses forward what they hold of it (each at most ``DRAIN_TIMEOUT`` seconds)."""
        await asyncio.gather(*(self._drain_node(address, step) for address in self.server.nodes_of(step)))

    async def _drain_node(self, address: str, step: int) -> None:
        try:
            node = self._nodes.get(address) or ray.get_actor(address, namespace=self._namespace)
            self._nodes[address] = node
            await asyncio.wait_for(compat.remote(node.drain, step), DRAIN_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a node gone: the ranks it spoke for are missing
            logger.warning("node sub-aggregator %s did not forward step %d: %r", address, step, exc)

    def _who(self, who: str) -> tuple[str, str | None] | str:
        """``(client_id, session)`` of a credential, or why it is refused."""
        try:
            return identity(who)
        except SubmissionError as exc:
            return str(exc)

    @property
    def restored(self) -> bool:
        """This incarnation resumed from the state an earlier one saved (it restarted)."""
        return self._restored

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
    async def send(self, who: str, msg: tuple) -> Reply:
        """One client's message (:mod:`rlmetrics.wire`); ``who``: its credential."""
        self.calls["send"] += 1
        return (await self._merge_messages([(who, msg)]))[0]

    async def send_many(self, batch: list[tuple[str, tuple]]) -> list[Reply]:
        """Messages of several clients of one process (or several of one client), posted while its
        previous call was in flight: each merged as :meth:`send` merges it, in order."""
        self.calls["send_many"] += 1
        return await self._merge_messages(batch)

    async def _merge_messages(self, batch: list[tuple[str, tuple]]) -> list[Reply]:
        """Merge each ``(credential, message)`` in turn, then finalize the steps they completed; the
        replies. A message with a schema this incarnation lacks merges nothing, nor do the later
        messages of its client in the batch (a close must not overtake its data): their replies
        name the schemas, and the client repeats them in order with names."""
        self.calls["messages"] += len(batch)
        steps: set[int] = set()
        replies: list[Reply | tuple[dict, set]] = []
        waiting: dict[str, list[bytes]] = {}  # credentials with a message to repeat: the schemas
        for who, msg in batch:
            client = self._who(who)
            if isinstance(client, str):
                replies.append(self._reply({public_id(who)[:80]: client}))
                continue
            decoded = self._decode(client[0], msg)
            if isinstance(decoded, dict):
                replies.append(self._reply(decoded))
            elif decoded[2] or who in waiting:
                unknown = waiting.setdefault(who, decoded[2])
                replies.append(Reply({}, self.incarnation, unknown=unknown))
            else:
                late: set[int] = set()
                errors = await self._merge(who, *client, decoded[0], decoded[1], msg[4], steps, late)
                replies.append((errors, late))
        self.server.finalize_complete(steps)
        self._changed_state()
        shared = self._reply({})  # one object for every client without errors: pickled once
        return [r if isinstance(r, Reply) else self._reply(*r) if r[0] or r[1] else shared for r in replies]

    async def _merge(
        self,
        who: str,
        client_id: str,
        session: str | None,
        items: list,
        close: list,
        resync: bool,
        steps: set,
        late: set,
    ) -> dict[str, str]:
        """The server's merge of one client's message, the steps it is about into ``steps``, those
        whose data it dropped as late into ``late`` (a node relays the client to the root first)."""
        return self.server.merge(client_id, items, close, resync, session, steps, late)

    def _reply(self, errors: dict[str, str], late: Any = ()) -> Reply:
        """The reply to a send, with the steps whose data it dropped as late. The steps it lets the
        client forget are those finalized in the state saved last, not in memory: a next
        incarnation resumes from the saved state, and a step it does not know finalized is merged
        again from the clients' resends."""
        return Reply(errors, self.incarnation, *self._durable, late=sorted(late))

    def _decode(self, client_id: str, msg: tuple) -> tuple | dict:
        """``decode``'s (items, close, unknown), or the errors of a malformed message."""
        try:
            return decode(msg, self.table)
        except SubmissionError as exc:
            return {client_id: str(exc)}

    async def result(self, step: int, timeout: float | None = None, finalize: bool = False) -> StepResult:
        """``step`` once complete; at ``timeout`` final and partial when ``finalize``, else
        provisional (:meth:`~rlmetrics.server.Server.result`)."""
        self.calls["result"] += 1
        await self._wait(lambda: self.server.result_ready(step), timeout)
        if finalize and not self.server.result_ready(step):
            await self._drain(step)
        out = self.server.result(step, finalize)
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
        if target is not None and not self.server.final_ready(target):
            await self._drain(target)
        out = self.server.final(target)
        self._changed_state()
        return out

    async def relay(
        self, node: str, ranks: list[str], step: int | None, address: str, closer: str | None = None
    ) -> dict[str, str]:
        """A node sub-aggregator (``node``: its credential; ``address``: its actor name) speaks for
        ``ranks`` (their credentials) from now on, and its rank ``closer`` closed ``step``; the
        refused ranks, with why."""
        sender = self._who(node)
        if isinstance(sender, str):
            raise SubmissionError(sender)
        refused = {}
        for who in ranks:
            rank = self._who(who)
            why = rank if isinstance(rank, str) else self.server.relay(sender[0], rank[0], address, rank[1])
            if why:
                refused[public_id(who)[:80]] = why
        closing = self._who(closer) if closer is not None else None
        if step is not None and isinstance(closing, tuple):
            self.server.announce(step, closing[0])
        self._changed_state()
        return refused

    async def register(self, who: str) -> None:
        client = self._who(who)
        refused = client if isinstance(client, str) else self.server.register(*client)
        if refused:
            raise SubmissionError(refused)
        self._changed_state()

    async def depart(self, who: str) -> None:
        client = self._who(who)
        if isinstance(client, str):
            raise SubmissionError(client)
        self.server.depart(client[0])
        self._changed_state()

    async def watch(self) -> None:
        """Never returns: a client's watcher learns of this incarnation's death when it fails."""
        await asyncio.Event().wait()

    async def ping(self) -> str:
        return self.incarnation

    async def stats(self) -> dict:
        """Calls received by method, registered clients, pending steps and what the engine holds
        (for tests and monitoring), and why a saved state was refused (if one was)."""
        return {"calls": dict(self.calls), **self.server.stats(), "refused_state": self.refused_state}


OPTIONS = (
    "recovery_timeout",
    "final_timeout",
    "step_timeout",
    "renames",
    "keep_results",
    "forget_after",
    "max_pending",
)
"""What an aggregator actor is made with (:class:`_MetricWorker` and :class:`~rlmetrics.server.Server`)."""

ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_concurrency": 100_000}
"""How aggregator actors are made: no training slot, restarted whenever they die, every waiting call
served at once (readers wait inside the actor)."""


class AggregatorClass:
    """``ray.remote(**ACTOR_OPTIONS)(cls)`` whose every new actor gets a fresh ``secret`` among its
    creation arguments: Ray gives a restarted actor the same arguments, so each incarnation can
    check that the state it resumes from was signed by this actor (a job reading Ray's KV store
    does not see the arguments). ``.remote(...)`` and ``.options(...).remote(...)`` as Ray's."""

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
    unknown = sorted(set(kwargs) - {*OPTIONS, "secret"})
    if unknown:  # else the actor's creation fails, and its callers see "metric worker is gone"
        raise TypeError(f"unknown aggregator option(s) {unknown}; the options: {OPTIONS}")
    return {"secret": secrets.token_hex(32), **kwargs}


MetricWorker = AggregatorClass(_MetricWorker)
"""The aggregator actor class: ``MetricWorker.remote(**options)``,
``MetricWorker.options(name=...).remote(...)``."""


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
    :func:`node_worker`). Without Ray initialized it calls ``ray.init()``, as Ray's own calls do,
    and warns (:class:`~rlmetrics.messages.RayStartedWarning`) if that started a local instance.
    """
    if not ray.is_initialized() and compat.init():
        warnings.warn(
            "rlmetrics: Ray was not initialized, so a local Ray instance was started for the metric "
            "worker; to use a running cluster call ray.init(address=...) (or set RAY_ADDRESS) before "
            "connect('ray') / get_metric_worker",
            RayStartedWarning,
            stacklevel=2,
        )
    actor_opts = {k: options.pop(k) for k in ("lifetime",) if k in options}
    root = MetricWorker.options(
        name=name, namespace=namespace, get_if_exists=True, num_cpus=num_cpus, **actor_opts
    ).remote(**options)
    keep(root)
    if hierarchy == "node":
        from rlmetrics.backends.ray.node import node_worker

        ray.get(root.ping.remote())
        nodes = [node_worker(name, namespace, n["NodeID"], **actor_opts) for n in ray.nodes() if n["Alive"]]
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
