"""Per-node sub-aggregators (``hierarchy="node"``): a ``NodeWorker`` on every node merges its node's
ranks and forwards one message per step to the root aggregator, speaking for its ranks there."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlmetrics.backends.options import OPTIONS
from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.compat import ray
from rlmetrics.backends.ray.shell import AggregatorClass, Shell, keep
from rlmetrics.core.stat import MetricValueError
from rlmetrics.messages import Message, StepResult, SubmissionError

logger = logging.getLogger(__name__)


class _NodeWorker(Shell):
    """A per-node sub-aggregator (docs/backends.md, "Thousands of ranks: ``hierarchy="node"``"). Before
    it answers a rank's first message, or one closing a step new to this node, it relays the rank and
    announces the step at the root, so that a root read after the ranks' ``wait_submit`` waits for it."""

    def __init__(
        self,
        root: str,
        namespace: str | None,
        node_id: str,
        recovery_timeout: float = 30.0,
        secret: str | None = None,
        **options: Any,
    ) -> None:
        from rlmetrics.backends import MetricClient
        from rlmetrics.backends.ray.transport import RayTransport

        # no session: the node serves every run that reaches it; the root checks the ranks' sessions
        uplink = RayTransport(ray.get_actor(root, namespace=namespace), session=None)
        self.upstream = MetricClient(uplink, label=f"node:{node_id}", blocking=False)
        super().__init__(recovery_timeout, secret, upstream=self.upstream, **options)
        self.address = node_actor_name(root, node_id)
        self._relayed: set[str] = set()  # ranks the root knows this node speaks for
        self._announced = -1
        # steps forwarded and not yet final upstream: the (client_id, seq) keys their forwards carried
        self._forwarded: dict[int, set] = {}
        self._forwarder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmetrics-forward")
        self._recovery_end: asyncio.TimerHandle | None = None

    def _waits(self, message: Message) -> bool:
        return message.client not in self._relayed or _newest_close(message) > self._announced

    async def _admit(self, who: str, message: Message) -> Message | str:
        """Relay the rank to the root first (:meth:`_relay`); a rank's resend is trimmed to what
        this node did not forward, or, after this node's restart, forwarded keyed by its rank."""
        client_id = message.client
        step = _newest_close(message)
        refused = await self._relay(who, client_id, step if step > self._announced else None)
        if refused or not message.resync:
            return refused or message
        if not self.restored:  # a rank's resend (the root restarted, or a call failed): what this node
            # forwarded already, its upstream client keeps and resends itself
            forwarded = self._forwarded
            items = [it for it in message.items if (client_id, it.seq) not in forwarded.get(it.step, ())]
            return message._replace(items=items)
        # after this node's restart: each keyed by its rank (some reached the root before), ahead of
        # the forwards that close them
        keyed = [it._replace(seq=((client_id, it.seq),)) for it in message.items]
        if keyed:
            self._forwarder.submit(self._resend_upstream, keyed)
        return message._replace(items=[])

    def _resend_upstream(self, items: list) -> None:
        try:
            self.upstream.resend(items)
        except Exception:  # the upstream client resends what it keeps once the root answers
            logger.exception("forwarding resent submissions upstream failed")

    async def _relay(self, who: str, client_id: str, step: int | None) -> str | None:
        """Tell the root that this node speaks for ``client_id`` (once) and that a rank closed
        ``step`` (once per step); why the root refused the rank, if it did."""
        new = client_id not in self._relayed
        if not new and step is None:
            return None
        refused = await compat.remote(
            self.upstream.transport.handle.relay,
            self.upstream.credential,
            [who] if new else [],
            step,
            self.address,
            who,
        )
        if refused:
            return next(iter(refused.values()))
        self._relayed.add(client_id)
        if step is not None:
            self._announced = max(self._announced, step)
        return None

    async def register(self, who: str) -> None:
        await super().register(who)
        refused = await self._relay(who, self._who(who)[0], None)
        if refused:
            raise SubmissionError(refused)

    async def depart(self, who: str) -> None:
        await super().depart(who)
        await compat.remote(self.upstream.transport.handle.depart, who)

    def changed(self) -> None:
        super().changed()
        self._forward_ready()

    def _forward_ready(self) -> None:
        """Forward each step once every local rank closed it (later data follows in another forward)."""
        if self.server.recovering():  # forwarded once its ranks resent, or at the recovery's end
            if self._recovery_end is None:
                wait = self.server.recovery_deadline - time.monotonic()
                self._recovery_end = asyncio.get_running_loop().call_later(max(wait, 0.0), self._recovered)
            return
        done_below = self.upstream.finalized_state[0]
        self._forwarded = {s: keys for s, keys in self._forwarded.items() if s >= done_below}
        for step in self.engine.pending_steps():
            first = step not in self._forwarded
            if self.engine.is_closed(step) if first else self.engine.closed_by_contributors(step):
                self._forward(step)

    def _forward(self, step: int) -> None:
        """Send what this node holds of ``step`` upstream (in the forwarder thread: the client blocks)."""
        closers = self.engine.closers(step)
        parts = self.engine.take(step)
        self._forwarded.setdefault(step, set()).update(key for _, _, keys in parts for key in keys)
        self._forwarder.submit(self._send_upstream, step, parts, closers)

    def _send_upstream(self, step: int, parts: list, closers: set[str]) -> None:
        try:
            for packed, world_size, keys in parts:
                self.upstream.submit_packed(packed, world_size, step, seq=keys)
            self.upstream.close_step(step, on_behalf=closers)
        except MetricValueError as exc:  # about an earlier forward: the root merged the rest (its meta says)
            logger.warning("the root refused part of what this node forwarded: %s", exc)
        except Exception:  # the upstream client resends what it keeps once the root answers
            logger.exception("forwarding step %d upstream failed", step)

    async def drain(self, step: int, finalize: bool = True) -> None:
        """A deadline at the root for ``step``: forward what this node holds, return once the root has
        it; with ``finalize`` its ranks that did not close it are not waited for until they submit."""
        if step in self.engine.pending_steps():  # (else forwarded already, or never opened here)
            missing = self.engine.clients - self.engine.closers(step) if finalize else ()
            if missing:  # the root's result names them, and its reader warns: no second report
                logger.info("node step %d forwarded at the root's deadline without %s", step, sorted(missing))
                self.engine.clients.difference_update(missing)
            self._forward(step)
        await asyncio.wrap_future(self._forwarder.submit(self.upstream.flush))

    def _recovered(self) -> None:
        """This node's recovery ended: the ranks that resent nothing are not waited for until they
        submit again (as at a finalizing deadline), and what the others closed goes upstream."""
        self._recovery_end = None
        silent = self.server.awaiting & self.engine.clients if not self.server.recovering() else set()
        if silent:
            logger.info("node recovery ended without %s: not waited for until they submit", sorted(silent))
            self.engine.clients.difference_update(silent)
            self.server.persist()
        self.changed()

    async def lose(self, client_id: str) -> None:
        """The root found rank ``client_id``'s process gone: wait for it no more, forward what waited."""
        self.engine.lose(client_id, "gone")
        self.server.awaiting.discard(client_id)  # nor does a restarted node's recovery
        self.server.persist()  # a restart of this node does not wait for it again
        self.changed()

    async def relay(self, *args: Any) -> dict[str, str]:
        raise SubmissionError("a node sub-aggregator does not speak for another node")

    async def result(
        self, step: int, timeout: float | None = None, finalize: bool = False, who: str | None = None
    ) -> StepResult:
        return await asyncio.get_running_loop().run_in_executor(
            self._forwarder, lambda: self.upstream.result(step, timeout, finalize=finalize)
        )

    async def final(self, timeout: float | None = None, who: str | None = None) -> StepResult:
        return await asyncio.get_running_loop().run_in_executor(
            self._forwarder, lambda: self.upstream.wait_final_res(timeout)
        )


NodeWorker = AggregatorClass(_NodeWorker)


def _newest_close(message: Message) -> int:
    """The newest step ``message`` closes for its sender (-1: none)."""
    return max((c for c in message.close if type(c) is int), default=-1)


def node_actor_name(root: str, node_id: str) -> str:
    """The actor name of aggregator ``root``'s sub-aggregator on node ``node_id``."""
    return f"{root}/node/{node_id}"


def node_worker(name: str, namespace: str | None = None, node_id: str | None = None, **options: Any) -> Any:
    """Get or create aggregator ``name``'s sub-aggregator on node ``node_id`` (default: this
    process's), with hard node affinity; of the root's ``options`` it takes all but ``secret``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    actor_name = node_actor_name(name, node_id)
    try:
        return ray.get_actor(actor_name, namespace=namespace)
    except ValueError:
        pass
    actor_opts = {k: options.pop(k) for k in ("lifetime",) if k in options}
    options = {k: v for k, v in options.items() if k in OPTIONS["ray"]["aggregator"] and k != "secret"}
    for _ in range(50):  # processes of one node may race to create it: one wins, the others look it up
        try:
            return keep(
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
