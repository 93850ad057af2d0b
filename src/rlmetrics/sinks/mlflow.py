"""MLflow, through ``MlflowClient`` on any tracking URI (``sqlite:///path/mlflow.db`` for local runs).

Needs the ``trackers`` extra. A run is created in ``experiment`` (created if missing); each step is
one ``log_batch`` call (chunks of 1000 metrics, MLflow's batch limit); ``close()`` marks the run
FINISHED. ``tracking_uri=None`` uses MLflow's default (``MLFLOW_TRACKING_URI`` or its local store).
MLflow's usage telemetry is switched off (``MLFLOW_DISABLE_TELEMETRY=true``) unless that variable is
already set. Names are adapted by :func:`rlmetrics.sinks.names.adapt_name` (MLflow refuses ``@``).
View with ``mlflow ui --backend-store-uri sqlite:///path/mlflow.db``. Histograms
(:mod:`rlmetrics.histogram`) are not written: MLflow has no histogram metric (the JSONL file,
TensorBoard and W&B have them).

``resume=<run id>`` continues that run (marked RUNNING again) and skips every step up to the last one
it holds (the largest step of its latest metrics but the ``alert/`` ones, written in the same
transaction as the metrics).
A step of more than 1000 metrics is several batches: a crash between two keeps the batches written,
and that step is not written again. A health alert is the metric ``alert/<rule> = 1`` at its step
(one point per rule and step) and the tag ``alert/<rule>`` holding the rule's latest message. A
resumed sink does not write again an alert its run holds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from rlmetrics.extras import require
from rlmetrics.health import Alert
from rlmetrics.sinks.names import NameMap, Sink, as_floats, as_step

_BATCH = 1000


class MLflowSink(Sink):
    """Log each step as a batch of metrics of one MLflow run."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "rlmetrics",
        run_name: str | None = None,
        resume: str | None = None,
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        tracking = require("mlflow.tracking", "trackers")
        entities = require("mlflow.entities", "trackers")
        self._Metric, self._RunTag = entities.Metric, entities.RunTag
        self.client = tracking.MlflowClient(tracking_uri)
        self.names = NameMap("mlflow")
        if resume:
            run = self.client.get_run(resume)
            self.run_id = run.info.run_id
            if run.info.status != "RUNNING":
                self.client.update_run(self.run_id, status="RUNNING")
            latest = run.data.to_proto().metrics
            self.resumed_at = max((m.step for m in latest if not m.key.startswith("alert/")), default=None)
            self._alerted = {
                (m.step, m.key)
                for key in {m.key for m in latest if m.key.startswith("alert/")}
                for m in self.client.get_metric_history(self.run_id, key)
            }
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self._open = True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._open:
            raise ValueError(f"{self!r} is closed")
        step = as_step(step)
        values = self.names.adapt(as_floats(metrics))
        if self.skips(step):
            return
        now = int(time.time() * 1000)
        batch = [self._Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + _BATCH])

    def alert(self, alert: Alert) -> None:
        if not self._open:
            raise ValueError(f"{self!r} is closed")
        key = self.names(f"alert/{alert.rule}")
        new = self.new_alert((alert.step, key))  # one point per rule and step
        metrics = [self._Metric(key, 1.0, int(time.time() * 1000), alert.step)] if new else []
        self.client.log_batch(self.run_id, metrics=metrics, tags=[self._RunTag(key, str(alert))])

    def close(self) -> None:
        if self._open:
            self._open = False
            self.client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"MLflowSink(run_id={self.run_id!r})"
