"""Ray backend: the seed's ``MetricWorker`` actor and its clients' transport (extra ``ray``).

- :mod:`~rlmetrics.backends.ray.actor`: ``MetricWorker`` (the root aggregator actor) and
  ``get_metric_worker``;
- :mod:`~rlmetrics.backends.ray.node`: per-node sub-aggregators (``hierarchy="node"``);
- :mod:`~rlmetrics.backends.ray.shell`: what both actors share (a
  :class:`~rlmetrics.engine.server.Server`, decoding, asyncio waiting) and how they are made;
- :mod:`~rlmetrics.backends.ray.store`: ``KVStore``, the signed saved state in Ray's KV store;
- :mod:`~rlmetrics.backends.ray.transport`: ``RayTransport``, the per-process sender and watcher;
- :mod:`~rlmetrics.backends.ray.compat`: every private Ray API the backend uses.
"""

from rlmetrics.backends.ray.actor import DEFAULT_NAME, MetricWorker, get_metric_worker
from rlmetrics.backends.ray.node import NodeWorker, node_worker
from rlmetrics.backends.ray.transport import RayTransport

__all__ = ["DEFAULT_NAME", "MetricWorker", "NodeWorker", "RayTransport", "get_metric_worker", "node_worker"]
