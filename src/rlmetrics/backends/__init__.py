"""Backends (docs/backends.md): ``connect`` picks where the aggregator runs, ``MetricClient`` wraps one."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

from rlmetrics.axes import connect_axes
from rlmetrics.backends import local
from rlmetrics.backends.options import OPTIONS, check_options
from rlmetrics.client import ClientCore, Transport, rank_arg, world_size_arg
from rlmetrics.compute_local import ComputeLocal


class MetricClient(ComputeLocal, ClientCore):
    """The seed's client: ``MetricClient(metric_worker)``, then ``submit_metric`` / ``wait_submit`` /
    ``wait_final_res`` / ``stop``, ``result(step, timeout)`` and the seed's ``compute_local_*`` calls.

    ``metric_worker``: a Ray ``MetricWorker`` actor handle, a
    :class:`~rlmetrics.backends.local.LocalMetricWorker` or any transport (else TypeError).
    Options: ``world_size``, ``nan_strategy``, ``label``, ``rank`` (:class:`~rlmetrics.client.ClientCore`).

    >>> worker = local.LocalMetricWorker()
    >>> client = MetricClient(worker)
    >>> client.submit_metric({"loss": 2.0, "critic/score/max": 3.0}, 1)
    >>> client.wait_submit()
    >>> dict(client.wait_final_res())
    {'loss': 2.0, 'critic/score/max': 3.0}
    """

    def __init__(self, metric_worker: Any, **options: Any) -> None:
        transport = metric_worker
        ray = sys.modules.get("ray")  # a Ray actor handle exists only where Ray was imported
        if ray is not None and isinstance(metric_worker, ray.actor.ActorHandle):
            from rlmetrics.backends import ray as ray_backend

            transport = ray_backend.RayTransport(metric_worker)
        elif not isinstance(metric_worker, Transport):
            raise TypeError(
                f"MetricClient needs a MetricWorker actor handle, a LocalMetricWorker or a transport, "
                f"got {type(metric_worker).__name__}"
            )
        super().__init__(transport, **options)
        transport.watch(self)


def connect(
    backend: str = "local",
    *,
    world_size: int | None = None,
    name: str = "default",
    axes: Iterable[str] | None = None,
    nan_strategy: str = "propagate",
    label: str | None = None,
    rank: int | None = None,
    blocking: bool = True,
    naming: Any = None,
    **options: Any,
):
    """A client of the named aggregator of ``backend`` (docs/backends.md).

    Args:
        backend: ``"local"`` (one in-process aggregator per ``name``, a client per rank or thread),
            ``"ray"`` (one named ``MetricWorker`` actor per ``name`` and ``namespace`` in the
            cluster) or ``"torch"`` (a :class:`~rlmetrics.backends.torch_dist.TorchMetricClient`
            on ``group=``: ``wait_submit()`` is a collective of its ranks; ``name`` is not used).
        world_size: the client is a rank, registered at once: no step completes before it closed it.
        name: the aggregator's name.
        axes: other step axes (``("policy_version",)``): an :class:`~rlmetrics.axes.AxesClient`.
        nan_strategy, label, rank, blocking, naming: the client's (:class:`~rlmetrics.client.ClientCore`;
            ``rank``: the order of its validation samples, torch: the group rank; ``naming``'s
            ``renames`` are the aggregator's default; ``blocking`` is not a torch option).
        options: the backend's, used by the call that creates its aggregator
            (:data:`~rlmetrics.backends.options.OPTIONS`): ``final_timeout``, ``step_timeout``,
            ``renames``, ``keep_results``, ``forget_after``, ``max_pending``; Ray also ``namespace``,
            ``num_cpus``, ``lifetime``, ``recovery_timeout``, ``secret``, ``hierarchy="node"`` (a
            client sends to its node's sub-aggregator, which forwards one message per step).

    Returns:
        A new client (:class:`MetricClient`; torch: ``TorchMetricClient``).

    Raises:
        ValueError: an unknown backend, a bad ``world_size``, ``nan_strategy`` or ``rank``.
        TypeError: an option no layer of ``backend`` takes, naming its owner or close match.

    Example:
    >>> import rlmetrics
    >>> client = rlmetrics.connect("local", world_size=1, name="connect-doc")
    >>> client.submit_metric({"timing_s/gen": 0.5})
    >>> client.wait_submit()
    >>> dict(client.result(0))
    {'perf/delta_time/gen': 0.5}
    >>> rlmetrics.backends.local.drop_worker("connect-doc")  # the aggregator is gone
    """
    mine = {
        "nan_strategy": nan_strategy,
        "label": label,
        "rank": rank,
        "blocking": blocking,
        "naming": naming,
    }
    if axes is not None:
        return connect_axes(connect, backend, axes, name, world_size=world_size, **mine, **options)
    if world_size is not None:  # before any aggregator is made for it
        world_size_arg(world_size)
    rank_arg(nan_strategy, rank)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {tuple(BACKENDS)}")
    check_options(
        f"connect({backend!r})", backend, [*options, *(["blocking"] if blocking is not True else [])]
    )
    client_opts = {k: v for k, v in mine.items() if k in OPTIONS[backend]["client"]}
    if naming is not None:
        options.setdefault("renames", dict(naming.renames))
    client = BACKENDS[backend](name, world_size, client_opts, options)
    if world_size is not None:  # a rank: waited for from its first step on
        client.register()
    return client


def _connect_local(name: str, world_size: int | None, client_opts: dict, options: dict) -> MetricClient:
    return MetricClient(local.get_worker(name, **options), world_size=world_size, **client_opts)


def _connect_torch(name: str, world_size: int | None, client_opts: dict, options: dict) -> ClientCore:
    from rlmetrics.backends import torch_dist

    return torch_dist.TorchMetricClient(world_size=world_size, **client_opts, **options)


def _connect_ray(name: str, world_size: int | None, client_opts: dict, options: dict) -> MetricClient:
    from rlmetrics.backends import ray as ray_backend
    from rlmetrics.backends.ray.actor import check_hierarchy

    name = name if name != "default" else ray_backend.DEFAULT_NAME
    hierarchy = options.pop("hierarchy", None)
    check_hierarchy(hierarchy)
    root = ray_backend.get_metric_worker(name, **options)
    if hierarchy is None:
        return MetricClient(root, world_size=world_size, **client_opts)
    node = ray_backend.node_worker(name, **options)
    return MetricClient(ray_backend.RayTransport(node, root=root), world_size=world_size, **client_opts)


BACKENDS: dict[str, Callable[[str, int | None, dict, dict], Any]] = {
    "local": _connect_local,
    "ray": _connect_ray,
    "torch": _connect_torch,
}
"""Backend name → ``(name, world_size, client_options, aggregator_options) -> client`` (:func:`connect`)."""
