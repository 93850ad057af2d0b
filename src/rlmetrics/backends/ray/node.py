"""Per-node sub-aggregators (``hierarchy="node"``): a ``NodeWorker`` on every node merges its node's
ranks and forwards one message per step to the root aggregator."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.actor import ACTOR_OPTIONS, _MetricWorker, keep
from rlmetrics.backends.ray.compat import ray
from rlmetrics.messages import Reply, StepResult

logger = logging.getLogger(__name__)


class _NodeWorker(_MetricWorker):
    """A per-node sub-aggregator: merges the ranks of its node and forwards each step upstream in
    one message, once every local client closed it (or ``node_timeout`` seconds after the step's
    first data, leaving out the local clients that did not close it).

    Before it answers a message that closes a step, it tells the root that its client will close
    that step (:meth:`_MetricWorker.announce`), so a ``wait_final_res`` at the root after the ranks'
    blocking ``wait_submit`` is about that step and waits for this node's forward.

    Clients keep their data until the root's saved state records the step finalized (the node
    relays what the root's replies say), and the node forwards with a fixed client id and fixed
    sequence numbers, so a restarted node re-forwards what its clients resend and the root merges
    it once.
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
            await compat.remote(self.upstream.transport.handle.announce, self.upstream.client_id, step)

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

    def _reply(self, errors: dict[str, str]) -> Reply:
        return Reply(errors, self.incarnation, *self.upstream.finalized_state)

    async def result(self, step: int, timeout: float | None = None) -> StepResult:
        return await asyncio.get_running_loop().run_in_executor(
            self._forwarder, lambda: self.upstream.result(step, timeout)
        )

    async def final(self, timeout: float | None = None) -> StepResult:
        return await asyncio.get_running_loop().run_in_executor(
            self._forwarder, lambda: self.upstream.wait_final_res(timeout)
        )


NodeWorker = ray.remote(**ACTOR_OPTIONS)(_NodeWorker)


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
