"""A live Prometheus endpoint: the newest merged step as gauges, scraped over HTTP (docs/trackers.md)."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.messages import DEFAULT_AXIS
from rlmetrics.sinks.base import Row, Sink

logger = logging.getLogger(__name__)

_OUTSIDE = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str) -> str:
    """``name`` with every character outside ``[a-zA-Z0-9_]`` made ``_`` (``@`` → ``_at_``).

    >>> prometheus_name("critic/score/mean"), prometheus_name("val-core/acc/mean@4")
    ('critic_score_mean', 'val_core_acc_mean_at_4')
    """
    return _OUTSIDE.sub("_", name.replace("@", "_at_")) or "_"


PROMETHEUS_PORT = "RLMETRICS_PROMETHEUS_PORT"
"""The variable holding the port of :func:`~rlmetrics.sinks.make_sinks`'s endpoint (unset: a free one)."""


class PrometheusSink(Sink):
    """Serve the newest step at :attr:`url` (``port=0``: a free port, :attr:`port`) until :meth:`close`."""

    tracker = "prometheus"
    map_name = staticmethod(prometheus_name)

    @classmethod
    def in_folder(
        cls, out_dir: Path, project: str, run_name: str | None, resume: bool | str, **options: Any
    ) -> PrometheusSink:
        """No files, nothing to resume; ``options``: ``stale``, ``linger``, ``prefix``."""
        return cls(
            int(os.environ.get(PROMETHEUS_PORT) or 0),
            os.environ.get("RLMETRICS_PROMETHEUS_ADDR") or "127.0.0.1",
            run=run_name or Path(out_dir).resolve().name,
            **options,
        )

    def __init__(
        self,
        port: int = 0,
        addr: str = "127.0.0.1",
        *,
        prefix: str = "rlmetrics",
        run: str = "rlmetrics",
        stale: int = 1000,
        linger: float = 60.0,
    ) -> None:
        client = require("prometheus_client", "trackers")
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
            raise ValueError(f"prefix {prefix!r} is no Prometheus metric name")
        self._gauge, self._counter = GaugeMetricFamily, CounterMetricFamily
        self.prefix, self.run, self.stale, self.linger = prefix, run, stale, linger
        self.names.reserve("step", "alerts", "alerts_total", "alerts_created")  # the families served
        self._lock = threading.Condition()
        # axis → (step, {gauge name: (rlmetrics name, value, step)}): replaced whole by log, read by collect
        self._steps: dict[str, tuple[int, dict[str, tuple[str, float, int]]]] = {}
        self._logs = 0  # steps logged
        self._alerts: dict[str, int] = {}
        self.registry = client.CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server, self._thread = client.start_http_server(port, addr=addr, registry=self.registry)
        self.addr, self.port = addr, self._server.server_port
        self._scraped_at = -1  # self._logs at the last scrape (-1: never scraped)
        print(f"prometheus: serving the newest step at {self.url}", file=sys.stderr, flush=True)

    @property
    def url(self) -> str:
        """Where the metrics are scraped."""
        return f"http://{self.addr}:{self.port}/metrics"

    def row(self, metrics: Mapping[str, float], step: int) -> Row:
        row = super().row(metrics, step)
        self._help = {self.names(n): n for n in metrics}  # each gauge's HELP: its rlmetrics name
        return row

    def write(self, row: Row) -> None:
        axis = row.axis or DEFAULT_AXIS  # another axis's names are <axis>/<name>, its step its own
        new = {f"{self.prefix}_{k}": (self._help[k], v, row.step) for k, v in row.scalars.items()}
        _, held = self._steps.get(axis, (row.step, {}))  # less the metrics not logged in `stale` steps:
        held = {g: kept for g, kept in held.items() if kept[2] > row.step - self.stale}
        with self._lock:
            self._steps = {**self._steps, axis: (row.step, {**held, **new})}
            self._logs += 1

    def expect_alerts(self, rules: Sequence[str]) -> None:
        """Serve each rule's alert counter from 0."""
        with self._lock:
            self._alerts = {**dict.fromkeys(rules, 0), **self._alerts}

    def alert(self, alert: Alert) -> None:
        self.check_open()
        with self._lock:
            self._alerts = {**self._alerts, alert.rule: self._alerts.get(alert.rule, 0) + 1}

    def collect(self) -> Iterator[Any]:
        """The prometheus_client collector protocol: the families of the newest steps."""
        with self._lock:
            steps, alerts = self._steps, self._alerts
            self._scraped_at = self._logs
            self._lock.notify_all()
        run = [self.run]
        served = self._gauge(f"{self.prefix}_step", "The step served, per step axis", labels=["run", "axis"])
        for axis, (step, _) in steps.items():
            served.add_metric([self.run, axis], step)
        yield served
        for _, values in steps.values():
            for gauge, (name, value, _) in values.items():
                family = self._gauge(gauge, name, labels=["run"])
                family.add_metric(run, value)
                yield family
        counter = self._counter(f"{self.prefix}_alerts", "Health alerts, per rule", labels=["run", "rule"])
        for rule, count in alerts.items():
            counter.add_metric([self.run, rule], count)
        yield counter

    def finish(self) -> None:
        with self._lock:  # scraped during the run: serve the last step to one more scrape
            if 0 <= self._scraped_at < self._logs:
                print(f"prometheus: serving the last step at {self.url} until it is scraped, at most "
                      f"{self.linger:g} s", file=sys.stderr, flush=True)  # fmt: skip
                self._lock.wait_for(lambda: self._scraped_at == self._logs, self.linger)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __repr__(self) -> str:
        return f"PrometheusSink(url={self.url!r})"
