"""Ray backend (extra ``ray``): ``actor`` (``MetricWorker``, ``get_metric_worker``), ``node``
(``hierarchy="node"``), ``shell`` (what both actors share), ``store`` (the signed saved state),
``transport`` (a process's sender and watcher), ``compat`` (Ray's private APIs). docs/backends.md, "Ray".
"""

from rlmetrics.backends.ray.actor import DEFAULT_NAME, MetricWorker, get_metric_worker
from rlmetrics.backends.ray.node import NodeWorker, node_worker
from rlmetrics.backends.ray.transport import RayTransport

__all__ = ["DEFAULT_NAME", "MetricWorker", "NodeWorker", "RayTransport", "get_metric_worker", "node_worker"]
