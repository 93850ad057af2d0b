"""The aggregator actor ``MetricWorker`` and ``get_metric_worker``: a Shell that watches the ranks'
processes, ends steps at their own deadline, and drains the nodes first. docs/steps.md, "Failures".
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

from rlmetrics.backends.options import check_options
from rlmetrics.backends.ray import compat
from rlmetrics.backends.ray.compat import ray
from rlmetrics.backends.ray.shell import AggregatorClass, Shell, keep
from rlmetrics.client import public_id, read_step
from rlmetrics.messages import RayStartedWarning, StepResult, SubmissionError

DEFAULT_NAME = "rlmetrics"
DRAIN_TIMEOUT = 10.0  # seconds a deadline waits for a node sub-aggregator's forward
LIVENESS_PERIOD = 1.0  # seconds between two questions to Ray about the ranks' processes while a step waits
logger = logging.getLogger(__name__)


class _MetricWorker(Shell):
    """The root aggregator: a Shell whose server finalizes steps (options: the Shell's)."""

    def __init__(self, recovery_timeout: float = 30.0, secret: str | None = None, **options: Any) -> None:
        super().__init__(recovery_timeout, secret, **options)
        self.running = True
        self._deadlines: asyncio.Task | None = None
        self._liveness: asyncio.Task | None = None
        self._nodes: dict[str, Any] = {}  # node sub-aggregator handles by actor name

    def changed(self) -> None:
        super().changed()
        if self._deadlines is None and self.server.step_timeout is not None:
            self._deadlines = asyncio.get_running_loop().create_task(self._end_due_steps())
        if self._liveness is None and self.server.processes:
            self._liveness = asyncio.get_running_loop().create_task(self._watch_ranks())

    async def _watch_ranks(self) -> None:
        """While a step is pending, ask Ray each second which ranks' processes are gone, and lose them."""
        while True:
            await asyncio.sleep(LIVENESS_PERIOD)
            watched, engine = self.server.watched(), self.server.engine
            closed = engine.newest_closed  # a step closed below a node is not pending here yet
            if not watched or not (
                engine.pending_steps() or (closed is not None and closed > engine.newest_final)
            ):
                continue
            try:
                gone = compat.gone(watched)
                for client, why in gone.items():
                    self.server.lose(client, why)
            except Exception:  # noqa: BLE001 - asked again in a second
                logger.exception("asking Ray whether the ranks' processes are alive failed")
                continue
            if gone:
                self.changed()
            below = {c: self.server.nodes.get(self.server.via.get(c, "")) for c in gone}
            await asyncio.gather(*(self._call_node(a, "lose", c) for c, a in below.items() if a))

    async def _end_due_steps(self) -> None:
        """Finalize every step whose own deadline passes: sleep until the earliest, or (none) a change."""
        while True:
            steps, due = self.server.tick(finalize=False)
            if not steps:
                await (
                    self._changed.wait() if due is None else asyncio.sleep(max(0.0, due - time.monotonic()))
                )
                continue
            try:
                for step in steps:
                    await self._drain(step)
                    self.server.finalize(step)
                self.server.persist()
                self.changed()
            except Exception:  # noqa: BLE001 - the next deadline is still kept
                logger.exception("finalizing the steps whose deadline passed failed; again in a second")
                await asyncio.sleep(1.0)

    async def _drain(self, step: int, finalize: bool = True) -> None:
        """At a deadline for ``step``: the nodes that speak for a rank it misses forward what they hold."""
        nodes = self.server.nodes_of(step)
        await asyncio.gather(*(self._call_node(address, "drain", step, finalize) for address in nodes))

    async def _call_node(self, address: str, method: str, *args: Any) -> None:
        """``method(*args)`` of the node sub-aggregator at ``address``, at most ``DRAIN_TIMEOUT`` s."""
        try:
            node = self._nodes.get(address) or ray.get_actor(address, namespace=self._namespace)
            self._nodes[address] = node
            await asyncio.wait_for(compat.remote(getattr(node, method), *args), DRAIN_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a node gone: the ranks it spoke for are missing
            logger.warning("node sub-aggregator %s: %s%s failed: %r", address, method, args, exc)

    # ------------------------------------------------------------------ the seed's worker API
    async def start(self) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    async def submit_metric(
        self, metrics: Mapping[str, Any], world_size: int, step: int | None = None
    ) -> None:
        """A submission without a client: into ``step`` (default: the current round, see
        :meth:`~rlmetrics.engine.server.Server.submit_direct`)."""
        self.calls["submit_metric"] += 1
        self.server.submit_direct(metrics, world_size, step)
        self.changed()

    async def wait_final_res(self, timeout: float | None = None, who: str | None = None) -> StepResult:
        return await self.final(timeout, who)

    # ---------------------------------------------------------------------------- reads
    async def result(
        self, step: int, timeout: float | None = None, finalize: bool = False, who: str | None = None
    ) -> StepResult:
        """``step`` once complete; at ``timeout`` final and partial when ``finalize``, else
        provisional; ``who``: the reader's credential."""
        self.calls["result"] += 1
        reader, session = self._reader(who)
        read = self.server.read(read_step(step), reader, session, finalize)
        await self._wait(read.ready, timeout)
        if (drain := read.drain()) is not None:
            await self._drain(*drain)
        out = read.end()
        self.changed()
        return out

    async def final(self, timeout: float | None = None, who: str | None = None) -> StepResult:
        """The seed's ``wait_final_res``, each step once per reader ``who`` (None: the bare read)."""
        self.calls["final"] += 1
        reader, session = self._reader(who)
        server = self.server
        read = server.read(None, reader, session)
        deadline = time.monotonic() + (server.final_timeout if timeout is None else timeout)
        await self._wait(lambda: not server.recovering(), None)
        await self._wait(read.ready, max(0.0, deadline - time.monotonic()))
        if (drain := read.drain()) is not None:
            await self._drain(*drain)
        out = read.end()
        self.changed()
        await self.tell()
        return out

    def _reader(self, who: str | None) -> tuple[str, str | None]:
        """``(reader, session)`` of a reader's credential (None: the seed's bare read, ``""``)."""
        reader = ("", None) if who is None else self._who(who)
        if isinstance(reader, str):
            raise SubmissionError(reader)
        return reader

    # ------------------------------------------------------------------------ membership
    async def relay(
        self, node: str, ranks: list[str], step: int | None, address: str, closer: str | None = None
    ) -> dict[str, str]:
        """Node ``node`` (at ``address``) speaks for ``ranks``; ``closer`` closed ``step``. The refused."""
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
        self.changed()
        return refused


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
    """The named aggregator actor, created if absent: call it from the driver first (docs/backends.md, "Ray").

    Args:
        name: the actor's name, as ranks pass it to ``connect("ray", name=...)``.
        namespace: its Ray namespace (None: the current job's).
        num_cpus: the CPUs the actor reserves (on creation).
        hierarchy: ``"node"`` also creates a sub-aggregator on every alive node (docs/backends.md,
            "Thousands of ranks").
        options: used on creation only: the aggregator's (:data:`~rlmetrics.backends.options.OPTIONS`,
            ``recovery_timeout``, ``secret``) and ``lifetime`` (``"detached"`` outlives this process).

    Returns:
        The actor handle, which this process keeps: a non-detached actor lives as long as its creator;
        ``ray.kill(handle)`` ends it.

    Raises:
        TypeError: an option neither the aggregator nor the Ray actor takes, naming its owner.
        ValueError: ``hierarchy`` neither None nor ``"node"`` (raised before anything is created).

    Warns:
        RayStartedWarning: Ray was not initialized and ``ray.init()`` started a local instance.
    """
    check_options("get_metric_worker()", "ray", options, ("aggregator", "Ray actor"))
    check_hierarchy(hierarchy)
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
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        nodes = [node_worker(name, namespace, node, **actor_opts, **options) for node in alive]
        ray.get([n.ping.remote() for n in nodes])
    return root


def check_hierarchy(hierarchy: Any) -> None:
    """ValueError unless ``hierarchy`` is None or ``"node"`` (checked before anything is created)."""
    if hierarchy not in (None, "node"):
        raise ValueError(f"hierarchy must be None or 'node', got {hierarchy!r}")
